"""RMSNorm, plain and fused with the residual add.

On CUDA in fp16/bf16 the module runs voltllm's kernels (`voltllm.ops`); everywhere else the plain-torch
functions below, whose math follows Hugging Face: normalise in fp32, cast back to the input dtype, then
scale by the weight.
"""

from __future__ import annotations

import torch
from torch import nn

from voltllm.layers.dispatch import use_cuda_kernels


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`x * rsqrt(mean(x^2) + eps) * weight` over the last dimension, computed in fp32."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Add `x` into the residual stream, then normalise it. Returns (normed, new_residual)."""
    residual = x + residual
    return rms_norm(residual, weight, eps), residual


class RMSNorm(nn.Module):
    """RMSNorm over the last dimension; pass `residual` to get the fused add-then-norm form.

    The fused form may reuse `x` and `residual` as its outputs (the CUDA kernel works in place), so
    callers must not read them afterwards except through the returned tensors.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if not use_cuda_kernels(x):
            if residual is None:
                return rms_norm(x, self.weight, self.eps)
            return fused_add_rms_norm(x, residual, self.weight, self.eps)
        from voltllm import ops

        if residual is None:
            # The kernel takes [rows, hidden]; per-head norms (q/k) arrive as [T, heads, head_size].
            return ops.rms_norm(x.reshape(-1, x.shape[-1]), self.weight, self.eps).view(x.shape)
        return ops.fused_add_rms_norm(x.contiguous(), residual.contiguous(), self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
