"""Paged attention ops: KV-cache write, decode attention, prefill / chunked-prefill attention.

Each op runs the CUDA kernel for CUDA tensors and its plain-torch reference (`*_ref`, the test oracle)
elsewhere. KV cache layout (see `voltllm.layers.attention.backend`):
`kv_cache: [2, num_blocks, block_size=16, num_kv_heads, head_size]`.

Kernel variants (docs/kernels.md): the decode and prefill ops take `variant=`; without it the
environment variables `VOLTLLM_DECODE_KERNEL` (v6 | v8 | v8-reduce) and `VOLTLLM_PREFILL_KERNEL`
(v8 | v9) choose; the defaults are v6 decode and v8 prefill (the faster of each on the H200,
benches/RESULTS.md). The v8 kernels need SM80 or newer; on older GPUs (Volta) the v8 decode variants
run v6 and v8 prefill runs v9, the Volta-legal WMMA prefill kernel, which runs on every GPU. (The v6
prefill kernel is retired: 0.81-0.86x SDPA-efficient on the H200 against v9's 1.12-1.18x.)
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence

import torch

from voltllm.ops._dispatch import kernel_ops, use_kernels

BLOCK_SIZE = 16  # tokens per KV block the kernels are written for
# Query rows per prefill thread block, by variant and head size (PrefillV8Traits / PrefillV9Traits
# kBlockM; the ops prefill_block_m_v8 / _v9 report the same). The row-tile count of a launch uses it.
PREFILL_BLOCK_M = {
    "v8": {64: 128, 128: 128, 256: 64},
    "v9": {64: 128, 128: 128, 256: 64},
}

DECODE_ENV = "VOLTLLM_DECODE_KERNEL"
PREFILL_ENV = "VOLTLLM_PREFILL_KERNEL"
# v8: mma.sync decode with the split merge in the kernel; v8-reduce: the same kernel, splits merged
# by v6's reduce kernel (isolates what the in-kernel merge is worth).
DECODE_VARIANTS = ("v6", "v8", "v8-reduce")
# v8: mma.sync prefill (SM80+); v9: the Volta-legal WMMA prefill kernel (BLOCK_M 128, softmax on
# registers), which runs on every GPU.
PREFILL_VARIANTS = ("v8", "v9")
DEFAULT_DECODE_VARIANT = "v6"
DEFAULT_PREFILL_VARIANT = "v8"  # 1.3x v9 on the H200; on Volta v8 runs v9


def _choose(variant: str | None, env: str, known: tuple[str, ...], default: str) -> str:
    name = variant if variant is not None else os.environ.get(env) or default
    if name not in known:
        source = "argument" if variant is not None else env
        raise ValueError(f"unknown kernel variant {name!r} (from {source}); known: {known}")
    return name


def decode_variant(variant: str | None = None) -> str:
    """The decode kernel variant a call runs: `variant`, else $VOLTLLM_DECODE_KERNEL, else the default."""
    return _choose(variant, DECODE_ENV, DECODE_VARIANTS, DEFAULT_DECODE_VARIANT)


def prefill_variant(variant: str | None = None) -> str:
    """The prefill kernel variant a call runs: `variant`, else $VOLTLLM_PREFILL_KERNEL, else the default."""
    return _choose(variant, PREFILL_ENV, PREFILL_VARIANTS, DEFAULT_PREFILL_VARIANT)


@functools.cache
def _has_sm80(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 8


def runs_v8(device: torch.device) -> bool:
    """Whether the v8 kernels run on `device` (SM80 and newer); elsewhere v8 decode runs v6, v8 prefill v9."""
    return device.type == "cuda" and _has_sm80(device.index if device.index is not None else 0)


# Per device: zeroed int32 tickets for the v8 decode split merge. The kernel resets every ticket it
# uses, so a buffer stays zero between calls and CUDA graph replays need no memset of it.
_tickets: dict[torch.device, torch.Tensor] = {}
# Every ticket buffer ever handed out: a captured CUDA graph keeps pointing at the one it saw.
_tickets_kept: list[torch.Tensor] = []


def _ticket_buffer(device: torch.device, needed: int) -> torch.Tensor:
    buf = _tickets.get(device)
    if buf is not None and buf.numel() >= needed:
        return buf
    fresh = torch.zeros(max(needed, 4096), dtype=torch.int32, device=device)
    _tickets_kept.append(fresh)
    # Zeros made during a capture exist only when the graph replays the memset: not for eager calls.
    if not torch.cuda.is_current_stream_capturing():
        _tickets[device] = fresh
    return fresh


def kv_cache_write_ref(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = skip
) -> None:
    """Reference: store each token's key/value at its flat slot; slot -1 is skipped."""
    num_kv_heads, head_size = kv_cache.shape[-2:]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    kv_cache[0].view(-1, num_kv_heads, head_size)[slots] = key[valid].to(kv_cache.dtype)
    kv_cache[1].view(-1, num_kv_heads, head_size)[slots] = value[valid].to(kv_cache.dtype)


