"""RMSNorm and fused residual-add + RMSNorm, with their torch references."""

from __future__ import annotations

import torch

from voltllm.ops._dispatch import kernel_ops, use_kernels


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Reference: `x / sqrt(mean(x^2) + eps) * weight`, computed in fp32, returned in x's dtype."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def rms_norm(
    x: torch.Tensor,  # [num_tokens, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """RMSNorm of each row of `x`."""
    if not use_kernels(x):
        result = rms_norm_ref(x, weight, eps)
        return result if out is None else out.copy_(result)
    if out is None:
        out = torch.empty_like(x)
    kernel_ops().rms_norm(out, x, weight, eps)
    return out


def fused_add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: returns `(rms_norm(x + residual), x + residual)`; the sum is rounded to x's dtype."""
    summed = (x.float() + residual.float()).to(x.dtype)
    return rms_norm_ref(summed, weight, eps), summed


def fused_add_rms_norm(
    x: torch.Tensor,  # [num_tokens, hidden], overwritten with the normalised sum
    residual: torch.Tensor,  # [num_tokens, hidden] contiguous, overwritten with x + residual
    weight: torch.Tensor,  # [hidden]
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """In place: `residual += x; x = rms_norm(residual)`. Returns `(x, residual)`."""
    if not use_kernels(x):
        normed, summed = fused_add_rms_norm_ref(x, residual, weight, eps)
        residual.copy_(summed)
        x.copy_(normed)
        return x, residual
    kernel_ops().fused_add_rms_norm(x, residual, weight, eps)
    return x, residual
