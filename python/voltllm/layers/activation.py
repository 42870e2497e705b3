"""Gated activations (CUDA kernel in fp16/bf16 on CUDA, plain torch elsewhere)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from voltllm.layers.dispatch import use_cuda_kernels


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` where `x = [gate | up]` along the last dimension: [..., 2d] -> [..., d]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def swiglu(x: torch.Tensor) -> torch.Tensor:
    """`silu_and_mul`, run by the CUDA kernel for 2-D fp16/bf16 CUDA tensors (the SwiGLU of
    Llama-style MLPs)."""
    if use_cuda_kernels(x) and x.dim() == 2:
        from voltllm import ops

        return ops.silu_and_mul(x)
    return silu_and_mul(x)


class SiluAndMul(nn.Module):
    """Module face of `swiglu`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return swiglu(x)
