"""The attention layer the models hold: hands the qkv projection and its prologue to the step's backend."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from voltllm.layers.attention.backend import (
    AttentionBackend,
    AttentionMetadata,
    AttentionPrologue,
    AttentionSpec,
)
from voltllm.layers.norm import RMSNorm
from voltllm.layers.rotary import RotaryEmbedding


class Attention(nn.Module):
    """Multi-head (GQA) attention over the paged KV cache, delegated to an `AttentionBackend`.

    It takes the fused `[q | k | v]` projection; the backend applies the q/k norms and RoPE, writes the
    KV cache and attends. `rotary_emb`, `q_norm` and `k_norm` stay registered where the model put them
    (the prologue holds them without registering them again, so parameter names are the model's).
    """

    def __init__(
        self,
        spec: AttentionSpec,
        backend: AttentionBackend,
        rotary_emb: RotaryEmbedding | None = None,
        q_norm: RMSNorm | None = None,
        k_norm: RMSNorm | None = None,
    ) -> None:
        super().__init__()
        if spec.num_heads % spec.num_kv_heads:
            raise ValueError(
                f"num_heads ({spec.num_heads}) must be a multiple of num_kv_heads ({spec.num_kv_heads})"
            )
        self.spec = spec
        self.backend = backend
        self.prologue = AttentionPrologue(rotary_emb, q_norm, k_norm)

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens] int64
        qkv: torch.Tensor,  # [num_tokens, (num_heads + 2 * num_kv_heads) * head_size], updated in place
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]
        metadata: AttentionMetadata,
        next_weights: Sequence[torch.Tensor] = (),  # read after attention (AttentionBackend.forward_qkv)
    ) -> torch.Tensor:  # [num_tokens, num_heads * head_size]
        backend = self.backend
        out = backend.forward_qkv(self.spec, self.prologue, positions, qkv, kv_cache, metadata, next_weights)
        return out.reshape(out.shape[0], -1)

    def extra_repr(self) -> str:
        s = self.spec
        return (
            f"heads={s.num_heads}, kv_heads={s.num_kv_heads}, head_size={s.head_size}, "
            f"window={s.sliding_window}, backend={self.backend.name}"
        )
