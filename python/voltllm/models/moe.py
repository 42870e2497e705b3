"""Sparse mixture-of-experts MLP blocks of the decoder family (Qwen2-MoE, Qwen3-MoE, Mixtral).

A layer's MLP is sparse where the config says so (`sparse_layer_ids`); there it is a router
(`gate`, a replicated `[num_experts, hidden]` linear), the experts (`FusedMoE`: each token's top-k,
softmax in fp32, renormalised where the architecture does) and, for Qwen2-MoE, a shared expert every
token takes, scaled by `sigmoid(shared_expert_gate(x))`. Module names follow transformers >= 5
(`mlp.gate`, `mlp.experts`, `mlp.shared_expert`, `mlp.shared_expert_gate`); the stacked experts are
`mlp.experts.w13_weight` / `w2_weight`, loaded from per-expert checkpoint tensors (`EXPERT_SHARDS`).

Where the architectures differ (`MoeVariant`):
- Qwen2-MoE / Qwen3-MoE: experts of `moe_intermediate_size`, renormalised iff `norm_topk_prob`,
  sparse on layers `(i + 1) % decoder_sparse_step == 0` not in `mlp_only_layers` (the others keep a
  dense MLP of `intermediate_size`); Qwen2-MoE adds the shared expert of
  `shared_expert_intermediate_size`.
- Mixtral: experts of `intermediate_size`, always renormalised, every layer sparse; classic
  checkpoints name the block `block_sparse_moe` and an expert's matrices `w1` / `w3` / `w2`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from voltllm.distributed import get_tensor_model_parallel_world_size, tensor_model_parallel_all_reduce
from voltllm.layers.fused_moe import FusedMoE
from voltllm.layers.linear import ReplicatedLinear, ResidualStream
from voltllm.layers.norm import RMSNorm
from voltllm.layers.quantization import QuantizationConfig
from voltllm.models.checkpoint import ExpertShard, FusedShard


@dataclass(frozen=True)
class MoeVariant:
    """How one architecture's sparse blocks are sized and named."""

    expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")  # gate, up, down
    block_name: str = "mlp"  # the sparse block's name in classic checkpoints (Mixtral: block_sparse_moe)
    renormalize: bool | None = None  # None: follow config.norm_topk_prob
    expert_size_key: str = "moe_intermediate_size"  # the config field of one expert's intermediate size
    shared_expert: bool = False  # a dense expert every token takes, gated by sigmoid (Qwen2-MoE)


@dataclass(frozen=True)
class SparseMoeSpec:
    """One model's sparse-block shapes, read from its config."""

    num_experts: int
    top_k: int
    intermediate_size: int  # one expert's
    renormalize: bool
    shared_expert_intermediate_size: int  # 0: no shared expert
    sparse_layer_ids: frozenset[int]

    @staticmethod
    def of(hf_config: Any, variant: MoeVariant) -> SparseMoeSpec:
        num_experts = getattr(hf_config, "num_experts", None)
        if num_experts is None:
            num_experts = hf_config.num_local_experts
        renormalize = variant.renormalize
        if renormalize is None:
            renormalize = bool(getattr(hf_config, "norm_topk_prob", False))
        shared = getattr(hf_config, "shared_expert_intermediate_size", 0) if variant.shared_expert else 0
        return SparseMoeSpec(
            num_experts=num_experts,
            top_k=hf_config.num_experts_per_tok,
            intermediate_size=getattr(hf_config, variant.expert_size_key),
            renormalize=renormalize,
            shared_expert_intermediate_size=shared or 0,
            sparse_layer_ids=frozenset(sparse_layer_ids(hf_config, num_experts)),
        )


def sparse_layer_ids(hf_config: Any, num_experts: int) -> list[int]:
    """The layers whose MLP is sparse, as transformers decides: `(i + 1) % decoder_sparse_step == 0`
    and not in `mlp_only_layers` (both absent from Mixtral configs: every layer)."""
    if num_experts <= 0:
        return []
    step = getattr(hf_config, "decoder_sparse_step", 1) or 1
    dense = set(getattr(hf_config, "mlp_only_layers", None) or ())
    return [i for i in range(hf_config.num_hidden_layers) if (i + 1) % step == 0 and i not in dense]


def expert_shards(variant: MoeVariant) -> tuple[ExpertShard, ...]:
    """Per-expert checkpoint matrices onto the stacked parameters of `FusedMoE`."""
    gate, up, down = variant.expert_names
    return (ExpertShard(gate, "w13_", "w1"), ExpertShard(up, "w13_", "w3"), ExpertShard(down, "w2_", "w2"))


# transformers >= 5 with save_original_format=False writes the experts already stacked.
STACKED_EXPERT_SHARDS = (
    FusedShard(".experts.gate_up_proj", ".experts.w13_weight", None),
    FusedShard(".experts.down_proj", ".experts.w2_weight", None),
)


class SparseMoeBlock(nn.Module):
    """Router, experts and the optional shared expert: `x [T, hidden] -> [T, hidden]`.

    `shared_expert` is built by the caller (a dense MLP whose output is left unreduced); the experts'
    and the shared expert's partial sums are added, then reduced over the ranks once.
    """

    def __init__(
        self,
        spec: SparseMoeSpec,
        hidden_size: int,
        shared_expert: nn.Module | None = None,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__()
        self.tp_size = get_tensor_model_parallel_world_size()  # the group it is built for, as the layers
        # The experts first: a quantization format without MoE support is refused naming that, before the
        # router (which checkpoints leave unquantized) meets the format's layout rules.
        self.experts = FusedMoE(
            spec.num_experts,
            spec.top_k,
            hidden_size,
            spec.intermediate_size,
            spec.renormalize,
            reduce_results=False,
            quant_config=quant_config,
            prefix=f"{prefix}.experts",
        )
        self.gate = ReplicatedLinear(
            hidden_size, spec.num_experts, bias=False, quant_config=quant_config, prefix=f"{prefix}.gate"
        )
        self.shared_expert = shared_expert
        if shared_expert is not None:
            self.shared_expert_gate = ReplicatedLinear(
                hidden_size, 1, bias=False, quant_config=quant_config, prefix=f"{prefix}.shared_expert_gate"
            )
        else:
            self.shared_expert_gate = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._with_shared_expert(x, self.experts(x, self.gate(x)))

    def leading_weights(self) -> tuple[torch.Tensor, ...]:
        """The weights a forward reads, in order, before any read that depends on its input: the
        router's (which experts are read depends on it; the shared expert comes after them)."""
        return self.gate.streamed_weights()

    def _with_shared_expert(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return tensor_model_parallel_all_reduce(out) if self.tp_size > 1 else out

    def stream_forward(self, stream: ResidualStream, norm: RMSNorm, next_norm: RMSNorm) -> ResidualStream:
        """`self(norm(stream))` into the stream (the decoder layer's MLP interface); the norm runs as
        its own kernel and `next_norm` is left to the next layer."""
        normed, residual = (
            (stream.hidden, stream.residual) if stream.normed else norm(stream.hidden, stream.residual)
        )
        return ResidualStream(self(normed), residual)
