"""The reference attention backend: plain torch, one sequence at a time, fp32 softmax.

It is deliberately simple: it is the oracle the CUDA kernels are tested against, and the backend used on
CPU. Works on any device and dtype.
"""

from __future__ import annotations

import torch

from voltllm.layers.attention.backend import AttentionBackend, AttentionMetadata, AttentionSpec


def write_kv_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = skip
) -> None:
    """Store each token's key/value at its flat cache slot; tokens with slot -1 are not written."""
    num_kv_heads, head_size = kv_cache.shape[-2:]
    key_slots = kv_cache[0].view(-1, num_kv_heads, head_size)
    value_slots = kv_cache[1].view(-1, num_kv_heads, head_size)
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    key_slots[slots] = key[valid].to(kv_cache.dtype)
    value_slots[slots] = value[valid].to(kv_cache.dtype)


def gather_context(
    kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """A sequence's keys and values `[seq_len, num_kv_heads, head_size]`, read through its block table."""
    block_size, num_kv_heads, head_size = kv_cache.shape[2:]
    num_blocks = -(-seq_len // block_size)
    blocks = block_table[:num_blocks].long()
    keys = kv_cache[0, blocks].reshape(-1, num_kv_heads, head_size)[:seq_len]
    values = kv_cache[1, blocks].reshape(-1, num_kv_heads, head_size)[:seq_len]
    return keys, values


def attend(
    spec: AttentionSpec,
    query: torch.Tensor,  # [query_len, num_heads, head_size]; the last query_len positions of the context
    keys: torch.Tensor,  # [seq_len, num_kv_heads, head_size]
    values: torch.Tensor,  # [seq_len, num_kv_heads, head_size]
) -> torch.Tensor:  # [query_len, num_heads, head_size]
    """Causal (optionally sliding-window) attention of one sequence's queries over its context."""
    query_len, seq_len = query.shape[0], keys.shape[0]
    q_per_kv = spec.num_queries_per_kv
    # Group query heads by the KV head they share: [num_kv_heads, q_per_kv, query_len, head_size].
    q = query.float().view(query_len, spec.num_kv_heads, q_per_kv, spec.head_size).permute(1, 2, 0, 3)
    k = keys.float().permute(1, 0, 2)[:, None]  # [num_kv_heads, 1, seq_len, head_size]
    v = values.float().permute(1, 0, 2)[:, None]
    scores = torch.matmul(q, k.transpose(-1, -2)) * spec.scale  # [kv, q_per_kv, query_len, seq_len]

    q_pos = torch.arange(seq_len - query_len, seq_len, device=query.device)[:, None]
    k_pos = torch.arange(seq_len, device=query.device)[None, :]
    allowed = k_pos <= q_pos
    if spec.sliding_window is not None:
        allowed &= k_pos > q_pos - spec.sliding_window
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs, v)  # [kv, q_per_kv, query_len, head_size]
    return out.permute(2, 0, 1, 3).reshape(query_len, spec.num_heads, spec.head_size).to(query.dtype)


def _check_metadata(metadata: AttentionMetadata, num_tokens: int) -> None:
    if sum(metadata.query_lens_cpu) != num_tokens:
        raise ValueError(
            f"metadata covers {sum(metadata.query_lens_cpu)} query tokens but the batch has {num_tokens}"
        )
    for query_len, seq_len in zip(metadata.query_lens_cpu, metadata.seq_lens_cpu, strict=True):
        if not 0 <= query_len <= seq_len:
            raise ValueError(f"query_len {query_len} must be in [0, seq_len={seq_len}]")


class TorchAttentionBackend(AttentionBackend):
    """Reference implementation of `AttentionBackend` in plain torch."""

    name = "torch"

    def forward(
        self,
        spec: AttentionSpec,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        _check_metadata(metadata, query.shape[0])
        write_kv_cache(key, value, kv_cache, metadata.slot_mapping)
        output = torch.empty_like(query)
        start = 0
        for i, (query_len, seq_len) in enumerate(
            zip(metadata.query_lens_cpu, metadata.seq_lens_cpu, strict=True)
        ):
            if query_len == 0:
                continue
            keys, values = gather_context(kv_cache, metadata.block_tables[i], seq_len)
            output[start : start + query_len] = attend(spec, query[start : start + query_len], keys, values)
            start += query_len
        return output
