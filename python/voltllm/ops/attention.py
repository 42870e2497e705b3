"""Paged attention ops: KV-cache write, decode attention, prefill / chunked-prefill attention.

Each op runs the CUDA kernel for CUDA tensors and its plain-torch reference (`*_ref`, the test oracle)
elsewhere. KV cache layout (see `voltllm.layers.attention.backend`):
`kv_cache: [2, num_blocks, block_size=16, num_kv_heads, head_size]`.

Kernels (docs/kernels.md, csrc/attention/): decode has one, `paged_decode_wmma` (split-K, WMMA, every
GPU). Prefill has two: `mma_sm80` (mma.sync m16n8k16, SM80 and newer) and `wmma` (Volta-legal, every GPU);
a call runs the one for its device's compute capability (`prefill_variant`), or the one named by
`variant=` (tests and benchmarks). No environment variable chooses a kernel.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from voltllm.ops._dispatch import kernel_ops, use_kernels

BLOCK_SIZE = 16  # tokens per KV block the kernels are written for
# The prefill kernels by variant name: paged_prefill_<name>.cuh, op paged_prefill_attention_<name>.
# mma_sm80: mma.sync / ldmatrix / cp.async (SM80+); wmma: WMMA only (BLOCK_M 128, softmax on registers),
# Volta-legal, runs on every GPU. The SM80+ kernel is the default where it runs (1.3x wmma on the H200,
# benches/RESULTS.md).
PREFILL_VARIANTS = ("mma_sm80", "wmma")
# Query rows per prefill thread block, by variant and head size (PrefillMmaSm80Traits / PrefillWmmaTraits
# kBlockM; the ops prefill_block_m_<name> report the same). The row-tile count of a launch uses it.
PREFILL_BLOCK_M = {
    "mma_sm80": {64: 128, 128: 128, 256: 64},
    "wmma": {64: 128, 128: 128, 256: 64},
}
# Who merges the decode kernel's context splits: "auto" (the kernel itself up to TICKET_MERGE_MAX_SPLITS
# splits, the split-merge kernel beyond), "ticket" (always the kernel: the last split block of each
# (sequence, kv head) to finish, counted by a ticket) or "kernel" (always the split-merge kernel).
DECODE_MERGES = ("auto", "ticket", "kernel")
# With few splits the merge is a few partials' worth of reads: cheaper in the last block than a launch.
# Many splits (long contexts at small batches) are merged faster by the merge kernel, which spreads each
# head over blocks (benches/RESULTS.md, "Batch-1 decode (issue 21)"). Merging every split count in the
# kernel measured slower, also at batch 1 where the graph's grid holds ~33 splits and the merge kernel
# runs in every layer: 1.016x the step, and 1x32k decode 0.034 against 0.028 ms (RESULTS, session 14).
TICKET_MERGE_MAX_SPLITS = 16
# Tokens a decode split covers at least (one KV block a warp): a sequence splits by its own length
# (`decode_split` in csrc/attention/paged_decode_common.cuh) into as many splits as the grid's one wave
# allows. At batch 1 a short context then runs on several blocks per kv head instead of one: Qwen3-0.6B
# batch-1 decode 0.804 -> 0.780 ms of device time per step against 256-token splits (benches/RESULTS.md,
# "Batch-1 decode (issue 21)", call 3). Long contexts split by the grid's wave either way.
DECODE_MIN_SPLIT = 64
# Tensors the decode kernel asks L2 for at most (L2Prefetch::kMaxRanges in
# csrc/attention/paged_decode_common.cuh).
L2_PREFETCH_MAX_TENSORS = 4
# Every ticket buffer ever handed out, per device: a CUDA graph keeps using the one it was captured with.
_TICKET_BUFFERS: dict[torch.device, list[torch.Tensor]] = {}


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def runs_sm80_kernels(device: torch.device) -> bool:
    """Whether the SM80+ (`mma_sm80`) kernels run on `device`: a CUDA device of SM80 or newer."""
    return device.type == "cuda" and _capability(device.index if device.index is not None else 0)[0] >= 8


def prefill_variants(device: torch.device) -> tuple[str, ...]:
    """The prefill variants that run on `device`, the default (`prefill_variant`) first."""
    return PREFILL_VARIANTS if runs_sm80_kernels(device) else ("wmma",)


def prefill_variant(device: torch.device, variant: str | None = None) -> str:
    """The prefill kernel a call on `device` runs: `variant` when given, else `mma_sm80` on SM80 and newer
    and `wmma` below (Volta)."""
    if variant is None:
        return prefill_variants(device)[0]
    if variant not in PREFILL_VARIANTS:
        raise ValueError(f"unknown kernel variant {variant!r}; known: {PREFILL_VARIANTS}")
    return variant


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


def kernel_window(sliding_window: int | None) -> int:
    """The kernels' window argument: 0 for none; a ValueError for a window below 1."""
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
    return sliding_window or 0