def kv_cache_write(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store the step's keys/values into their cache slots (slot -1 = padding, not written).

    The kernel skips slots past the end of the cache instead of writing out of bounds.
    """
    if not use_kernels(kv_cache):
        kv_cache_write_ref(key, value, kv_cache, slot_mapping)
        return
    kernel_ops().kv_cache_write(key, value, kv_cache, slot_mapping)


def gather_context(
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]
    block_table: torch.Tensor,  # [max_blocks_per_seq] int32
    seq_len: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A sequence's keys and values `[seq_len, num_kv_heads, head_size]`, read through its block table."""
    block_size, num_kv_heads, head_size = kv_cache.shape[2:]
    blocks = block_table[: -(-seq_len // block_size)].long()
    keys = kv_cache[0, blocks].reshape(-1, num_kv_heads, head_size)[:seq_len]
    values = kv_cache[1, blocks].reshape(-1, num_kv_heads, head_size)[:seq_len]
    return keys, values


def attend(
    query: torch.Tensor,  # [query_len, num_heads, head_size]; the last query_len positions of the context
    keys: torch.Tensor,  # [seq_len, num_kv_heads, head_size]
    values: torch.Tensor,  # [seq_len, num_kv_heads, head_size]
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:  # [query_len, num_heads, head_size], in query's dtype
    """The definition of paged attention for one sequence: causal (optionally sliding-window)
    attention of its queries over its context, fp32 softmax, query heads grouped over shared KV heads."""
    query_len, num_heads, head_size = query.shape
    seq_len, num_kv_heads = keys.shape[:2]
    group = num_heads // num_kv_heads
    q = query.float().view(query_len, num_kv_heads, group, head_size)
    scores = torch.einsum("qkgd,skd->kgqs", q, keys.float()) * scale
    q_pos = torch.arange(seq_len - query_len, seq_len, device=query.device)[:, None]
    k_pos = torch.arange(seq_len, device=query.device)[None, :]
    allowed = k_pos <= q_pos
    if sliding_window is not None:
        allowed &= k_pos > q_pos - sliding_window
    probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    out = torch.einsum("kgqs,skd->qkgd", probs, values.float())
    return out.reshape(query_len, num_heads, head_size).to(query.dtype)


def paged_attention_ref(
    query: torch.Tensor,  # [num_tokens, num_heads, head_size]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    query_lens: Sequence[int],
    seq_lens: Sequence[int],
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_size], fp32
    """Reference attention in fp32 over a flattened batch: `attend` for each sequence in turn."""
    out = torch.empty(query.shape, dtype=torch.float32, device=query.device)
    start = 0
    for i, (q_len, s_len) in enumerate(zip(query_lens, seq_lens, strict=True)):
        keys, values = gather_context(kv_cache, block_tables[i], s_len)
        out[start : start + q_len] = attend(
            query[start : start + q_len].float(), keys, values, scale, sliding_window
        )
        start += q_len
    return out


def _reference(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_lens: Sequence[int],
    seq_lens: Sequence[int],
    scale: float,
    sliding_window: int | None,
    out: torch.Tensor | None,
) -> torch.Tensor:
    """`paged_attention_ref` in the query's dtype, into `out` when given: the ops' path off CUDA."""
    result = paged_attention_ref(query, kv_cache, block_tables, query_lens, seq_lens, scale, sliding_window)
    return result.to(query.dtype) if out is None else out.copy_(result)


def _window(sliding_window: int | None) -> int:
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
    return sliding_window or 0


def paged_decode_attention(
    query: torch.Tensor,  # [num_seqs, num_heads, head_size]: one query token per sequence
    kv_cache: torch.Tensor,  # [2, num_blocks, 16, num_kv_heads, head_size]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32, context length including the query token
    seq_lens_cpu: Sequence[int],
    scale: float,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
    variant: str | None = None,
) -> torch.Tensor:  # [num_seqs, num_heads, head_size]
    """Attention of each sequence's newest token over its whole paged context (split-K on long ones).

    `variant` picks the kernel (`DECODE_VARIANTS`; see the module docstring). Every variant is CUDA-graph
    safe: per-sequence lengths come from `seq_lens` on the device, `seq_lens_cpu` only bounds them.
    On SM90+ the kernel starts reading old K/V while the kernel queued just before it finishes, so that
    kernel may write each sequence's newest token (position seq_len - 1) but no older one (docs/kernels.md).
    """
    window = _window(sliding_window)
    name = decode_variant(variant)
    if not use_kernels(query):
        query_lens = [1] * len(seq_lens_cpu)
        return _reference(query, kv_cache, block_tables, query_lens, seq_lens_cpu, scale, sliding_window, out)
    if out is None:
        out = torch.empty_like(query)
    max_seq_len = max(seq_lens_cpu, default=1)
    if name == "v6" or not runs_v8(query.device):
        kernel_ops().paged_decode_attention(
            out, query, kv_cache, block_tables, seq_lens, max_seq_len, scale, window
        )
        return out
    tickets = _ticket_buffer(query.device, query.shape[0] * kv_cache.shape[3])
    kernel_ops().paged_decode_attention_v8(
        out, query, kv_cache, block_tables, seq_lens, max_seq_len, scale, window, tickets, name == "v8"
    )
    return out


def prefill_row_tiles(query_lens: Sequence[int], block_m: int) -> int:
    """Thread blocks (per head) a prefill kernel of `block_m` rows per block needs for these query lengths."""
    return sum(-(-q // block_m) for q in query_lens)


def paged_prefill_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_size]
    kv_cache: torch.Tensor,  # [2, num_blocks, 16, num_kv_heads, head_size]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32, context length after this step
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    query_lens_cpu: Sequence[int],
    seq_lens_cpu: Sequence[int],
    scale: float,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
    variant: str | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_size]
    """Causal attention of a mixed batch (prefills, chunked prefills with a cached prefix, decodes)
    over the paged cache. The step's keys/values must already be in the cache (`kv_cache_write`).

    `variant` picks the kernel (`PREFILL_VARIANTS`; see the module docstring)."""
    window = _window(sliding_window)
    name = prefill_variant(variant)
    if not use_kernels(query):
        return _reference(
            query, kv_cache, block_tables, query_lens_cpu, seq_lens_cpu, scale, sliding_window, out
        )
    if out is None:
        out = torch.empty_like(query)
    if name == "v8" and not runs_v8(query.device):
        name = "v9"  # the Volta-legal prefill kernel
    op = kernel_ops().paged_prefill_attention_v8 if name == "v8" else kernel_ops().paged_prefill_attention_v9
    # An unsupported head size gets the glue's error, not a KeyError here (any tile count will do).
    block_m = PREFILL_BLOCK_M[name].get(query.shape[-1], 1)
    row_tiles = prefill_row_tiles(query_lens_cpu, block_m)
    op(out, query, kv_cache, block_tables, seq_lens, query_start_loc, row_tiles, scale, window)
    return out
