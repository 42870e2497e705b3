"""CUDA kernels against their torch references, on fresh random inputs, for every shape class.

Outputs are poisoned with NaN before each run, so an element the kernel fails to write fails the test.
Skipped without a CUDA device (tests/conftest.py).
"""

from __future__ import annotations

import functools
import math
import random
import zlib

import pytest
import torch

from voltllm import ops
from voltllm.layers.attention.backend import AttentionMetadata, AttentionSpec
from voltllm.ops.attention import PREFILL_BLOCK_M, PREFILL_VARIANTS, prefill_variants

pytestmark = pytest.mark.gpu

DEVICE = "cuda"
# ||out - ref|| / ||ref|| bounds: 16-bit output rounding plus 16-bit probabilities in the PV product.
REL_TOL = {torch.float16: 4e-3, torch.bfloat16: 2e-2}


def _dtypes() -> list[torch.dtype]:
    if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 8:
        return [torch.float16, torch.bfloat16]
    return [torch.float16]


def _prefill_variants() -> tuple[str, ...]:
    """The prefill kernels this GPU runs (every one where there is none: the tests are skipped then)."""
    return prefill_variants(torch.device(DEVICE)) if torch.cuda.is_available() else PREFILL_VARIANTS


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all(), "output has NaN/inf: an element was not written"
    return float((out.double() - ref.double()).norm() / ref.double().norm())


