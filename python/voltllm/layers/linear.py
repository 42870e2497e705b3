"""Linear layers that know how to take their weights from checkpoint tensors.

Checkpoints store q/k/v and gate/up as separate matrices; the model runs them fused (one GEMM instead of
three or two). `MergedLinear` keeps the fused parameter and copies each checkpoint shard into its rows,
so the loader never needs to know which layers are fused. Weights are `[out_features, in_features]`,
as in `torch.nn.Linear` and Hugging Face checkpoints.

`add_rms_norm_linear` is the projection right after a pre-norm block's residual add + RMSNorm, run as
one GEMV kernel at decode batch sizes on a GPU.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from voltllm.layers.norm import RMSNorm
from voltllm.ops.linear import add_rms_norm_gemv, add_rms_norm_gemv_applies, gemv, gemv_applies


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ weight.T + bias`. Decode batches of a few rows on a GPU take the GEMV kernel, which reads
    the weight at close to memory bandwidth; everything else is a torch GEMM."""
    if gemv_applies(x, weight):
        return gemv(x, weight, bias)
    return F.linear(x, weight, bias)


def add_rms_norm_linear_applies(
    hidden: torch.Tensor, residual: torch.Tensor, norm: RMSNorm, proj: Linear
) -> bool:
    """True where `add_rms_norm_linear` runs as one kernel: decode rows (at most GEMV_MAX_ROWS) of
    CUDA fp16/bf16 tensors that the GEMV takes, with a hidden size it can stage."""
    return add_rms_norm_gemv_applies(hidden, residual, norm.weight, proj.weight)


def add_rms_norm_linear(
    hidden: torch.Tensor, residual: torch.Tensor, norm: RMSNorm, proj: Linear, swiglu: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """`proj(norm(hidden, residual))` with the add, the norm and the projection in one GEMV kernel (then
    SiLU-and-mul of the projection's halves when `swiglu`). Returns `(out, new_residual)`.

    The same numbers as the unfused modules on CUDA; `hidden` and `residual` are left unchanged and
    the new residual is a fresh tensor. Callers check `add_rms_norm_linear_applies` first.
    """
    return add_rms_norm_gemv(hidden, residual, norm.weight, norm.eps, proj.weight, proj.bias, swiglu)


def _copy_checked(dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"{what}: checkpoint shape {tuple(src.shape)} != expected {tuple(dst.shape)}")
    with torch.no_grad():
        dst.copy_(src)


class Linear(nn.Module):
    """A plain dense layer: `y = x W^T (+ b)`."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)

    def load_weight(self, param_name: str, tensor: torch.Tensor) -> None:
        """Copy a checkpoint tensor into `weight` or `bias` (`param_name`), checking its shape."""
        _copy_checked(getattr(self, param_name), tensor, f"{param_name}")

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}"


class MergedLinear(Linear):
    """Several linear layers over the same input, stored as one matrix stacked along the output dim.

    `output_sizes[i]` rows belong to shard i; `forward` returns the concatenated outputs, which callers
    split with `split_sizes`.
    """

    def __init__(self, in_features: int, output_sizes: Sequence[int], bias: bool = False) -> None:
        super().__init__(in_features, sum(output_sizes), bias)
        self.output_sizes = tuple(output_sizes)
        offsets = [0]
        for size in self.output_sizes:
            offsets.append(offsets[-1] + size)
        self._offsets = tuple(offsets)

    @property
    def split_sizes(self) -> tuple[int, ...]:
        return self.output_sizes

    def load_shard(self, param_name: str, shard_id: int, tensor: torch.Tensor) -> None:
        """Copy checkpoint shard `shard_id` (e.g. k_proj = 1 of q/k/v) into its rows of `param_name`."""
        if not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(f"shard {shard_id} out of range for {len(self.output_sizes)} shards")
        rows = getattr(self, param_name).narrow(0, self._offsets[shard_id], self.output_sizes[shard_id])
        _copy_checked(rows, tensor, f"{param_name}[shard {shard_id}]")
