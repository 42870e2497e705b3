"""Linear layers at decode batch sizes: the skinny GEMV kernel, and when it applies."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from voltllm.ops._dispatch import kernel_ops, use_kernels

# Most input rows the GEMV kernel takes; beyond this a tiled GEMM reuses each weight load enough to
# win (benches/gemv.py measures the crossover; on the H200 cuBLAS wins on Llama-3-8B shapes from 4 rows).
GEMV_MAX_ROWS = 2


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
) -> torch.Tensor:
    """`x @ weight.T + bias` for one or two rows of x: the GEMV kernel on CUDA, `F.linear` elsewhere."""
    if not use_kernels(x):
        result = F.linear(x, weight, bias)
        return result if out is None else out.copy_(result)
    if out is None:
        out = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
    kernel_ops().gemv(out, x, weight, bias)
    return out
