"""The weight-method seam of the fused MoE layer, mirroring `LinearMethodBase` for the experts.

`FusedMoE` (`voltllm.layers.fused_moe.layer`) decides which shard of every expert this rank holds (its
slice of the intermediate features) and loads checkpoint tensors into it; its `FusedMoEMethodBase`
decides the parameters and the arithmetic:
- `create_weights` registers the stacked expert parameters and marks each with its loading rules
  (`voltllm.layers.parameter`): `output_dim` / `input_dim` counted in the stacked tensor (dim 0 is the
  expert), and `moe_kinds`, the expert matrices it stacks along `output_dim` ("w1" gate and "w3" up,
  or "w2" down);
- `apply` routes the tokens and computes the weighted sum of their experts;
- `process_weights_after_loading` may repack what was loaded for a kernel.

A quantized format (AWQ/GPTQ experts) is another subclass with its own parameters and kernels, returned
by its `QuantizationConfig.get_fused_moe_method(layer, prefix)`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import nn

from voltllm.layers.fused_moe.experts_torch import fused_experts
from voltllm.layers.fused_moe.router import select_experts
from voltllm.layers.parameter import set_weight_attrs
from voltllm.layers.quantization import QuantizationConfig
from voltllm.ops.moe import fused_moe, fused_moe_applies, topk_softmax


class FusedMoEMethodBase(ABC):
    """How a fused MoE layer holds and applies its experts' weights (one instance per layer)."""

    @abstractmethod
    def create_weights(
        self,
        layer: nn.Module,
        num_experts: int,
        hidden_size: int,
        intermediate_size_per_partition: int,  # this rank's features of each expert
        params_dtype: torch.dtype,
    ) -> None:
        """Register this rank's stacked expert parameters on `layer`, each marked with `output_dim`,
        `input_dim` and `moe_kinds` (and `packed_dim` / `pack_factor` for packed formats)."""

    @abstractmethod
    def apply(
        self,
        layer: nn.Module,
        x: torch.Tensor,  # [T, hidden_size]
        router_logits: torch.Tensor,  # [T, num_experts]
    ) -> torch.Tensor:
        """This rank's share of `sum_k w_k * expert_k(x)` over each token's top-k experts: `[T, hidden]`
        (summed over the ranks by the caller)."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:  # noqa: B027 - optional hook
        """Called once after every checkpoint tensor is in place."""


class UnquantizedFusedMoEMethod(FusedMoEMethodBase):
    """Dense experts in the model's dtype: `w13_weight [E, 2 * I, H]` (each expert's gate rows, then its
    up rows) and `w2_weight [E, H, I]`, computed by the expert kernels on CUDA (`voltllm.ops.moe`:
    fused routing, the pair path at decode sizes, the decode GEMV or the grouped GEMM, no host sync) and
    by the torch forms of `experts_torch` elsewhere (and for shapes the kernels do not take)."""

    def create_weights(
        self,
        layer: nn.Module,
        num_experts: int,
        hidden_size: int,
        intermediate_size_per_partition: int,
        params_dtype: torch.dtype,
    ) -> None:
        size = intermediate_size_per_partition
        w13 = nn.Parameter(torch.empty(num_experts, 2 * size, hidden_size, dtype=params_dtype))
        set_weight_attrs(w13, {"output_dim": 1, "input_dim": 2, "moe_kinds": ("w1", "w3")})
        layer.register_parameter("w13_weight", w13)
        w2 = nn.Parameter(torch.empty(num_experts, hidden_size, size, dtype=params_dtype))
        set_weight_attrs(w2, {"output_dim": 1, "input_dim": 2, "moe_kinds": ("w2",)})
        layer.register_parameter("w2_weight", w2)

    def apply(self, layer: nn.Module, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        w13, w2 = layer.w13_weight, layer.w2_weight
        if fused_moe_applies(x, w13, w2, layer.top_k):
            topk_weights, topk_ids = topk_softmax(router_logits, layer.top_k, layer.renormalize)
            return fused_moe(x, w13, w2, topk_weights, topk_ids.to(torch.int32))
        topk_weights, topk_ids = select_experts(router_logits, layer.top_k, layer.renormalize)
        return fused_experts(x, w13, w2, topk_weights, topk_ids)


def fused_moe_method_for(
    quant_config: QuantizationConfig | None, layer: nn.Module, prefix: str
) -> FusedMoEMethodBase:
    """The method `quant_config` picks for the experts `prefix`: the format's own `get_fused_moe_method`
    where it has one; else its linear method for `prefix` applied expert by expert
    (`QuantizedFusedMoEMethod`); unquantized when there is no config or it leaves the experts in full
    precision. A format whose linear method is not a `QuantizedLinearMethod` is refused: its
    checkpoint's experts would not load into dense parameters."""
    if quant_config is None:
        return UnquantizedFusedMoEMethod()
    get_method = getattr(quant_config, "get_fused_moe_method", None)
    if get_method is not None:
        method = get_method(layer, prefix)
        return method if method is not None else UnquantizedFusedMoEMethod()
    from voltllm.layers.fused_moe.quantized import QuantizedFusedMoEMethod
    from voltllm.layers.quantization.quantized_method import QuantizedLinearMethod

    linear = quant_config.get_linear_method(layer, prefix)
    if linear is None:
        return UnquantizedFusedMoEMethod()
    if not isinstance(linear, QuantizedLinearMethod):
        raise ValueError(f"quantization method {quant_config.name!r} has no mixture-of-experts support")
    return QuantizedFusedMoEMethod(lambda: quant_config.get_linear_method(layer, prefix))
