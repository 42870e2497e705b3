"""The weight-method seam of the linear layers: which parameters a layer holds and how it computes.

A linear layer (`voltllm.layers.linear`) decides its shard of the matrix; its `LinearMethodBase`
decides everything about the weights themselves:
- `create_weights` registers the layer's parameters for that shard and marks them with their loading
  rules (`voltllm.layers.parameter`): which dimension is the output and which the input, what is packed.
  The layer then loads checkpoint tensors into them, fused q/k/v and gate/up shards included, without
  knowing what they hold.
- `apply` computes `x @ W^T + bias` from them; `apply_swiglu`, `apply_add_rms_norm` and
  `apply_then_add_rms_norm` are the fused forms the decoder asks for (SiLU-and-mul after a gate/up
  projection; a pre-norm block's residual add + RMSNorm run before the projection that follows the
  norm, or after the projection that ends the block before it). The first two default to composing
  `apply` with the plain layers, the last to None (not fused: the next projection gets the add), so a
  method only overrides what it can fuse.
- `process_weights_after_loading` may repack what was loaded (a kernel's preferred layout).

`UnquantizedLinearMethod` holds one dense `[out, in]` weight and keeps the decode fast paths: the GEMV
kernel for a few rows on a GPU, its SiLU-and-mul epilogue, and the residual add + RMSNorm as its
prologue. A quantized format (AWQ, GPTQ, ...) is another subclass with its own parameters (qweight,
qzeros, scales) and its own `apply`, returned by its `QuantizationConfig`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
import torch.nn.functional as F
from torch import nn

from voltllm.layers.activation import swiglu
from voltllm.layers.norm import RMSNorm
from voltllm.layers.parameter import set_weight_attrs
from voltllm.ops.linear import add_rms_norm_gemv, add_rms_norm_gemv_applies, gemv, gemv_applies


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ weight.T + bias`. Decode batches of a few rows on a GPU take the GEMV kernel, which reads
    the weight at close to memory bandwidth; everything else is a torch GEMM."""
    if gemv_applies(x, weight):
        return gemv(x, weight, bias)
    return F.linear(x, weight, bias)


class LinearMethodBase(ABC):
    """How a linear layer holds and applies its weights (one instance per layer)."""

    @abstractmethod
    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],  # this rank's rows of each fused shard (one entry if unfused)
        input_size: int,  # the whole layer's, before sharding
        output_size: int,
        params_dtype: torch.dtype,
    ) -> None:
        """Register the parameters of this rank's `[sum(output_partition_sizes), input_size_per_partition]`
        shard on `layer`, each marked with `output_dim` / `input_dim` (and `packed_dim` / `pack_factor`)."""

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """`x @ W^T + bias` for `x: [T, in_per_partition]` -> `[T, out_per_partition]`."""

    def apply_swiglu(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """`silu(gate) * up` of the projection's two halves `[gate | up]`: `[T, out / 2]`."""
        return swiglu(self.apply(layer, x, bias))

    def apply_add_rms_norm(
        self,
        layer: nn.Module,
        hidden: torch.Tensor,  # [T, in]: the sublayer output to add into the residual stream
        residual: torch.Tensor,  # [T, in]
        norm: RMSNorm,
        bias: torch.Tensor | None = None,
        swiglu: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`apply` (or `apply_swiglu`) of `norm(hidden + residual)`; returns `(out, new_residual)`.
        `hidden` and `residual` may be consumed (the norm can work in place)."""
        normed, residual = norm(hidden, residual)
        apply = self.apply_swiglu if swiglu else self.apply
        return apply(layer, normed, bias), residual

    def apply_then_add_rms_norm(
        self,
        layer: nn.Module,
        x: torch.Tensor,  # [T, in]
        residual: torch.Tensor,  # [T, out]
        norm: RMSNorm,
        bias: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`norm(apply(x) + residual)` and the new residual where the method runs the add and the norm
        in its projection's kernel (the projection that ends a pre-norm block); None where it does not,
        and the caller leaves them to the next projection (`apply_add_rms_norm`)."""
        return None

    def process_weights_after_loading(self, layer: nn.Module) -> None:  # noqa: B027 - optional hook
        """Called once after every checkpoint tensor is in place."""

    def streamed_weights(self, layer: nn.Module) -> tuple[torch.Tensor, ...]:
        """The tensors `apply` streams from memory, largest first: what a kernel running just before
        the layer may ask the GPU's L2 to hold for it (`AttentionBackend.forward_qkv`'s `next_weights`).
        None by default: a method names its own."""
        return ()


class UnquantizedLinearMethod(LinearMethodBase):
    """A dense `weight: [out, in]` in the model's dtype, as in checkpoints and `torch.nn.Linear`.

    `fold_norm=False` keeps the residual add + RMSNorm out of the GEMV (for A/B timing and tests).
    """

    def __init__(self, fold_norm: bool = True) -> None:
        self.fold_norm = fold_norm

    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
    ) -> None:
        weight = nn.Parameter(
            torch.empty(sum(output_partition_sizes), input_size_per_partition, dtype=params_dtype)
        )
        set_weight_attrs(weight, {"output_dim": 0, "input_dim": 1})
        layer.register_parameter("weight", weight)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return linear(x, layer.weight, bias)

    def streamed_weights(self, layer: nn.Module) -> tuple[torch.Tensor, ...]:
        return (layer.weight,)

    def apply_swiglu(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        weight = layer.weight
        if gemv_applies(x, weight):
            # Decode rows on a GPU: SiLU-and-mul runs in the GEMV's epilogue.
            return gemv(x, weight, bias, swiglu=True)
        return swiglu(F.linear(x, weight, bias))

    def apply_add_rms_norm(
        self,
        layer: nn.Module,
        hidden: torch.Tensor,
        residual: torch.Tensor,
        norm: RMSNorm,
        bias: torch.Tensor | None = None,
        swiglu: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # Decode rows on a GPU: the add and the norm run as the GEMV's prologue, one launch for three.
        if self.fold_norm and add_rms_norm_gemv_applies(hidden, residual, norm.weight, layer.weight):
            return add_rms_norm_gemv(hidden, residual, norm.weight, norm.eps, layer.weight, bias, swiglu)
        return super().apply_add_rms_norm(layer, hidden, residual, norm, bias, swiglu)
