"""`FusedMoE`: a layer's experts as stacked tensors, sharded over the tensor-parallel ranks.

Rank r holds, of every expert, intermediate features r of tp_size: its slice of the gate and up rows
(stacked `[gate_r | up_r]`, so SwiGLU of the local output is the rank's slice of the activation, as in
`MergedColumnParallelLinear`) and the matching columns of down. Each rank's output is a partial sum
over its features; `reduce_results` all-reduces it (a block that adds a shared expert first sums both
and reduces once). At tp_size 1 nothing is sliced and no collective runs.

Checkpoints store one matrix per expert (`experts.<e>.gate_proj` / `up_proj` / `down_proj` for Qwen,
`experts.<e>.w1` / `w3` / `w2` for Mixtral), which the weight loader takes with `shard_id = (e, kind)`,
kind "w1" (gate), "w3" (up) or "w2" (down); transformers >= 5 can also write them stacked over the
experts (`experts.gate_up_proj [E, 2 * I, H]`, `experts.down_proj [E, H, I]`), which load with
`shard_id=None`.
"""

from __future__ import annotations

import torch
from torch import nn

from voltllm.distributed import (
    divide,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_reduce,
)
from voltllm.layers.fused_moe.method import (
    FusedMoEMethodBase,
    fused_moe_method_for,
)
from voltllm.layers.parameter import (
    copy_checked,
    default_weight_loader,
    packed_units,
    rank_slice,
    set_weight_attrs,
)
from voltllm.layers.quantization import QuantizationConfig

ShardId = tuple[int, str]  # (expert, "w1" | "w3" | "w2")


class FusedMoE(nn.Module):
    """`x [T, hidden], router_logits [T, num_experts] -> [T, hidden]`: each token's top-k experts
    (softmax in fp32, renormalised when `renormalize`), weighted and summed."""

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,  # one expert's, before sharding
        renormalize: bool,
        reduce_results: bool = True,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"top_k {top_k} must be in 1..num_experts ({num_experts})")
        self.num_experts = num_experts
        self.top_k = top_k
        self.hidden_size = hidden_size
        self.renormalize = renormalize
        self.reduce_results = reduce_results
        self.prefix = prefix
        self.tp_rank = get_tensor_model_parallel_rank()
        self.tp_size = get_tensor_model_parallel_world_size()
        self.intermediate_size_per_partition = divide(
            intermediate_size, self.tp_size, "moe intermediate size"
        )
        self._shared_loaded: dict[int, set[int]] = {}  # see _load_shared
        self.moe_method: FusedMoEMethodBase = fused_moe_method_for(quant_config, self, prefix)
        self.moe_method.create_weights(
            self, num_experts, hidden_size, self.intermediate_size_per_partition, torch.get_default_dtype()
        )
        for param in self.parameters(recurse=False):
            kinds = getattr(param, "moe_kinds", ())
            attrs = {"shard_ids": tuple((e, kind) for e in range(num_experts) for kind in kinds)}
            if not hasattr(param, "weight_loader"):  # a method may bring its own
                attrs["weight_loader"] = self.weight_loader
            set_weight_attrs(param, attrs)

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        return self._reduced(self.moe_method.apply(self, x, router_logits))

    def _reduced(self, out: torch.Tensor) -> torch.Tensor:
        if self.reduce_results and self.tp_size > 1:
            out = tensor_model_parallel_all_reduce(out)
        return out

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: ShardId | None = None
    ) -> None:
        kinds = getattr(param, "moe_kinds", ())
        if not kinds:  # a parameter shared by all experts (e.g. a per-layer scale)
            default_weight_loader(param, loaded_weight)
            return
        if shard_id is None:
            self._load_stacked(param, loaded_weight, kinds)
            return
        expert, kind = shard_id
        if not 0 <= expert < self.num_experts or kind not in kinds:
            raise ValueError(f"shard {shard_id!r} is not one of experts 0..{self.num_experts - 1} x {kinds}")
        self._load_expert(param, loaded_weight, expert, kind)

    def _load_stacked(self, param: nn.Parameter, loaded_weight: torch.Tensor, kinds: tuple[str, ...]) -> None:
        """A checkpoint tensor stacked over the experts, its kinds concatenated along the output dim."""
        if loaded_weight.shape[0] != self.num_experts:
            raise ValueError(
                f"stacked experts {tuple(loaded_weight.shape)}: expected {self.num_experts} experts"
            )
        dim = param.output_dim - 1  # in one expert's matrix
        for expert in range(self.num_experts):
            parts = loaded_weight[expert].chunk(len(kinds), dim=dim)
            for kind, part in zip(kinds, parts, strict=True):
                self._load_expert(param, part, expert, kind)

    def _load_expert(self, param: nn.Parameter, loaded_weight: torch.Tensor, expert: int, kind: str) -> None:
        """Copy this rank's slice of expert `expert`'s `kind` matrix (`[out, in]`, as in checkpoints)."""
        kinds = getattr(param, "moe_kinds", ())
        dst = param.data[expert]
        if (
            dst.dim() == loaded_weight.dim() + 1
            and dst.shape[0] == len(kinds) > 0
            and not hasattr(param, "output_dim")
        ):
            dst[kinds.index(kind)].copy_(
                loaded_weight
            )  # one row per matrix (compressed-tensors' weight_shape)
            return
        if kind == "w2" and not hasattr(param, "input_dim"):  # not sharded over the ranks (GPTQ groups)
            copy_checked(dst, loaded_weight)
            return
        if kind != "w2" and not hasattr(param, "output_dim"):  # one tensor gate and up share (GPTQ g_idx)
            self._load_shared(param, loaded_weight, expert, kind)
            return
        if kind == "w2":  # down: the intermediate features are its input columns
            dim = param.input_dim - 1
            copy_checked(dst, rank_slice(loaded_weight, dim, self.tp_rank, self.tp_size, dst.shape[dim]))
            return
        # gate (w1) / up (w3): the first / second half of this expert's output rows
        dim = param.output_dim - 1
        size = packed_units(param, param.output_dim, self.intermediate_size_per_partition)
        dst = dst.narrow(dim, 0 if kind == "w1" else size, size)
        copy_checked(dst, rank_slice(loaded_weight, dim, self.tp_rank, self.tp_size, size))

    def _load_shared(self, param: nn.Parameter, loaded_weight: torch.Tensor, expert: int, kind: str) -> None:
        """A tensor both gate and up carry whole (GPTQ's g_idx of their common input, which no rank
        shards): the first one loaded fills the expert's slot, the other must equal it."""
        dst = param.data[expert]
        seen = self._shared_loaded.setdefault(id(param), set())
        if expert not in seen:
            copy_checked(dst, loaded_weight)
            seen.add(expert)
        elif not torch.equal(dst, loaded_weight.to(dst.device)):
            raise ValueError(
                f"{self.prefix}: expert {expert}'s {kind} has a different tensor from its gate/up twin; "
                "gate and up of one expert must share it"
            )

    def extra_repr(self) -> str:
        return (
            f"experts={self.num_experts}, top_k={self.top_k}, hidden={self.hidden_size}, "
            f"intermediate={self.intermediate_size_per_partition}, renormalize={self.renormalize}, "
            f"tp={self.tp_rank}/{self.tp_size}, method={type(self.moe_method).__name__}"
        )
