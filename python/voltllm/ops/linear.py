"""Linear layers at decode batch sizes: the skinny GEMV kernel, and when it applies.

With `swiglu=True` the weight is a gated MLP's fused gate/up projection `[gate; up]` and the result is
`silu(x @ gate.T) * (x @ up.T)`: the activation runs in the GEMV's epilogue instead of a kernel of its
own.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from voltllm.ops._dispatch import kernel_ops, use_kernels
from voltllm.ops.activation import silu_and_mul_ref

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
    swiglu: bool = False,
) -> torch.Tensor:
    """`x @ weight.T + bias` for one or two rows of x (then SiLU-and-mul of its two halves when
    `swiglu`): the GEMV kernel on CUDA, the torch reference elsewhere."""
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
