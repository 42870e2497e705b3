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


class SiluAndMul(nn.Module):
    """Module face of `silu_and_mul` (the SwiGLU gate of Llama-style MLPs)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if use_cuda_kernels(x) and x.dim() == 2:
            from voltllm import ops

            return ops.silu_and_mul(x)
        return silu_and_mul(x)
