"""Linear layers at decode batch sizes: the skinny GEMV kernel, and when it applies.

With `swiglu=True` the weight is a gated MLP's fused gate/up projection `[gate; up]` and the result is
`silu(x @ gate.T) * (x @ up.T)`: the activation runs in the GEMV's epilogue instead of a kernel of its
own. `add_rms_norm_gemv` also runs a pre-norm block's residual add and RMSNorm as the GEMV's prologue,
so that at batch 1 the norm costs no launch of its own.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from voltllm.ops._dispatch import kernel_ops, use_kernels
from voltllm.ops.activation import silu_and_mul_ref
from voltllm.ops.norm import fused_add_rms_norm_ref

# Most input rows the GEMV kernel takes; beyond this a tiled GEMM reuses each weight load enough to
# win (benches/gemv.py measures the crossover; on the H200 cuBLAS wins on Llama-3-8B shapes from 4 rows).
GEMV_MAX_ROWS = 2
# Widest hidden size the add + RMSNorm GEMV stages in shared memory (32 KB for two rows).
NORM_GEMV_MAX_HIDDEN = 8192


def gemv_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """True for a CUDA fp16/bf16 `x: [rows <= GEMV_MAX_ROWS, k]` with k a multiple of 8 and a
    contiguous `weight: [n, k]` of the same dtype (the layout the kernel streams)."""
    k = weight.shape[-1]
    return (
        x.is_cuda
        and x.dim() == 2
        and 1 <= x.shape[0] <= GEMV_MAX_ROWS
        and x.dtype in (torch.float16, torch.bfloat16)
        and weight.dtype == x.dtype
        and x.shape[1] == k
        and k % 8 == 0
        and x.stride(1) == 1
        and x.stride(0) % 8 == 0
        and x.data_ptr() % 16 == 0
        and weight.is_contiguous()
        and weight.data_ptr() % 16 == 0
    )


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    swiglu: bool = False,
) -> torch.Tensor:
    """`x @ weight.T + bias` for one or two rows of x (then SiLU-and-mul of its two halves when
    `swiglu`): the GEMV kernel on CUDA, the torch reference elsewhere. `out` (default: a new tensor of
    x's dtype) may be float32 for a plain GEMV: it then holds the x-dtype result widened, what a cast
    of the x-dtype result would give, without the cast's kernel."""
    if not use_kernels(x):
        result = F.linear(x, weight, bias)
        if swiglu:
            result = silu_and_mul_ref(result)
        return result if out is None else out.copy_(result)
    if out is None:
        width = weight.shape[0] // 2 if swiglu else weight.shape[0]
        out = torch.empty(x.shape[0], width, dtype=x.dtype, device=x.device)
    kernel_ops().gemv(out, x, weight, bias, swiglu)
    return out


def _rows_ok(t: torch.Tensor, like: torch.Tensor) -> bool:
    """`t` has `like`'s shape and dtype and contiguous, 16-byte aligned rows."""
    return (
        t.is_cuda
        and t.shape == like.shape
        and t.dtype == like.dtype
        and t.stride(1) == 1
        and t.stride(0) % 8 == 0
        and t.data_ptr() % 16 == 0
    )


def norm_weight_ok(norm_weight: torch.Tensor, size: int, dtype: torch.dtype) -> bool:
    """`norm_weight` is a contiguous, 16-byte aligned `[size]` vector of `dtype`, as the fused norm
    epilogues read it (8 halves at a time)."""
    return (
        norm_weight.dtype == dtype
        and norm_weight.shape == (size,)
        and norm_weight.is_contiguous()
        and norm_weight.data_ptr() % 16 == 0
    )


def add_rms_norm_gemv_applies(
    hidden: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, weight: torch.Tensor
) -> bool:
    """True where `add_rms_norm_gemv` runs its kernel: `gemv_applies(hidden, weight)`, a hidden size
    up to NORM_GEMV_MAX_HIDDEN, `residual` shaped and laid out like `hidden`, and a contiguous
    `norm_weight` of the same dtype."""
    return (
        gemv_applies(hidden, weight)
        and hidden.shape[1] <= NORM_GEMV_MAX_HIDDEN
        and _rows_ok(residual, hidden)
        and norm_weight_ok(norm_weight, hidden.shape[1], hidden.dtype)
    )


def add_rms_norm_gemv_ref(
    hidden: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    swiglu: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: the unfused sequence, `fused_add_rms_norm_ref` then `gemv`'s torch form."""
    normed, summed = fused_add_rms_norm_ref(hidden, residual, norm_weight, eps)
    result = F.linear(normed, weight, bias)
    return (silu_and_mul_ref(result) if swiglu else result), summed


def add_rms_norm_gemv(
    hidden: torch.Tensor,  # [rows, k]: the sublayer output to add into the residual stream
    residual: torch.Tensor,  # [rows, k]
    norm_weight: torch.Tensor,  # [k]
    eps: float,
    weight: torch.Tensor,  # [n, k] ([2n, k] with swiglu)
    bias: torch.Tensor | None = None,
    swiglu: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`residual + hidden`, RMSNorm of it, then `gemv` of the result, in one kernel on CUDA (check
    `add_rms_norm_gemv_applies` first). Returns `(out, new_residual)`.

    The kernel's result equals `fused_add_rms_norm` followed by `gemv` (bit for bit, barring float
    contraction differences), but the new residual is a fresh tensor and `hidden` and `residual` are
    left as they were: every thread block re-reads them while one block writes the sum.
    """
    if not use_kernels(hidden):
        return add_rms_norm_gemv_ref(hidden, residual, norm_weight, eps, weight, bias, swiglu)
    width = weight.shape[0] // 2 if swiglu else weight.shape[0]
    out = torch.empty(hidden.shape[0], width, dtype=hidden.dtype, device=hidden.device)
    residual_out = torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device)
    kernel_ops().add_rms_norm_gemv(
        out, residual_out, hidden, residual, norm_weight, eps, weight, bias, swiglu
    )
    return out, residual_out
