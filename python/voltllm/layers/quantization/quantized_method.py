"""What every quantized format's linear method shares: checkpoint tensors in, one `QuantizedWeight` out.

A format's method registers the parameters its checkpoint spells (`create_weights`), which the
parallel layers' loaders fill shard by shard. `process_weights_after_loading` (called once per layer,
after its last tensor) converts them with `to_quantized_weight`, drops them, and keeps only what
`quantized_matmul_for` built: the CUDA kernels' repacked form, or the torch reference. So a model holds
one form of each weight at a time and converts layer by layer.

`fill_dummy` writes random but valid checkpoint-layout values (codes of any bit pattern, small positive
scales), for `load_format="dummy"`.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import Any

import torch
from torch import nn

from voltllm.layers.linear_method import LinearMethodBase
from voltllm.layers.norm import RMSNorm
from voltllm.layers.parameter import set_weight_attrs
from voltllm.layers.quantization.quantized_weight import (
    QuantizedMatmul,
    QuantizedWeight,
    quantized_matmul_for,
)
from voltllm.ops.quantized_linear import PackedQuantWeight

# Dummy weights stay within +-this (dense ones uniform, quantized ones dequantized): small, bounded
# values keep fp16 activations finite through any depth.
DUMMY_WEIGHT_RANGE = 0.02


class QuantizedLinearMethod(LinearMethodBase):
    """Base of the formats' linear methods; subclasses create their parameters and convert them.

    `fold_norm_after` (on the class) runs each pre-norm block's residual add + RMSNorm in the GEMV of the
    projection before it (`quant_gemv_add_rms_norm`) instead of as a kernel of its own. Off until it has
    run on a GPU: built and tested on the CPU emulator in session 18, when no GPU was lent
    (`tools/gpu_requests/norm_fold.sh` runs its GPU tests and times it against the norms apart).
    """

    fold_norm_after = False

    def __init__(self) -> None:
        self.checkpoint_params: list[str] = []  # names create_weights registered, dropped after loading

    def register(self, layer: nn.Module, name: str, tensor: torch.Tensor, **attrs: Any) -> nn.Parameter:
        """Register one checkpoint-layout parameter (no gradient: most are integers) with its loading
        rules (`voltllm.layers.parameter`)."""
        param = nn.Parameter(tensor, requires_grad=False)
        set_weight_attrs(param, attrs)
        layer.register_parameter(name, param)
        self.checkpoint_params.append(name)
        return param

    @staticmethod
    def check_packs(layer: nn.Module, sizes: list[int], pack: int, what: str) -> None:
        """Refuse a layer whose `sizes` (features per rank, or per q/k/v or gate/up shard) do not fill
        whole int32 words of `pack` codes: `what` names them in the message ("input features", ...)."""
        for size in sizes:
            if size % pack:
                raise ValueError(f"{layer.prefix}: {size} {what} do not pack into int32 words of {pack}")

    @abstractmethod
    def to_quantized_weight(self, layer: nn.Module) -> QuantizedWeight:
        """The loaded checkpoint tensors of `layer` as one `QuantizedWeight` (unpacked codes `[out, in]`)."""

    @abstractmethod
    def fill_dummy(self, layer: nn.Module, generator: torch.Generator) -> None:
        """Fill the checkpoint-layout parameters with random valid values whose dequantized weight
        stays within +-DUMMY_WEIGHT_RANGE."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        weight = self.to_quantized_weight(layer)
        for name in self.checkpoint_params:
            delattr(layer, name)  # the checkpoint layout is not needed any more: free it now
        layer.quantized_matmul = quantized_matmul_for(weight)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return _matmul_of(layer)(x, bias)

    def streamed_weights(self, layer: nn.Module) -> tuple[torch.Tensor, ...]:
        """The kernels' packed codes and group parameters (none on the torch fallback)."""
        packed = getattr(getattr(layer, "quantized_matmul", None), "weight", None)
        if isinstance(packed, PackedQuantWeight):
            return (packed.packed, packed.group_params)
        return ()

    def apply_swiglu(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        return _matmul_of(layer).swiglu(x, bias)  # the kernels fold SiLU-and-mul into their epilogue

    def apply_then_add_rms_norm(
        self,
        layer: nn.Module,
        x: torch.Tensor,
        residual: torch.Tensor,
        norm: RMSNorm,
        bias: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        # Decode rows on a GPU: the GEMV's last block adds and normalizes (a norm kernel saved per block).
        if not self.fold_norm_after:
            return None
        return _matmul_of(layer).add_rms_norm(x, residual, norm.weight, norm.eps, bias)


def _matmul_of(layer: nn.Module) -> QuantizedMatmul:
    matmul = getattr(layer, "quantized_matmul", None)
    if matmul is None:
        raise RuntimeError(f"{layer.prefix}: quantized weights used before process_weights_after_loading")
    return matmul


def random_int32_(param: torch.Tensor, generator: torch.Generator) -> None:
    """Every bit of every word random: all codes uniform."""
    param.random_(-(2**31), 2**31, generator=generator)


def random_scales_(param: torch.Tensor, generator: torch.Generator, largest_code_distance: int) -> None:
    """Scales in [0.5, 1] * DUMMY_WEIGHT_RANGE / largest_code_distance: a code at most that far from its
    zero point dequantizes within the dummy range."""
    limit = DUMMY_WEIGHT_RANGE / largest_code_distance
    param.uniform_(0.5 * limit, limit, generator=generator)