class PagedBatch:
    """A random batch over a paged KV cache with shuffled, non-contiguous blocks."""

    def __init__(
        self,
        query_lens: list[int],
        seq_lens: list[int],
        num_heads: int,
        num_kv_heads: int,
        head_size: int,
        dtype: torch.dtype,
        seed: int,
        poison_unused: bool = False,
    ) -> None:
        gen = torch.Generator(device=DEVICE).manual_seed(seed)
        rng = random.Random(seed)
        self.query_lens, self.seq_lens = query_lens, seq_lens
        blocks_per_seq = [-(-s // 16) for s in seq_lens]
        num_blocks = sum(blocks_per_seq) + 5
        perm = list(range(num_blocks))
        rng.shuffle(perm)
        tables = torch.zeros(len(seq_lens), max(blocks_per_seq) + 2, dtype=torch.int32)
        slots = []
        used = 0
        for i, (n, q_len, s_len) in enumerate(zip(blocks_per_seq, query_lens, seq_lens, strict=True)):
            tables[i, :n] = torch.tensor(perm[used : used + n], dtype=torch.int32)
            used += n
            for pos in range(s_len - q_len, s_len):
                slots.append(int(tables[i, pos // 16]) * 16 + pos % 16)
        num_tokens = sum(query_lens)
        shape = (2, num_blocks, 16, num_kv_heads, head_size)
        self.kv_cache = torch.randn(shape, generator=gen, device=DEVICE).to(dtype)
        if poison_unused:
            # Slots no sequence owns (block tails, spare blocks) hold NaN, as uninitialised memory may.
            owned = torch.zeros(num_blocks * 16, dtype=torch.bool)
            for i, s_len in enumerate(seq_lens):
                for pos in range(s_len):
                    owned[int(tables[i, pos // 16]) * 16 + pos % 16] = True
            flat = self.kv_cache.view(2, num_blocks * 16, -1)
            flat[:, ~owned.to(DEVICE)] = float("nan")
        self.query = torch.randn(num_tokens, num_heads, head_size, generator=gen, device=DEVICE).to(dtype)
        self.key = torch.randn(num_tokens, num_kv_heads, head_size, generator=gen, device=DEVICE).to(dtype)
        self.value = torch.randn(num_tokens, num_kv_heads, head_size, generator=gen, device=DEVICE).to(dtype)
        self.block_tables = tables.to(DEVICE)
        self.slot_mapping = torch.tensor(slots, dtype=torch.int64, device=DEVICE)
        self.seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
        starts = [0]
        for q in query_lens:
            starts.append(starts[-1] + q)
        self.query_start_loc = torch.tensor(starts, dtype=torch.int32, device=DEVICE)
        self.scale = 1 / math.sqrt(head_size)

    def metadata(self) -> AttentionMetadata:
        return AttentionMetadata(
            query_start_loc=self.query_start_loc,
            seq_lens=self.seq_lens_t,
            block_tables=self.block_tables,
            slot_mapping=self.slot_mapping,
            max_query_len=max(self.query_lens),
            max_seq_len=max(self.seq_lens),
            query_lens_cpu=tuple(self.query_lens),
            seq_lens_cpu=tuple(self.seq_lens),
        )

    def reference(self, sliding_window: int | None = None) -> torch.Tensor:
        return ops.paged_attention_ref(
            self.query,
            self.kv_cache,
            self.block_tables,
            self.query_lens,
            self.seq_lens,
            self.scale,
            sliding_window,
        )

    def decode(self, sliding_window: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """`ops.paged_decode_attention` of this batch (one query token per sequence), into `out` or NaN."""
        out = torch.full_like(self.query, float("nan")) if out is None else out
        ops.paged_decode_attention(
            self.query,
            self.kv_cache,
            self.block_tables,
            self.seq_lens_t,
            self.seq_lens,
            self.scale,
            sliding_window,
            out=out,
        )
        return out

    def prefill(self, variant: str | None, sliding_window: int | None = None) -> torch.Tensor:
        """`ops.paged_prefill_attention` of this batch, kernel `variant` (None: the device's), into NaN."""
        out = torch.full_like(self.query, float("nan"))
        ops.paged_prefill_attention(
            self.query,
            self.kv_cache,
            self.block_tables,
            self.seq_lens_t,
            self.query_start_loc,
            self.query_lens,
            self.seq_lens,
            self.scale,
            sliding_window,
            out=out,
            variant=variant,
        )
        return out


# ---------------------------------------------------------------- decode


def _decode_lens(kind: str, rng: random.Random) -> list[int]:
    return {
        "1x1": [1],
        "1x32k": [32768],
        "mixed": [1, 15, 16, 17, 255, 1000, 3000] + [rng.randint(1, 3000) for _ in range(30)],
        "16x8k": [8192] + [rng.randint(7000, 8192) for _ in range(15)],
        "64x4k": [rng.randint(1, 4096) for _ in range(63)] + [4096],
        "256x1k": [rng.randint(1, 1024) for _ in range(255)] + [1024],
    }[kind]


DECODE_CASES = [
    (kind, head, group)
    for kind in ("1x1", "1x32k", "16x8k", "64x4k", "256x1k")
    for head, group in ((128, 8), (64, 4), (256, 1))
] + [("mixed", head, group) for head in (64, 128, 256) for group in (1, 4, 8)]


@functools.lru_cache(maxsize=2)
def _decode_case(kind: str, head_size: int, group: int, dtype: torch.dtype):
    """(batch, reference) of one decode case."""
    rng = random.Random(zlib.crc32(f"{kind}-{head_size}-{group}".encode()))
    seq_lens = _decode_lens(kind, rng)
    num_kv_heads = 2 if group == 8 else 4
    batch = PagedBatch([1] * len(seq_lens), seq_lens, num_kv_heads * group, num_kv_heads, head_size, dtype, 7)
    return batch, batch.reference()


@pytest.mark.parametrize("kind,head_size,group", DECODE_CASES)
@pytest.mark.parametrize("dtype", _dtypes())
def test_paged_decode_attention(kind: str, head_size: int, group: int, dtype: torch.dtype) -> None:
    batch, reference = _decode_case(kind, head_size, group, dtype)
    assert rel_err(batch.decode(), reference) < REL_TOL[dtype]


@pytest.mark.parametrize("window", [1, 100, 1000])
def test_paged_decode_attention_sliding_window(window: int) -> None:
    seq_lens = [1, 50, 999, 1000, 1001, 5000]
    batch = PagedBatch([1] * 6, seq_lens, 16, 4, 128, torch.float16, 11)
    assert rel_err(batch.decode(window), batch.reference(window)) < REL_TOL[torch.float16]


def test_decode_cuda_graph_replays_with_shorter_sequences() -> None:
    """Captured once with a fixed max_seq_len, replayed with other (shorter) device lengths: each replay
    is right."""
    seq_lens = [4000, 100, 1, 2500]
    batch = PagedBatch([1] * 4, seq_lens, 32, 4, 128, torch.float16, 21)
    out = torch.full_like(batch.query, float("nan"))

    def step() -> None:
        batch.decode(out=out)

    step()  # eager warm-up, as the engine does before capturing
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for lens in ([4000, 100, 1, 2500], [17, 3000, 1, 64], [1, 1, 1, 1], [4000, 4000, 4000, 4000]):
        batch.seq_lens_t.copy_(torch.tensor(lens, dtype=torch.int32))
        out.fill_(float("nan"))
        graph.replay()
        reference = ops.paged_attention_ref(
            batch.query, batch.kv_cache, batch.block_tables, [1] * 4, lens, batch.scale
        )
        assert rel_err(out, reference) < REL_TOL[torch.float16], lens


@pytest.mark.parametrize("graphed", [False, True])
def test_decode_sees_the_newest_token_written_just_before(graphed: bool) -> None:
    """The decode kernel reads old K/V before waiting for the kernel before it (on SM90+); the newest
    token's K/V, written by that kernel, must still be the fresh one: each step writes a new newest
    key aligned with the query (so it dominates the softmax) and a new value, then attends."""
    seq_lens = [4000, 33, 1, 2500, 4096]  # newest token first, middle and last in its block
    batch = PagedBatch([1] * 5, seq_lens, 32, 4, 128, torch.float16, 23)
    steps = 4
    group_query = batch.query.view(5, 4, 8, 128).float().mean(2)
    keys = [(group_query * 4 * (s + 2)).half() for s in range(steps)]  # scores ~10-30: dominant
    values = [torch.randn_like(batch.value) * (s + 1) for s in range(steps)]
    outs = [torch.full_like(batch.query, float("nan")) for _ in range(steps)]

    def run() -> None:
        for key, value, out in zip(keys, values, outs, strict=True):
            ops.kv_cache_write(key, value, batch.kv_cache, batch.slot_mapping)
            batch.decode(out=out)

    if graphed:
        run()  # warm-up, as the engine does before capturing
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run()
        for out in outs:
            out.fill_(float("nan"))
        graph.replay()
    else:
        run()
    torch.cuda.synchronize()
    for key, value, out in zip(keys, values, outs, strict=True):
        ops.kv_cache_write(key, value, batch.kv_cache, batch.slot_mapping)
        assert rel_err(out, batch.reference()) < REL_TOL[torch.float16]


def test_unowned_cache_slots_never_leak_into_outputs() -> None:
    seq_lens = [1, 17, 100, 1000, 4097]
    batch = PagedBatch([1] * 5, seq_lens, 32, 4, 128, torch.float16, 13, poison_unused=True)
    assert rel_err(batch.decode(), batch.reference()) < REL_TOL[torch.float16]
    batch = PagedBatch([1, 30, 7], [1, 50, 300], 32, 4, 128, torch.float16, 14, poison_unused=True)
    out = batch.prefill(None)
    assert rel_err(out, batch.reference()) < REL_TOL[torch.float16]


# ---------------------------------------------------------------- prefill

PREFILL_SHAPES = {
    "single": ([1000], [1000]),
    "tiny": ([1], [1]),
    "ragged": ([17], [17]),
    "long": ([2048], [2048]),
    "prefix_hit": ([300], [5000]),  # 4700 cached tokens, then a 300-token chunk
    "chunk_after_32k": ([64], [32768]),
    "mixed": ([1, 1, 100, 513, 1, 64, 130], [1, 900, 100, 2000, 33, 64, 700]),
}


@functools.lru_cache(maxsize=2)
def _prefill_case(shape: str, head_size: int, group: int, dtype: torch.dtype):
    """(batch, reference) of one prefill case, shared by the variants that test it in a row."""
    query_lens, seq_lens = PREFILL_SHAPES[shape]
    num_kv_heads = 2
    batch = PagedBatch(query_lens, seq_lens, num_kv_heads * group, num_kv_heads, head_size, dtype, 3)
    return batch, batch.reference()


@pytest.mark.parametrize("variant", _prefill_variants())
@pytest.mark.parametrize(
    "shape,head_size,group",
    [(s, 128, 4) for s in PREFILL_SHAPES]
    + [("mixed", h, g) for h in (64, 128, 256) for g in (1, 4, 8) if (h, g) != (128, 4)],
)
@pytest.mark.parametrize("dtype", _dtypes())
def test_paged_prefill_attention(
    shape: str, head_size: int, group: int, dtype: torch.dtype, variant: str
) -> None:
    batch, reference = _prefill_case(shape, head_size, group, dtype)
    assert rel_err(batch.prefill(variant), reference) < REL_TOL[dtype]


@pytest.mark.parametrize("variant", _prefill_variants())
def test_paged_prefill_many_sequences_and_window(variant: str) -> None:
    rng = random.Random(5)
    query_lens = [rng.randint(1, 200) for _ in range(64)]
    seq_lens = [q + rng.randint(0, 500) for q in query_lens]
    batch = PagedBatch(query_lens, seq_lens, 32, 8, 128, torch.float16, 5)
    for window in (None, 37, 128):
        out = batch.prefill(variant, window)
        assert rel_err(out, batch.reference(window)) < REL_TOL[torch.float16], window


@pytest.mark.parametrize("variant", _prefill_variants())
def test_prefill_unowned_cache_slots_never_leak_into_outputs(variant: str) -> None:
    """NaN in every slot no sequence owns (block tails, spare blocks): decode rows, a chunk after a
    cached prefix, and row tiles that end inside a KV block."""
    query_lens, seq_lens = [1, 30, 7, 130, 1], [1, 50, 300, 130, 17]
    batch = PagedBatch(query_lens, seq_lens, 32, 4, 128, torch.float16, 15, poison_unused=True)
    assert rel_err(batch.prefill(variant), batch.reference()) < REL_TOL[torch.float16]


# ---------------------------------------------------------------- backend


@pytest.mark.parametrize("volta", [False, True])
@pytest.mark.parametrize("decode", [True, False])
def test_sm70_backend_matches_torch_backend(
    decode: bool, volta: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The backend runs the kernels the device's compute capability picks; `volta` makes the Python layer
    see SM70, so that prefill runs the Volta kernel (`wmma`) as on a V100."""
    from voltllm.layers.attention.sm70 import SM70AttentionBackend
    from voltllm.layers.attention.torch_ref import TorchAttentionBackend

    if volta:
        monkeypatch.setattr(ops.attention, "_capability", lambda index: (7, 0))
    query_lens = [1] * 9 if decode else [1, 40, 1, 200, 3]
    seq_lens = [1, 16, 17, 100, 555, 2000, 31, 64, 65] if decode else [20, 40, 300, 1200, 3]
    batch = PagedBatch(query_lens, seq_lens, 16, 2, 128, torch.float16, 9)
    spec = AttentionSpec(num_heads=16, num_kv_heads=2, head_size=128, scale=batch.scale)
    cache_ref = batch.kv_cache.clone()
    expected = TorchAttentionBackend().forward(
        spec, batch.query, batch.key, batch.value, cache_ref, batch.metadata()
    )
    out = SM70AttentionBackend(DEVICE).forward(
        spec, batch.query, batch.key, batch.value, batch.kv_cache, batch.metadata()
    )
    assert torch.equal(batch.kv_cache, cache_ref)  # the step's K/V landed in the same slots
    assert rel_err(out, expected.float()) < REL_TOL[torch.float16]


def test_sm70_backend_asks_l2_for_the_next_weights_only_at_small_decode_batches() -> None:
    """`l2_prefetch_max_seqs` bounds the decode batches whose kernel asks L2 for `next_weights`: the
    contiguous, 16-byte aligned CUDA tensors among them, at most four, on an SM90+ GPU; none on larger
    batches, prefill steps, at 0 or before SM90."""
    from voltllm.layers.attention.sm70 import L2_PREFETCH_MIN_CAPABILITY, SM70AttentionBackend

    weights = [torch.zeros(64, 64, device=DEVICE) for _ in range(5)]
    strided, host, unaligned = weights[0].t(), torch.zeros(8), weights[0].view(-1)[1:]
    backend = SM70AttentionBackend(DEVICE, l2_prefetch_max_seqs=8)
    decode8 = PagedBatch([1] * 8, [40] * 8, 16, 2, 128, torch.float16, 1).metadata()
    decode9 = PagedBatch([1] * 9, [40] * 9, 16, 2, 128, torch.float16, 1).metadata()
    prefill = PagedBatch([3], [40], 16, 2, 128, torch.float16, 1).metadata()
    asked = backend._l2_prefetch(decode8, 8, [strided, weights[1], host, unaligned, *weights[2:]])
    if torch.cuda.get_device_capability(DEVICE) < L2_PREFETCH_MIN_CAPABILITY:
        assert asked == ()
        return
    assert len(asked) == 4 and all(a is w for a, w in zip(asked, weights[1:], strict=True))
    assert backend._l2_prefetch(decode9, 9, weights) == ()
    assert backend._l2_prefetch(prefill, 3, weights) == ()
    backend.l2_prefetch_max_seqs = 0
    assert backend._l2_prefetch(decode8, 8, weights) == ()
    with pytest.raises(ValueError, match="l2_prefetch_max_seqs must be >= 0"):
        SM70AttentionBackend(DEVICE, l2_prefetch_max_seqs=-1)


# ---------------------------------------------------------------- KV write and element-wise ops


@pytest.mark.parametrize("dtype", _dtypes())
def test_kv_cache_write_strided_source_and_padding(dtype: torch.dtype) -> None:
    num_tokens, num_heads, num_kv_heads, head_size = 300, 8, 2, 128
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_size, device=DEVICE).to(dtype)
    key = qkv[:, num_heads * head_size : (num_heads + num_kv_heads) * head_size].view(
        -1, num_kv_heads, head_size
    )
    value = qkv[:, (num_heads + num_kv_heads) * head_size :].view(-1, num_kv_heads, head_size)
    kv_cache = torch.randn(2, 40, 16, num_kv_heads, head_size, device=DEVICE).to(dtype)
    slots = torch.randperm(40 * 16, device=DEVICE)[:num_tokens]
    slots[::7] = -1  # padding tokens
    expected = kv_cache.clone()
    ops.kv_cache_write_ref(key, value, expected, slots)
    ops.kv_cache_write(key, value, kv_cache, slots)
    assert torch.equal(kv_cache, expected)


@pytest.mark.parametrize("hidden", [4096, 1001])  # 16-byte vector path and scalar path
@pytest.mark.parametrize("dtype", _dtypes())
def test_rms_norm_and_fused_add(hidden: int, dtype: torch.dtype) -> None:
    x = torch.randn(77, hidden, device=DEVICE).to(dtype)
    residual = torch.randn(77, hidden, device=DEVICE).to(dtype)
    weight = torch.randn(hidden, device=DEVICE).to(dtype)
    out = torch.full_like(x, float("nan"))
    ops.rms_norm(x, weight, 1e-5, out=out)
    assert rel_err(out, ops.rms_norm_ref(x, weight, 1e-5).float()) < 2e-3
    expected_x, expected_res = ops.fused_add_rms_norm_ref(x, residual, weight, 1e-5)
    ops.fused_add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(residual, expected_res)  # the sum is rounded exactly as the unfused sequence
    assert rel_err(x, expected_x.float()) < 2e-3


@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("rot_dim", [128, 64])
@pytest.mark.parametrize("dtype", _dtypes())
def test_rotary_embedding(is_neox: bool, rot_dim: int, dtype: torch.dtype) -> None:
    head_size, num_heads, num_kv_heads, num_tokens = 128, 32, 8, 513
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, rot_dim, 2).float() / rot_dim)) / 4.0  # linear scaling x4
    table = ops.cos_sin_cache(inv_freq, 40000, device=DEVICE)
    positions = torch.randint(0, 40000, (num_tokens,), device=DEVICE)
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_size, device=DEVICE).to(dtype)
    query = qkv[:, : num_heads * head_size]
    key = qkv[:, num_heads * head_size : (num_heads + num_kv_heads) * head_size]
    rq, rk = ops.rotary_embedding_ref(positions, query, key, table, head_size, is_neox)
    value_before = qkv[:, (num_heads + num_kv_heads) * head_size :].clone()
    ops.rotary_embedding(positions, query, key, table, head_size, is_neox)
    assert rel_err(query, rq.float()) < 2e-3 and rel_err(key, rk.float()) < 2e-3
    assert torch.equal(qkv[:, (num_heads + num_kv_heads) * head_size :], value_before)


@pytest.mark.parametrize("d", [11008, 1001])
@pytest.mark.parametrize("dtype", _dtypes())
def test_silu_and_mul(d: int, dtype: torch.dtype) -> None:
    x = torch.randn(64, 2 * d, device=DEVICE).to(dtype)
    out = torch.full((64, d), float("nan"), device=DEVICE, dtype=dtype)
    ops.silu_and_mul(x, out=out)
    assert rel_err(out, ops.silu_and_mul_ref(x).float()) < 2e-3


# ---------------------------------------------------------------- bad input


def test_bad_input_raises_clear_errors() -> None:
    batch = PagedBatch([1], [20], 4, 4, 128, torch.float16, 1)
    with pytest.raises(RuntimeError, match="head_size"):
        q = torch.randn(1, 4, 96, device=DEVICE, dtype=torch.float16)
        cache = torch.randn(2, 4, 16, 4, 96, device=DEVICE, dtype=torch.float16)
        ops.paged_decode_attention(q, cache, batch.block_tables, batch.seq_lens_t, [20], 0.1)
    with pytest.raises(RuntimeError, match="dtype"):
        ops.rms_norm(torch.randn(2, 64, device=DEVICE), torch.randn(64, device=DEVICE), 1e-6)
    with pytest.raises(RuntimeError, match="block table"):
        ops.paged_decode_attention(
            batch.query, batch.kv_cache, batch.block_tables, batch.seq_lens_t, [10_000], batch.scale
        )
    for variant, block_m_by_head in PREFILL_BLOCK_M.items():
        block_m_op = getattr(torch.ops.voltllm_C, f"prefill_block_m_{variant}")
        for head_size, block_m in block_m_by_head.items():
            assert block_m_op(head_size) == block_m
        with pytest.raises(RuntimeError, match="head_size"):
            block_m_op(96)
    with pytest.raises(ValueError, match=r"unknown kernel variant 'v6'; known: \('mma_sm80', 'wmma'\)"):
        ops.paged_prefill_attention(
            batch.query, batch.kv_cache, batch.block_tables, batch.seq_lens_t, batch.query_start_loc,
            [1], [20], 0.1, variant="v6",
        )  # fmt: skip
    q = torch.randn(1, 4, 96, device=DEVICE, dtype=torch.float16)
    cache = torch.randn(2, 4, 16, 4, 96, device=DEVICE, dtype=torch.float16)
    for variant in _prefill_variants():
        with pytest.raises(RuntimeError, match="head_size"):
            ops.paged_prefill_attention(
                q, cache, batch.block_tables, batch.seq_lens_t, batch.query_start_loc, [1], [20], 0.1,
                variant=variant,
            )  # fmt: skip
