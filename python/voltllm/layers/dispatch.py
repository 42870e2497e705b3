"""When a layer runs a voltllm CUDA kernel instead of its plain-torch form.

The kernels (`voltllm.ops`) take fp16 and bf16 CUDA tensors. fp32 on CUDA and every CPU tensor use the
torch forms in `voltllm.layers`, which are also what the CPU tests check against transformers.
"""

from __future__ import annotations

import torch

KERNEL_DTYPES = (torch.float16, torch.bfloat16)


def use_cuda_kernels(x: torch.Tensor) -> bool:
    """True for tensors the kernels handle: on a CUDA device, in fp16 or bf16."""
    return x.is_cuda and x.dtype in KERNEL_DTYPES
