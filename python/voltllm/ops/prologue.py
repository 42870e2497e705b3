"""The fused attention prologue: per-head q/k RMSNorm, NeoX rotary embedding and the KV-cache write in
one kernel (`csrc/ops/qk_norm_rope.cuh`), with the unfused torch sequence it replaces as its reference;
and decode attention with the prologue folded into the attention kernel itself."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from voltllm.ops._dispatch import kernel_ops, use_kernels
from voltllm.ops.attention import (
    DECODE_MIN_SPLIT,
    check_decode_merge,
    decode_merge_args,
    kernel_window,
    kv_cache_write_ref,
    paged_decode_attention,
)
from voltllm.ops.norm import rms_norm_ref


def _neox_rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x: [T, heads, head]` by per-token `cos, sin: [T, 1, head / 2]` (fp32 math, x's dtype)."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def qk_norm_rope_kv_write_ref(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
    num_heads: int,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Reference, in place: the unfused sequence (q/k norm, rotary, cache write) the kernel replaces."""
    num_kv_heads, head = kv_cache.shape[3], kv_cache.shape[4]
    q_size, kv_size = num_heads * head, num_kv_heads * head
    q = qkv[:, :q_size].unflatten(1, (num_heads, head))
    k = qkv[:, q_size : q_size + kv_size].unflatten(1, (num_kv_heads, head))
    v = qkv[:, q_size + kv_size : q_size + 2 * kv_size].unflatten(1, (num_kv_heads, head))
    if q_weight is not None and k_weight is not None:
        q.copy_(rms_norm_ref(q.reshape(-1, head), q_weight, eps).view_as(q))
        k.copy_(rms_norm_ref(k.reshape(-1, head), k_weight, eps).view_as(k))
    valid = (positions >= 0) & (positions < cos_sin.shape[0])  # others stay unrotated, as on the GPU
    table = cos_sin[positions[valid]]
    cos, sin = table[:, None, : head // 2], table[:, None, head // 2 :]
    q[valid] = _neox_rotate(q[valid], cos, sin)
    k[valid] = _neox_rotate(k[valid], cos, sin)
    kv_cache_write_ref(k, v, kv_cache, slot_mapping)


def qk_norm_rope_kv_write(
    qkv: torch.Tensor,  # [num_tokens, (num_heads + 2 * num_kv_heads) * head_size]; q, k updated in place
    positions: torch.Tensor,  # [num_tokens] int64
    cos_sin: torch.Tensor,  # [max_position, head_size] fp32 (`cos_sin_cache`)
    q_weight: torch.Tensor | None,  # [head_size] q norm weight (Qwen3), or None for no q/k norm
    k_weight: torch.Tensor | None,
    eps: float,
    num_heads: int,
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = not written
) -> None:
    """Normalise (optionally) and rotate the q and k heads of a fused qkv projection in place and
    store k and v in their cache slots: what a decoder layer does before attention, in one launch."""
    if not use_kernels(qkv):
        qk_norm_rope_kv_write_ref(
            qkv, positions, cos_sin, q_weight, k_weight, eps, num_heads, kv_cache, slot_mapping
        )
        return
    kernel_ops().qk_norm_rope_kv_write(
        qkv, positions, cos_sin, q_weight, k_weight, eps, num_heads, kv_cache, slot_mapping
    )


def paged_decode_attention_prologue(
    qkv: torch.Tensor,  # [num_seqs, (num_heads + 2 * num_kv_heads) * head_size]: the qkv projection
    positions: torch.Tensor,  # [num_seqs] int64
    cos_sin: torch.Tensor,  # [max_position, head_size] fp32 (`cos_sin_cache`)
    q_weight: torch.Tensor | None,  # [head_size] q norm weight (Qwen3), or None for no q/k norm
    k_weight: torch.Tensor | None,
    eps: float,
    num_heads: int,
    kv_cache: torch.Tensor,  # [2, num_blocks, 16, num_kv_heads, head_size]
    slot_mapping: torch.Tensor,  # [num_seqs] int64 cache slot of each newest token, -1 = not written
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32, context length including the newest token
    seq_lens_cpu: Sequence[int],
    scale: float,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
    merge: str = "auto",
    min_split: int = DECODE_MIN_SPLIT,
    l2_prefetch: Sequence[torch.Tensor] = (),
) -> torch.Tensor:  # [num_seqs, num_heads, head_size]
    """`qk_norm_rope_kv_write` then `paged_decode_attention` of the normalised, rotated query, in one
    kernel on CUDA: each block normalises and rotates its query heads as it stages them, and the block
    whose context split holds the newest position writes that token's key and value into the cache
    before reading it. Unlike `qk_norm_rope_kv_write`, `qkv` is left as it was (nothing reads the
    rotated q and k but attention). `l2_prefetch` as in `paged_decode_attention`. Off CUDA, the two
    reference ops on a copy of `qkv`."""
    window = kernel_window(sliding_window)
    if not use_kernels(qkv):
        check_decode_merge(merge)
        head = kv_cache.shape[-1]
        rotated = qkv.clone()
        qk_norm_rope_kv_write_ref(
            rotated, positions, cos_sin, q_weight, k_weight, eps, num_heads, kv_cache, slot_mapping
        )
        query = rotated[:, : num_heads * head].view(-1, num_heads, head)
        return paged_decode_attention(
            query,
            kv_cache,
            block_tables,
            seq_lens,
            seq_lens_cpu,
            scale,
            sliding_window,
            out,
            merge,
            min_split,
        )
    if out is None:
        out = torch.empty(qkv.shape[0], num_heads, kv_cache.shape[-1], dtype=qkv.dtype, device=qkv.device)
    tickets, ticket_max_splits = decode_merge_args(merge, qkv.device, qkv.shape[0], kv_cache.shape[3])
    kernel_ops().paged_decode_attention_prologue(
        out,
        qkv,
        positions,
        cos_sin,
        q_weight,
        k_weight,
        eps,
        kv_cache,
        slot_mapping,
        block_tables,
        seq_lens,
        max(seq_lens_cpu, default=1),
        scale,
        window,
        min_split,
        tickets,
        ticket_max_splits,
        list(l2_prefetch),
    )
    return out
