"""The attention layer the models hold: reshapes projections and calls the step's backend."""

from __future__ import annotations

import torch
from torch import nn

from voltllm.layers.attention.backend import AttentionBackend, AttentionMetadata, AttentionSpec


class Attention(nn.Module):
    """Multi-head (GQA) attention over the paged KV cache, delegated to an `AttentionBackend`."""

    def __init__(self, spec: AttentionSpec, backend: AttentionBackend) -> None:
        super().__init__()
        if spec.num_heads % spec.num_kv_heads:
            raise ValueError(
                f"num_heads ({spec.num_heads}) must be a multiple of num_kv_heads ({spec.num_kv_heads})"
            )
        self.spec = spec
        self.backend = backend

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_size]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]
        metadata: AttentionMetadata,
        kv_written: bool = False,
    ) -> torch.Tensor:  # [num_tokens, num_heads * head_size]
        out = self.backend.forward(self.spec, query, key, value, kv_cache, metadata, kv_written)
        return out.reshape(out.shape[0], -1)

    def extra_repr(self) -> str:
        s = self.spec
        return (
            f"heads={s.num_heads}, kv_heads={s.num_kv_heads}, head_size={s.head_size}, "
            f"window={s.sliding_window}, backend={self.backend.name}"
        )
