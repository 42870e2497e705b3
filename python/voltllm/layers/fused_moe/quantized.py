"""Quantized experts (AWQ, GPTQ, compressed-tensors, FP8 MoE checkpoints) through the quantization
seam: each expert matrix is read in its format's checkpoint layout and converted to a `QuantizedWeight`.

A format's linear method (`QuantizedLinearMethod`) already knows its checkpoint tensors and how to turn
them into a `QuantizedWeight`; the experts reuse it. `create_weights` asks it for one expert's gate/up
(`[gate | up]`, two output shards) and down parameters and registers each stacked over the experts
(`w13_qweight [E, ...]`, `w2_scales [E, ...]`: dims shifted by one, dim 0 the expert), so the per-expert
checkpoint tensors (`experts.<e>.gate_proj.qweight`) load through `FusedMoE`'s loader like dense ones.
After loading, each expert's slice is converted by the same method and the checkpoint layout is dropped.

Arithmetic. On a GPU with float16 activations, where the expert kernels take the experts
(`voltllm.ops.moe_quantized`: 4-/8-bit int or fp8, the quantized linear kernels' group sizes, act-order
included), each stack is packed into their layout once (`pack_experts`) and the step runs on the device
with no host sync: pair by pair at decode sizes (each selected expert's packed weights read once), the
stacks dequantized into transient fp16 buffers for the fp16 expert kernels above that; a decode step
captures in a CUDA graph. Elsewhere (the CPU, bfloat16 models, shapes the kernels do not take) the
experts keep their codes (one byte a code) and are dequantized one used expert at a time while a step
runs (`DequantizingExperts` under the grouped torch form, `experts_grouped`); that form needs the
per-expert counts on the host, so a CUDA-graph capture of it is refused naming `enforce_eager`.
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace

import torch
from torch import nn

from voltllm.layers.fused_moe.experts_torch import experts_grouped
from voltllm.layers.fused_moe.method import FusedMoEMethodBase
from voltllm.layers.fused_moe.router import select_experts
from voltllm.layers.parameter import set_weight_attrs
from voltllm.layers.quantization.quantized_method import QuantizedLinearMethod
from voltllm.layers.quantization.quantized_weight import QuantizedWeight, dequantize
from voltllm.ops.moe import MAX_TOP_K, topk_softmax
from voltllm.ops.moe_quantized import (
    PackedQuantExperts,
    experts_unsupported_reason,
    fused_moe_quantized,
    fused_moe_quantized_applies,
    pack_experts,
)

# The loading rules a format's parameter may carry that count dimensions (shifted by the expert dim).
_DIM_ATTRS = ("input_dim", "output_dim", "packed_dim")
# (stacked name prefix, the expert matrices it stacks)
_STACKS = (("w13_", ("w1", "w3")), ("w2_", ("w2",)))


class DequantizingExperts:
    """`[E, out, in]` experts that dequantize on indexing: `experts[e]` is expert e's dense weight in
    `dtype` (what `experts_grouped` reads, one used expert at a time)."""

    def __init__(self, weights: list[QuantizedWeight], dtype: torch.dtype) -> None:
        self.weights = weights
        self.dtype = dtype
        self.shape = (len(weights), *weights[0].shape)

    def __getitem__(self, expert: int) -> torch.Tensor:
        return dequantize(self.weights[expert], self.dtype)


class QuantizedFusedMoEMethod(FusedMoEMethodBase):
    """Experts in a quantized checkpoint format, via that format's linear method (`make_method`
    returns a fresh one for one matrix kind)."""

    def __init__(self, make_method: Callable[[], QuantizedLinearMethod]) -> None:
        self.make_method = make_method
        self.methods: dict[str, QuantizedLinearMethod] = {}  # stack prefix -> one expert's method
        self.checkpoint_params: list[str] = []  # the stacked checkpoint-layout parameters
        self.params_dtype = torch.float16
        self.shapes: dict[str, tuple[int, list[int], int, int]] = {}  # see create_weights

    def create_weights(
        self,
        layer: nn.Module,
        num_experts: int,
        hidden_size: int,
        intermediate_size_per_partition: int,
        params_dtype: torch.dtype,
    ) -> None:
        self.params_dtype = params_dtype
        inter = intermediate_size_per_partition
        shapes = {  # (input per rank, output shards, full input, full output) of one expert's matrix
            "w13_": (hidden_size, [inter, inter], hidden_size, 2 * inter),
            "w2_": (inter, [hidden_size], inter * layer.tp_size, hidden_size),
        }
        self.shapes = shapes
        for stack, kinds in _STACKS:
            scratch = self._scratch_layer(layer, stack)
            method = self.make_method()
            method.create_weights(scratch, *shapes[stack], params_dtype)
            self.methods[stack] = method
            for name in method.checkpoint_params:
                one = getattr(scratch, name)
                stacked = nn.Parameter(
                    torch.empty(num_experts, *one.shape, dtype=one.dtype), requires_grad=False
                )
                attrs = {a: getattr(one, a) + 1 for a in _DIM_ATTRS if hasattr(one, a)}
                if hasattr(one, "pack_factor"):
                    attrs["pack_factor"] = one.pack_factor
                set_weight_attrs(stacked, {**attrs, "moe_kinds": kinds})
                layer.register_parameter(stack + name, stacked)
                self.checkpoint_params.append(stack + name)

    def fill_dummy(self, layer: nn.Module, generator: torch.Generator) -> None:
        """Random valid checkpoint-layout values for every expert (`load_format="dummy"`)."""
        for stack, method in self.methods.items():
            for expert in range(layer.num_experts):
                method.fill_dummy(self._expert_view(layer, stack, expert), generator)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        stacks = {
            stack: [
                method.to_quantized_weight(self._expert_view(layer, stack, e))
                for e in range(layer.num_experts)
            ]
            for stack, method in self.methods.items()
        }
        for name in self.checkpoint_params:
            delattr(layer, name)  # the checkpoint layout is not needed any more
        reason = self.kernels_unsupported_reason(layer, stacks)
        for stack, weights in stacks.items():
            if reason is None:
                setattr(layer, f"{stack}packed", pack_experts(weights))
            else:
                setattr(layer, f"{stack}experts", DequantizingExperts(weights, self.params_dtype))
        layer.quantized_kernels_unsupported = reason

    def kernels_unsupported_reason(
        self, layer: nn.Module, stacks: dict[str, list[QuantizedWeight]]
    ) -> str | None:
        """Why the experts stay on the torch form (None: the CUDA kernels run them)."""
        if not stacks["w13_"][0].codes.is_cuda:
            return "the experts are not on a CUDA device"
        if self.params_dtype != torch.float16:
            return f"the quantized expert kernels take float16 activations, not {self.params_dtype}"
        if layer.top_k > MAX_TOP_K:
            return f"top_k {layer.top_k} (the kernels take up to {MAX_TOP_K})"
        for stack, weights in stacks.items():
            reason = experts_unsupported_reason(weights)
            if reason is not None:
                return f"{'gate/up' if stack == 'w13_' else 'down'} {reason}"
        if stacks["w2_"][0].shape[1] % 8:
            return f"intermediate size {stacks['w2_'][0].shape[1]} is not a multiple of 8"
        return None

    def apply(self, layer: nn.Module, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        w13_packed: PackedQuantExperts | None = getattr(layer, "w13_packed", None)
        w2_packed: PackedQuantExperts | None = getattr(layer, "w2_packed", None)
        if w13_packed is not None and w2_packed is not None:
            topk_weights, topk_ids = topk_softmax(router_logits, layer.top_k, layer.renormalize)
            x = x if x.stride(1) == 1 and x.stride(0) % 8 == 0 and x.data_ptr() % 16 == 0 else x.contiguous()
            if not fused_moe_quantized_applies(x, w13_packed, w2_packed, layer.top_k):
                raise ValueError(
                    f"{layer.prefix}: the quantized expert kernels take float16 [tokens, "
                    f"{w13_packed.in_features}] inputs on CUDA, got {x.dtype} {tuple(x.shape)} on {x.device}"
                )
            return fused_moe_quantized(x, w13_packed, w2_packed, topk_weights, topk_ids.to(torch.int32))
        w13, w2 = getattr(layer, "w13_experts", None), getattr(layer, "w2_experts", None)
        if w13 is None or w2 is None:
            raise RuntimeError(f"{layer.prefix}: quantized experts used before process_weights_after_loading")
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"{layer.prefix}: these quantized experts run eagerly on the torch form "
                f"({layer.quantized_kernels_unsupported}); start the engine with enforce_eager=True "
                "(--enforce-eager)"
            )
        topk_weights, topk_ids = select_experts(router_logits, layer.top_k, layer.renormalize)
        return experts_grouped(x, w13, w2, topk_weights, topk_ids)

    def _expert_view(self, layer: nn.Module, stack: str, expert: int) -> SimpleNamespace:
        """One expert's slice of each stacked parameter, under the names its format's method reads."""
        method = self.methods[stack]
        view = self._scratch_layer(layer, stack, expert)
        for name in method.checkpoint_params:
            setattr(view, name, getattr(layer, stack + name).data[expert])
        return view

    def _scratch_layer(self, layer: nn.Module, stack: str, expert: int | None = None) -> SimpleNamespace:
        """What a format's linear method reads of its layer besides its parameters: a name for its
        errors, the rank, one expert matrix's sizes; parameters registered on it land as attributes."""
        which = "gate_up" if stack == "w13_" else "down"
        in_per_rank, outs, in_full, out_full = self.shapes[stack]
        scratch = SimpleNamespace(
            prefix=f"{layer.prefix}.{'' if expert is None else f'{expert}.'}{which}",
            tp_rank=layer.tp_rank,
            tp_size=layer.tp_size,
            input_size=in_full,
            input_size_per_partition=in_per_rank,
            output_size=out_full,
            output_partition_sizes=outs,
        )
        scratch.register_parameter = lambda key, param: setattr(scratch, key, param)
        return scratch