def merge_tickets(device: torch.device, count: int) -> torch.Tensor:
    """At least `count` zeroed int32 counters for the decode kernel's in-kernel split merge on `device`.

    One persistent buffer per device serves every layer and step: the kernel leaves its counters zero,
    and kernels on one stream never overlap their merges. (Two streams running decode attention at once
    on one device would need buffers of their own.) A buffer is never freed once handed out, since a CUDA
    graph captured with it replays with its address; one first needed during a capture is made for that
    capture alone, zeroed by the graph itself (the runner's eager warm-up step makes the shared one first).
    """
    buffers = _TICKET_BUFFERS.setdefault(device, [])
    if buffers and buffers[-1].numel() >= count:
        return buffers[-1]
    if torch.cuda.is_current_stream_capturing():
        return torch.zeros(count, dtype=torch.int32, device=device)
    buffers.append(torch.zeros(max(count, 4096), dtype=torch.int32, device=device))
    return buffers[-1]


def check_decode_merge(merge: str) -> None:
    """A ValueError naming the known policies unless `merge` is one of DECODE_MERGES."""
    if merge not in DECODE_MERGES:
        raise ValueError(f"unknown decode merge {merge!r}; known: {DECODE_MERGES}")


def decode_merge_args(
    merge: str, device: torch.device, num_seqs: int, num_kv_heads: int
) -> tuple[torch.Tensor | None, int]:
    """The decode ops' `(merge_tickets, ticket_max_splits)` arguments for a `merge` policy (DECODE_MERGES)."""
    check_decode_merge(merge)
    if merge == "kernel":
        return None, 0
    limit = TICKET_MERGE_MAX_SPLITS if merge == "auto" else 1 << 30
    return merge_tickets(device, num_seqs * num_kv_heads), limit


def paged_decode_attention(
    query: torch.Tensor,  # [num_seqs, num_heads, head_size]: one query token per sequence
    kv_cache: torch.Tensor,  # [2, num_blocks, 16, num_kv_heads, head_size]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32, context length including the query token
    seq_lens_cpu: Sequence[int],
    scale: float,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
    merge: str = "auto",
    min_split: int = DECODE_MIN_SPLIT,
    l2_prefetch: Sequence[torch.Tensor] = (),
) -> torch.Tensor:  # [num_seqs, num_heads, head_size]
    """Attention of each sequence's newest token over its whole paged context (split-K on long ones,
    each sequence split by its own length into splits of at least `min_split` tokens; `merge` says who
    merges the splits, DECODE_MERGES).

    `l2_prefetch`: up to four contiguous, 16-byte aligned tensors on the device (the layer's next weights)
    the kernel asks L2 for while it runs, up to half of the L2 (SM90+; ignored before); the result does
    not depend on them.

    CUDA-graph safe: per-sequence lengths come from `seq_lens` on the device, `seq_lens_cpu` only bounds
    them. On SM90+ the kernel starts reading old K/V while the kernel queued just before it finishes, so that
    kernel may write each sequence's newest token (position seq_len - 1) but no older one (docs/kernels.md).
    """
    window = kernel_window(sliding_window)
    if not use_kernels(query):
        check_decode_merge(merge)  # the same errors as on CUDA
        query_lens = [1] * len(seq_lens_cpu)
        return _reference(query, kv_cache, block_tables, query_lens, seq_lens_cpu, scale, sliding_window, out)
    if out is None:
        out = torch.empty_like(query)
    max_seq_len = max(seq_lens_cpu, default=1)
    tickets, ticket_max_splits = decode_merge_args(merge, query.device, query.shape[0], kv_cache.shape[3])
    kernel_ops().paged_decode_attention(
        out,
        query,
        kv_cache,
        block_tables,
        seq_lens,
        max_seq_len,
        scale,
        window,
        min_split,
        tickets,
        ticket_max_splits,
        list(l2_prefetch),
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

    `variant` names the kernel (`PREFILL_VARIANTS`); without it the device's compute capability picks
    (`prefill_variant`). A variant the device cannot run gets the glue's error."""
    window = kernel_window(sliding_window)
    name = prefill_variant(query.device, variant)
    if not use_kernels(query):
        return _reference(
            query, kv_cache, block_tables, query_lens_cpu, seq_lens_cpu, scale, sliding_window, out
        )
    if out is None:
        out = torch.empty_like(query)
    op = getattr(kernel_ops(), f"paged_prefill_attention_{name}")
    # An unsupported head size gets the glue's error, not a KeyError here (any tile count will do).
    block_m = PREFILL_BLOCK_M[name].get(query.shape[-1], 1)
    row_tiles = prefill_row_tiles(query_lens_cpu, block_m)
    op(out, query, kv_cache, block_tables, seq_lens, query_start_loc, row_tiles, scale, window)
    return out
