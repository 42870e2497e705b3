"""Gated activations."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` where `x = [gate | up]` along the last dimension: [..., 2d] -> [..., d]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


class SiluAndMul(nn.Module):
    """Module face of `silu_and_mul` (the SwiGLU gate of Llama-style MLPs)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(x)
