"""The batched torch backend against its own one-sequence definition (`gather_context` + `attend`).

Random paged caches with shuffled blocks and mixed context lengths: pure-decode steps (the vectorised
path), mixed steps (decodes + chunks after a cached prefix), zero-length entries, GQA, sliding windows,
and a step plan shared by several layers with different windows.
"""

from __future__ import annotations

import pytest
import torch
from paged_batch import PagedBatch

from voltllm.layers.attention import AttentionSpec, TorchAttentionBackend
from voltllm.layers.attention.backend import AttentionMetadata
from voltllm.ops.attention import attend, gather_context

BLOCK_SIZE, NUM_BLOCKS, HEAD_SIZE = 4, 256, 8


def _per_sequence(
    spec: AttentionSpec, query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata
) -> torch.Tensor:
    """The attention of every query, one sequence at a time (after the backend wrote the step's K/V)."""
    out = torch.full_like(query, float("nan"))
    start = 0
    for i, (query_len, seq_len) in enumerate(
        zip(metadata.query_lens_cpu, metadata.seq_lens_cpu, strict=True)
    ):
        if query_len:
            keys, values = gather_context(kv_cache, metadata.block_tables[i], seq_len)
            out[start : start + query_len] = attend(
                query[start : start + query_len], keys, values, spec.scale, spec.sliding_window
            )
        start += query_len
    return out


def _run_steps(
    specs: list[AttentionSpec], steps: list[list[int]], dtype: torch.dtype = torch.float32, seed: int = 0
) -> None:
    """Run each step through one backend for every spec (one KV cache per spec, like layers) and compare."""
    gen = torch.Generator().manual_seed(seed)
    backend = TorchAttentionBackend()
    num_kv_heads = specs[0].num_kv_heads
    caches = [torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, HEAD_SIZE, dtype=dtype) for _ in specs]
    batch = PagedBatch(len(steps[0]), NUM_BLOCKS, BLOCK_SIZE, seed=seed)
    for query_lens in steps:
        metadata = batch.step(query_lens)
        n = sum(query_lens)
        for spec, kv_cache in zip(specs, caches, strict=True):
            q = torch.randn(n, spec.num_heads, HEAD_SIZE, generator=gen).to(dtype)
            k = torch.randn(n, num_kv_heads, HEAD_SIZE, generator=gen).to(dtype)
            v = torch.randn(n, num_kv_heads, HEAD_SIZE, generator=gen).to(dtype)
            out = backend.forward(spec, q, k, v, kv_cache, metadata)
            assert out.shape == q.shape and out.dtype == dtype
            expected = _per_sequence(spec, q, kv_cache, metadata)
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            torch.testing.assert_close(out.float(), expected.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("sliding_window", [None, 3, 9])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (6, 2), (8, 1)])
def test_pure_decode_batches_match_per_sequence(
    num_heads: int, num_kv_heads: int, sliding_window: int | None
) -> None:
    spec = AttentionSpec(num_heads, num_kv_heads, HEAD_SIZE, HEAD_SIZE**-0.5, sliding_window)
    # Prompts of very different lengths, then several all-decode steps (contexts 1..40 tokens).
    _run_steps([spec], [[1, 7, 29, 12, 4], *[[1] * 5] * 6, [1, 1, 1, 1, 1]])


@pytest.mark.parametrize("sliding_window", [None, 5])
def test_mixed_steps_match_per_sequence(sliding_window: int | None) -> None:
    spec = AttentionSpec(6, 2, HEAD_SIZE, 0.3, sliding_window)
    steps = [
        [9, 3, 0, 14],  # prefills, one sequence not scheduled
        [1, 6, 5, 1],  # decodes, a chunk after a cached prefix, a first chunk
        [0, 1, 11, 1],  # a skipped sequence between decodes and a long chunk
        [1, 1, 1, 1],  # all decode
        [2, 0, 1, 1],
    ]
    _run_steps([spec], steps)


def test_bfloat16_cache() -> None:
    spec = AttentionSpec(4, 2, HEAD_SIZE, HEAD_SIZE**-0.5, None)
    _run_steps([spec], [[5, 13, 2], [1, 1, 1], [1, 4, 1]], dtype=torch.bfloat16)


def test_one_step_plan_serves_layers_with_different_windows() -> None:
    """The per-step plan is built on the first layer and reused: later layers with another sliding
    window (or none) and their own caches must still get their own masks."""
    specs = [
        AttentionSpec(4, 2, HEAD_SIZE, 0.5, None),
        AttentionSpec(4, 2, HEAD_SIZE, 0.5, 3),
        AttentionSpec(4, 2, HEAD_SIZE, 0.5, None),
        AttentionSpec(4, 2, HEAD_SIZE, 0.5, 6),
    ]
    _run_steps(specs, [[8, 3, 17], [1, 1, 1], [1, 5, 1], [1, 1, 1]])


def test_new_metadata_gets_a_new_plan() -> None:
    """Two decode steps with equal shapes but different block tables over a filled cache: the second
    must not reuse the first's gather indices."""
    spec = AttentionSpec(2, 2, HEAD_SIZE, 1.0)
    backend = TorchAttentionBackend()
    gen = torch.Generator().manual_seed(0)
    kv_cache = torch.randn(2, NUM_BLOCKS, BLOCK_SIZE, 2, HEAD_SIZE, generator=gen)
    q = torch.randn(2, 2, HEAD_SIZE, generator=gen)
    k = torch.randn(2, 2, HEAD_SIZE, generator=gen)
    outs = []
    for tables in ([[3, 8, 5], [9, 1, 2]], [[7, 4, 6], [10, 11, 12]]):
        metadata = AttentionMetadata(
            query_start_loc=torch.tensor([0, 1, 2], dtype=torch.int32),
            seq_lens=torch.tensor([10, 9], dtype=torch.int32),
            block_tables=torch.tensor(tables, dtype=torch.int32),
            slot_mapping=torch.tensor([tables[0][2] * BLOCK_SIZE + 1, tables[1][2] * BLOCK_SIZE]),
            max_query_len=1,
            max_seq_len=10,
            query_lens_cpu=(1, 1),
            seq_lens_cpu=(10, 9),
        )
        outs.append(backend.forward(spec, q, k, k, kv_cache, metadata))
        torch.testing.assert_close(outs[-1], _per_sequence(spec, q, kv_cache, metadata))
    assert not torch.allclose(outs[0], outs[1])
