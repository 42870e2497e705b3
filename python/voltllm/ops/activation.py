"""SiLU-and-mul (the gated MLP activation), with its torch reference."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from voltllm.ops._dispatch import kernel_ops, use_kernels


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """Reference: `silu(x[..., :d]) * x[..., d:]` in fp32, returned in x's dtype."""
    gate, up = x.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(x.dtype)


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:  # x: [num_tokens, 2 * d]
    """`silu(gate) * up` for `x = [gate | up]`; returns `[num_tokens, d]`."""
    if x.shape[-1] % 2:
        raise ValueError(f"silu_and_mul needs an even last dimension, got {x.shape[-1]}")
    if not use_kernels(x):
        result = silu_and_mul_ref(x)
        return result if out is None else out.copy_(result)
    if out is None:
        out = torch.empty(x.shape[0], x.shape[1] // 2, dtype=x.dtype, device=x.device)
    kernel_ops().silu_and_mul(out, x)
    return out
