"""The attention kernels' exact CUDA source (decode and its split merge, both prefill kernels), run on the
CPU through the emulator in tests/kernels/emu.

`emu/harness.cpp` compiles the kernel headers with g++ against `emu/cuda_emu.h`, which runs every
thread of a block as a fiber and implements mma.sync m16n8k16, ldmatrix, cp.async, shuffles and
barriers as the PTX ISA documents them, and WMMA m16n16k16 (`emu/include/mma.h`) with fragment
element orders that are deliberately no GPU's. Blocks and threads run in seeded random orders, cp.async
copies land only when waited for, and shared memory starts as garbage, so ordering mistakes show up as
wrong results. Outputs start as NaN; each case compares against `paged_attention_ref`.

This is what proves the kernels' index arithmetic (and that the WMMA kernels assume no fragment layout)
without a GPU; the GPU tests (test_kernels_cuda.py) prove the same kernels on hardware.
"""

from __future__ import annotations

import ctypes
import math
import random

import pytest
import torch
from emulator import build_emulator, needs_gxx, ptr

from voltllm import ops

LOG2E = 1.4426950408889634
# fp16 / bf16 rounding of P and of the output, as for the GPU tests.
REL_TOL = {torch.float16: 4e-3, torch.bfloat16: 2e-2}

pytestmark = needs_gxx


@pytest.fixture(scope="module")
def emu(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    return build_emulator(tmp_path_factory.mktemp("emu"), "harness.cpp")


class Paged:
    """A random paged batch on the CPU: shuffled blocks; optionally NaN in every slot no sequence owns."""

    def __init__(
        self,
        query_lens: list[int],
        seq_lens: list[int],
        num_kv_heads: int,
        group: int,
        head: int,
        dtype: torch.dtype,
        seed: int,
        poison: bool = False,
    ) -> None:
        gen = torch.Generator().manual_seed(seed)
        rng = random.Random(seed)
        self.query_lens, self.seq_lens = query_lens, seq_lens
        self.num_kv_heads, self.num_heads, self.head = num_kv_heads, num_kv_heads * group, head
        blocks = [-(-s // 16) for s in seq_lens]
        num_blocks = sum(blocks) + 3
        perm = list(range(num_blocks))
        rng.shuffle(perm)
        self.tables = torch.zeros(len(seq_lens), max(blocks) + 2, dtype=torch.int32)
        used = 0
        for i, n in enumerate(blocks):
            self.tables[i, :n] = torch.tensor(perm[used : used + n])
            used += n
        self.kv = torch.randn(2, num_blocks, 16, num_kv_heads, head, generator=gen).to(dtype)
        if poison:
            owned = torch.zeros(num_blocks * 16, dtype=torch.bool)
            for i, s in enumerate(seq_lens):
                for pos in range(s):
                    owned[int(self.tables[i, pos // 16]) * 16 + pos % 16] = True
            self.kv.view(2, num_blocks * 16, -1)[:, ~owned] = float("nan")
        self.query = torch.randn(sum(query_lens), self.num_heads, head, generator=gen).to(dtype)
        self.out = torch.full_like(self.query, float("nan"))
        self.seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32)
        self.scale = 1 / math.sqrt(head)
        self.bf16 = int(dtype == torch.bfloat16)

    def decode_span(self, window: int = 0) -> int:
        """Context positions a decode launch's splits cover (the glue's decode_span)."""
        return max(self.seq_lens) if window == 0 else min(max(self.seq_lens), window + 16)

    def split_partials(self, splits: int) -> tuple[torch.Tensor, torch.Tensor]:
        """NaN-filled split partials as the decode kernel leaves them: outputs [seqs, heads, splits, head]
        and (max, sum) [2, seqs, heads, splits]."""
        num_seqs = len(self.seq_lens)
        partial_out = torch.full((num_seqs, self.num_heads, splits, self.head), float("nan"))
        return partial_out, torch.full((2, num_seqs, self.num_heads, splits), float("nan"))

    def rel_err(self, window: int | None = None) -> float:
        ref = ops.paged_attention_ref(
            self.query, self.kv, self.tables, self.query_lens, self.seq_lens, self.scale, window
        )
        assert torch.isfinite(self.out).all(), "output has NaN/inf: an element was not written"
        return float((self.out.double() - ref.double()).norm() / ref.double().norm())


# ---------------------------------------------------------------- decode


def decode_split(emu: ctypes.CDLL, span: int, max_splits: int, min_split: int) -> tuple[int, int]:
    """(splits, tokens per split) of a `span`-position context: decode_split, as glue and kernel run it."""
    result = torch.zeros(2, dtype=torch.int32)
    emu.emu_decode_split(ctypes.c_int(span), ctypes.c_int(max_splits), ctypes.c_int(min_split), ptr(result))
    return int(result[0]), int(result[1])


def sequence_splits(
    emu: ctypes.CDLL, b: Paged, max_splits: int, min_split: int, window: int = 0
) -> list[int]:
    """Each sequence's own split count: the kernel splits a sequence by the positions it attends to."""
    bases = [max(0, s - window) // 16 * 16 if window else 0 for s in b.seq_lens]
    return [
        decode_split(emu, s - f, max_splits, min_split)[0] for s, f in zip(b.seq_lens, bases, strict=True)
    ]


def run_decode(
    emu: ctypes.CDLL,
    b: Paged,
    min_split: int,
    window: int = 0,
    wmma_order: int = 0,
    merge: bool = True,
    tickets: torch.Tensor | None = None,
    grid_span: int | None = None,
    max_splits: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode launch over the splits the glue would give `grid_span` (default: the batch's longest
    span) and, with `merge` and no `tickets` (the kernel then merges itself), the split merge (into
    b.out); returns the split partials (out, stats)."""
    splits = decode_split(emu, grid_span or b.decode_span(window), max_splits, min_split)[0]
    num_seqs = len(b.seq_lens)
    partial_out, stats = b.split_partials(splits)
    k, v = b.kv[0], b.kv[1]
    emu.emu_decode(
        ctypes.c_int(b.bf16), ctypes.c_int(b.head), ptr(b.out), ptr(b.query), ptr(k), ptr(v), ptr(b.tables),
        ptr(b.seq_lens_t), ptr(partial_out), ptr(stats[0]), ptr(stats[1]), ptr(tickets),
        ctypes.c_longlong(b.query.stride(0)), ctypes.c_longlong(b.out.stride(0)), ctypes.c_int(num_seqs),
        ctypes.c_int(b.num_heads), ctypes.c_int(b.num_kv_heads), ctypes.c_int(b.tables.shape[1]),
        ctypes.c_int(splits), ctypes.c_int(min_split), ctypes.c_int(window), ctypes.c_float(b.scale * LOG2E),
        ctypes.c_int(int(merge)), ctypes.c_int(wmma_order), ctypes.c_uint(len(b.seq_lens) + min_split),
    )  # fmt: skip
    return partial_out, stats


@pytest.mark.parametrize(
    "head,group,dtype,min_split,window,wmma_order",
    [
        (128, 8, torch.float16, 64, 0, 0),  # split: partials and the merge; warps with 1 or no blocks
        (128, 8, torch.float16, 4096, 0, 1),  # one split per sequence: the kernel writes the output itself
        (64, 4, torch.float16, 128, 0, 0),
        (256, 1, torch.float16, 32, 0, 0),  # no register prefetch at head 256
        (128, 16, torch.float16, 64, 37, 0),  # 16 query heads per kv head, and a window
        (64, 12, torch.float16, 64, 0, 1),  # a group that is no power of two
        (128, 4, torch.bfloat16, 64, 0, 0),
        (128, 16, torch.bfloat16, 4096, 0, 0),
    ],
)
def test_decode(
    emu: ctypes.CDLL, head: int, group: int, dtype: torch.dtype, min_split: int, window: int, wmma_order: int
) -> None:
    """The decode kernel and its split merge, on WMMA element orders no GPU has."""
    seq_lens = [300, 17, 160, 1, 64, 65]
    b = Paged([1] * len(seq_lens), seq_lens, 2, group, head, dtype, seed=head + group, poison=True)
    run_decode(emu, b, min_split, window, wmma_order)
    assert b.rel_err(window or None) < REL_TOL[dtype]


@pytest.mark.parametrize("window", [1, 100])
def test_decode_sliding_window(emu: ctypes.CDLL, window: int) -> None:
    seq_lens = [1, 50, 300, 301, 90]
    b = Paged([1] * 5, seq_lens, 1, 8, 128, torch.float16, seed=window, poison=True)
    run_decode(emu, b, min_split=32, window=window)
    assert b.rel_err(window) < REL_TOL[torch.float16]


def test_decode_split_rule(emu: ctypes.CDLL) -> None:
    """decode_split by hand: as many splits as max_splits allows, each at least min_split tokens, a multiple
    of 64 (four warps' KV blocks), never more splits than the partition needs."""
    lib = emu
    assert decode_split(lib, 300, 64, 256) == (2, 192)
    assert decode_split(lib, 256, 64, 256) == (1, 256)
    assert decode_split(lib, 4096, 16, 256) == (16, 256)
    assert decode_split(lib, 1000, 3, 64) == (3, 384)
    assert decode_split(lib, 17, 64, 64) == (1, 64)
    assert decode_split(lib, 130, 64, 16) == (3, 64)  # 9 splits of 16 round to 64: three are enough


def test_decode_splits_each_sequence_by_its_own_length(emu: ctypes.CDLL) -> None:
    """A grid sized for a long context (a CUDA graph captured for max_model_len) splits each sequence by
    its real length: the split count and the partials it leaves follow decode_split of that length."""
    seq_lens = [300, 17, 1000, 64, 129]
    b = Paged([1] * len(seq_lens), seq_lens, 2, 2, 128, torch.float16, seed=3, poison=True)
    partial_out, stats = run_decode(emu, b, min_split=64, merge=False, grid_span=4096, max_splits=16)
    own = sequence_splits(emu, b, max_splits=16, min_split=64)
    assert own == [5, 1, 16, 1, 3]
    for i, n in enumerate(own):
        if n == 1:
            assert torch.isfinite(b.out[i]).all()  # one split: written directly, no partials
            assert torch.isnan(stats[:, i]).all()
        else:
            assert torch.isnan(b.out[i]).all()  # left to the merge
            assert torch.isfinite(stats[:, i, :, :n]).all() and torch.isnan(stats[:, i, :, n:]).all()


@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("head,group,window", [(128, 2, 0), (64, 8, 0), (256, 4, 0), (128, 4, 100)])
def test_decode_merges_in_kernel_with_tickets(
    emu: ctypes.CDLL, head: int, group: int, window: int, seed: int
) -> None:
    """With merge tickets the last split block of each (sequence, kv head) to finish merges the splits (the
    block order is shuffled by the seed, so a different block is last), and leaves every ticket at 0."""
    seq_lens = [300, 17, 700, 1, 65, 129]
    b = Paged([1] * len(seq_lens), seq_lens, 2, group, head, torch.float16, seed=seed + head, poison=True)
    tickets = torch.zeros(len(seq_lens) * 2 + 3, dtype=torch.int32)
    run_decode(emu, b, min_split=64, window=window, wmma_order=seed % 2, tickets=tickets, max_splits=8)
    assert max(sequence_splits(emu, b, 8, 64, window)) > 1
    assert b.rel_err(window or None) < REL_TOL[torch.float16]
    assert (tickets == 0).all()


@pytest.mark.parametrize(
    "seq_lens,min_split,head,window",
    [
        ([500, 17, 129], 128, 64, 0),  # one group per split, one batch
        ([3000, 40, 1000], 32, 64, 700),  # a window: splits cover only its last blocks
    ],
)
def test_decode_split_merge_kernel(
    emu: ctypes.CDLL, seq_lens: list[int], min_split: int, head: int, window: int
) -> None:
    """The decode kernel leaves split sequences to the merge, as partials; the split merge kernel
    (paged_decode_reduce_kernel) turns them into the attention."""
    b = Paged([1] * len(seq_lens), seq_lens, 2, 8, head, torch.float16, seed=len(seq_lens) + min_split)
    partial_out, stats = run_decode(emu, b, min_split, window, merge=False)
    split = [i for i, n in enumerate(sequence_splits(emu, b, 64, min_split, window)) if n > 1]
    assert split and torch.isnan(b.out[split]).all()  # split sequences are left to the merge
    emu.emu_decode_split_merge(
        ctypes.c_int(0), ctypes.c_int(head), ptr(b.out), ptr(b.seq_lens_t), ptr(partial_out), ptr(stats[0]),
        ptr(stats[1]), ctypes.c_longlong(b.out.stride(0)), ctypes.c_int(len(seq_lens)),
        ctypes.c_int(b.num_heads), ctypes.c_int(partial_out.shape[2]), ctypes.c_int(min_split),
        ctypes.c_int(window), ctypes.c_uint(7),
    )  # fmt: skip
    assert b.rel_err(window or None) < REL_TOL[torch.float16]


def test_decode_split_merge_kernel_many_splits(emu: ctypes.CDLL) -> None:
    """Random partials of 1 to 300 splits (more than one batch of loads per thread): the merge kernel
    equals the log-sum-exp merge written out in torch."""
    gen = torch.Generator().manual_seed(5)
    seq_lens, min_split, heads, head = [300 * 64, 16, 129 * 64, 1], 64, 2, 64
    splits = 300
    partial_out = torch.randn(4, heads, splits, head, generator=gen)
    maxima = torch.randn(4, heads, splits, generator=gen) * 4
    sums = torch.rand(4, heads, splits, generator=gen) * 10 + 0.1
    out = torch.full((4, heads, head), float("nan"), dtype=torch.float16)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32)
    emu.emu_decode_split_merge(
        ctypes.c_int(0), ctypes.c_int(head), ptr(out), ptr(seq_lens_t),
        ptr(partial_out), ptr(maxima), ptr(sums), ctypes.c_longlong(out.stride(0)), ctypes.c_int(4),
        ctypes.c_int(heads), ctypes.c_int(splits), ctypes.c_int(min_split), ctypes.c_int(0), ctypes.c_uint(3),
    )  # fmt: skip
    for i, s_len in enumerate(seq_lens):
        n = decode_split(emu, s_len, splits, min_split)[0]
        if n == 1:
            assert torch.isnan(out[i]).all()  # one split: the attention kernel writes it, not the merge
            continue
        w = sums[i, :, :n] * torch.exp2(maxima[i, :, :n] - maxima[i, :, :n].max(-1, keepdim=True).values)
        expected = (w[..., None] * partial_out[i, :, :n]).sum(1) / w.sum(-1, keepdim=True)
        torch.testing.assert_close(out[i].float(), expected, rtol=2e-3, atol=2e-3)


def run_decode_prologue(
    emu: ctypes.CDLL,
    b: Paged,
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    norm_weights: tuple[torch.Tensor, torch.Tensor] | None,
    slots: torch.Tensor,
    min_split: int,
    tickets: torch.Tensor | None,
    window: int = 0,
    seed: int = 1,
) -> None:
    """One decode launch with the attention prologue folded in (into b.out, K/V into b.kv), then the split
    merge where the kernel does not merge through tickets."""
    splits = decode_split(emu, b.decode_span(window), 64, min_split)[0]
    partial_out, stats = b.split_partials(splits)
    q_weight, k_weight = norm_weights if norm_weights is not None else (None, None)
    emu.emu_decode_prologue(
        ctypes.c_int(b.bf16), ctypes.c_int(b.head), ptr(b.out), ptr(qkv), ptr(b.kv[0]), ptr(b.kv[1]),
        ptr(b.tables), ptr(b.seq_lens_t), ptr(partial_out), ptr(stats[0]), ptr(stats[1]), ptr(tickets),
        ptr(positions), ptr(cos_sin), ptr(q_weight), ptr(k_weight), ptr(slots),
        ctypes.c_longlong(cos_sin.shape[0]), ctypes.c_longlong(b.kv.shape[1] * 16), ctypes.c_float(1e-6),
        ctypes.c_longlong(qkv.stride(0)), ctypes.c_longlong(b.out.stride(0)), ctypes.c_int(len(b.seq_lens)),
        ctypes.c_int(b.num_heads), ctypes.c_int(b.num_kv_heads), ctypes.c_int(b.tables.shape[1]),
        ctypes.c_int(splits), ctypes.c_int(min_split), ctypes.c_int(window), ctypes.c_float(b.scale * LOG2E),
        ctypes.c_int(seed % 2), ctypes.c_uint(seed),
    )  # fmt: skip


@pytest.mark.parametrize("use_tickets", [True, False])
@pytest.mark.parametrize(
    "head,group,dtype,norm,window",
    [
        (128, 2, torch.float16, True, 0),  # Qwen3: q/k norm
        (128, 4, torch.float16, False, 0),  # Llama: rotary only
        (64, 8, torch.bfloat16, True, 0),
        (256, 1, torch.float16, True, 0),
        (128, 2, torch.float16, True, 40),
    ],
)
def test_decode_with_the_prologue_folded_in(
    emu: ctypes.CDLL, head: int, group: int, dtype: torch.dtype, norm: bool, window: int, use_tickets: bool
) -> None:
    """The decode kernel running the layer's prologue itself equals `qk_norm_rope_kv_write_ref` then
    attention over the cache it leaves: the newest token's slot starts as NaN, so attention reads it only
    after the kernel wrote it; a padding row (slot -1) writes nothing; qkv is left as it was."""
    seq_lens = [300, 17, 1, 160, 64]
    num_kv_heads = 2
    b = Paged([1] * len(seq_lens), seq_lens, num_kv_heads, group, head, dtype, seed=head + group, poison=True)
    gen = torch.Generator().manual_seed(head * group)
    num_heads = b.num_heads
    qkv = (torch.randn(len(seq_lens), (num_heads + 2 * num_kv_heads) * head, generator=gen) * 2).to(dtype)
    positions = torch.tensor([s - 1 for s in seq_lens], dtype=torch.int64)
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, head, 2).float() / head))
    cos_sin = ops.cos_sin_cache(inv_freq, 1024, "cpu")
    norm_weights = (
        tuple((1 + 0.2 * torch.randn(head, generator=gen)).to(dtype) for _ in range(2)) if norm else None
    )
    slots = torch.tensor(
        [int(b.tables[i, (s - 1) // 16]) * 16 + (s - 1) % 16 for i, s in enumerate(seq_lens)],
        dtype=torch.int64,
    )
    slots[2] = -1  # a padding row: nothing written, it attends to what its slot holds
    flat = b.kv.view(2, -1, num_kv_heads, head)
    flat[:, slots[slots >= 0]] = float("nan")  # the kernel must write the newest K/V before reading it
    flat[:, int(b.tables[2, 0]) * 16] = torch.randn(2, num_kv_heads, head, generator=gen).to(dtype)
    ref_kv, ref_qkv, qkv_before = b.kv.clone(), qkv.clone(), qkv.clone()
    q_weight, k_weight = norm_weights if norm_weights is not None else (None, None)
    ops.qk_norm_rope_kv_write_ref(
        ref_qkv, positions, cos_sin, q_weight, k_weight, 1e-6, num_heads, ref_kv, slots
    )
    tickets = torch.zeros(len(seq_lens) * num_kv_heads, dtype=torch.int32) if use_tickets else None
    run_decode_prologue(emu, b, qkv, positions, cos_sin, norm_weights, slots, 64, tickets, window, seed=head)
    assert torch.equal(qkv, qkv_before)
    written = slots[slots >= 0]
    tol = 1e-2 if dtype == torch.float16 else 5e-2
    got, want = b.kv.view(2, -1, num_kv_heads, head), ref_kv.view(2, -1, num_kv_heads, head)
    torch.testing.assert_close(got[:, written].float(), want[:, written].float(), atol=tol, rtol=tol)
    b.query = ref_qkv[:, : num_heads * head].view(len(seq_lens), num_heads, head)
    assert b.rel_err(window or None) < REL_TOL[dtype]
    if tickets is not None:
        assert (tickets == 0).all()


# ---------------------------------------------------------------- prefill


WMMA_ORDERS = {"scrambled": 0, "paired": 1}  # emu/include/mma.h


def run_prefill(
    emu: ctypes.CDLL, b: Paged, variant: str, window: int = 0, order: str = "scrambled", seed: int = 1
) -> None:
    """One prefill launch of `variant` ("mma_sm80" or "wmma") after the row-tile map, as the torch glue
    runs them; `order` is the emulated WMMA fragment order (mma_sm80 uses no WMMA)."""
    number = {"mma_sm80": 1, "wmma": 0}[variant]
    block_m = emu.emu_prefill_block_m(ctypes.c_int(number), ctypes.c_int(b.head))
    assert block_m == ops.attention.PREFILL_BLOCK_M[variant][b.head]
    starts = [0]
    for q in b.query_lens:
        starts.append(starts[-1] + q)
    qsl = torch.tensor(starts, dtype=torch.int32)
    cu_tiles = torch.full((len(b.seq_lens) + 1,), -1, dtype=torch.int32)
    k, v = b.kv[0].contiguous(), b.kv[1].contiguous()
    emu.emu_prefill(
        ctypes.c_int(number), ctypes.c_int(b.bf16), ctypes.c_int(b.head), ptr(b.out), ptr(b.query), ptr(k),
        ptr(v), ptr(b.tables), ptr(b.seq_lens_t), ptr(qsl), ptr(cu_tiles),
        ctypes.c_longlong(b.query.stride(0)), ctypes.c_longlong(b.out.stride(0)),
        ctypes.c_int(len(b.seq_lens)), ctypes.c_int(b.num_heads),
        ctypes.c_int(b.num_kv_heads), ctypes.c_int(b.tables.shape[1]), ctypes.c_int(window),
        ctypes.c_float(b.scale * LOG2E),
        ctypes.c_int(ops.attention.prefill_row_tiles(b.query_lens, block_m)),
        ctypes.c_int(WMMA_ORDERS[order]), ctypes.c_uint(seed),
    )  # fmt: skip
    tiles = [-(-q // block_m) for q in b.query_lens]
    assert cu_tiles.tolist() == [sum(tiles[:i]) for i in range(len(tiles) + 1)]  # the tile map's prefix sum


@pytest.mark.parametrize(
    "query_lens,seq_lens,head,group,dtype",
    [
        ([1], [1], 128, 1, torch.float16),
        ([17], [17], 128, 2, torch.float16),
        ([130], [130], 128, 1, torch.float16),  # two row tiles, the second one partial
        ([100, 1, 33], [300, 50, 33], 64, 2, torch.float16),  # prefix hit, decode row, fresh prefill
        ([70, 1, 33], [200, 50, 33], 256, 1, torch.bfloat16),
        ([40, 9], [40, 200], 128, 4, torch.bfloat16),
    ],
)
def test_prefill_mma_sm80(
    emu: ctypes.CDLL, query_lens: list[int], seq_lens: list[int], head: int, group: int, dtype: torch.dtype
) -> None:
    b = Paged(query_lens, seq_lens, 1, group, head, dtype, seed=sum(seq_lens), poison=True)
    run_prefill(emu, b, "mma_sm80")
    assert b.rel_err() < REL_TOL[dtype]


@pytest.mark.parametrize("window", [1, 37, 128])
def test_prefill_mma_sm80_sliding_window(emu: ctypes.CDLL, window: int) -> None:
    b = Paged([150, 1, 33], [300, 50, 33], 1, 2, 128, torch.float16, seed=window)
    run_prefill(emu, b, "mma_sm80", window=window, seed=window)
    assert b.rel_err(window) < REL_TOL[torch.float16]


# ---------------------------------------------------------------- WMMA emulation and the WMMA prefill kernel


def _sm80_accumulator_codes() -> list[int]:
    """row * 16 + col of each (lane, element) of a 16x16 fp32 WMMA accumulator on SM80 / SM90."""
    codes = []
    for lane in range(32):
        g, q = lane // 4, lane % 4
        for i in range(8):
            codes.append((g + 8 * ((i // 2) % 2)) * 16 + 2 * q + i % 2 + 8 * (i // 4))
    return codes


@pytest.mark.parametrize("order", WMMA_ORDERS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("b_col_major", [True, False])
def test_emulated_wmma_multiplies_in_an_order_no_gpu_uses(
    emu: ctypes.CDLL, order: str, dtype: torch.dtype, b_col_major: bool
) -> None:
    gen = torch.Generator().manual_seed(7)
    a = torch.randn(16, 16, generator=gen).to(dtype)
    b = torch.randn(16, 16, generator=gen).to(dtype)
    c = torch.randn(16, 16, generator=gen)
    d = torch.full((16, 16), float("nan"))
    codes = torch.full((32 * 8,), -1, dtype=torch.int32)
    b_mem = b.t().contiguous() if b_col_major else b
    emu.emu_wmma_gemm(
        ctypes.c_int(int(dtype == torch.bfloat16)), ctypes.c_int(int(b_col_major)), ptr(a), ptr(b_mem),
        ptr(c), ptr(d), ptr(codes), ctypes.c_int(WMMA_ORDERS[order]),
    )  # fmt: skip
    torch.testing.assert_close(d, a.float() @ b.float() + c, rtol=1e-5, atol=1e-5)
    # The order the WMMA prefill kernel discovers: every element exactly once, never the SM80 order.
    assert sorted(codes.tolist()) == list(range(256))
    assert codes.tolist() != _sm80_accumulator_codes()
    pairs = codes.view(-1, 2)
    adjacent = bool(((pairs[:, 0] % 2 == 0) & (pairs[:, 1] == pairs[:, 0] + 1)).all())
    assert adjacent == (order == "paired")
    rows_per_lane = {len({int(x) // 16 for x in codes[8 * lane : 8 * lane + 8]}) for lane in range(32)}
    assert max(rows_per_lane) > 2  # rows spread over lanes as on no GPU (SM80: two rows per lane)


@pytest.mark.parametrize("order", WMMA_ORDERS)
@pytest.mark.parametrize(
    "query_lens,seq_lens,head,group,dtype",
    [
        ([1], [1], 128, 1, torch.float16),
        ([17], [17], 128, 4, torch.float16),
        ([130], [130], 128, 1, torch.float16),  # two row tiles of 128, the second one partial
        ([100, 1, 33], [300, 50, 33], 64, 8, torch.float16),  # prefix hit, decode row, fresh prefill
        ([70, 1, 33], [200, 50, 33], 256, 1, torch.bfloat16),  # head 256: Q from shared memory
        ([40, 9], [40, 200], 128, 4, torch.bfloat16),  # a 9-token chunk after 191 cached tokens
        ([20, 1], [90, 33], 256, 4, torch.float16),
    ],
)
def test_prefill_wmma(
    emu: ctypes.CDLL,
    query_lens: list[int],
    seq_lens: list[int],
    head: int,
    group: int,
    dtype: torch.dtype,
    order: str,
) -> None:
    b = Paged(query_lens, seq_lens, 1, group, head, dtype, seed=sum(seq_lens), poison=True)
    run_prefill(emu, b, "wmma", order=order, seed=len(query_lens) + head)
    assert b.rel_err() < REL_TOL[dtype]


@pytest.mark.parametrize("order", WMMA_ORDERS)
@pytest.mark.parametrize("window", [1, 37, 128])
def test_prefill_wmma_sliding_window(emu: ctypes.CDLL, window: int, order: str) -> None:
    b = Paged([150, 1, 33], [300, 50, 33], 1, 2, 128, torch.float16, seed=window, poison=True)
    run_prefill(emu, b, "wmma", window=window, order=order, seed=window)
    assert b.rel_err(window) < REL_TOL[torch.float16]


def test_prefill_wmma_two_kv_heads_many_short_sequences(emu: ctypes.CDLL) -> None:
    """Sequences shorter than a key tile, a window that starts mid-tile, GQA 4 over two KV heads."""
    query_lens, seq_lens = [5, 16, 3, 64, 1], [5, 80, 19, 64, 200]
    b = Paged(query_lens, seq_lens, 2, 4, 64, torch.float16, seed=11, poison=True)
    run_prefill(emu, b, "wmma", window=40, order="paired", seed=3)
    assert b.rel_err(40) < REL_TOL[torch.float16]


@pytest.mark.parametrize("variant", ops.attention.PREFILL_VARIANTS)
def test_prefill_tile_map_over_more_sequences_than_a_warp(emu: ctypes.CDLL, variant: str) -> None:
    """40 sequences: the one-warp tile map carries its prefix sum from one 32-sequence pass to the next."""
    query_lens = [1 + (7 * i) % 20 for i in range(40)]
    seq_lens = [q + (5 * i) % 30 for i, q in enumerate(query_lens)]
    b = Paged(query_lens, seq_lens, 1, 2, 64, torch.float16, seed=40, poison=True)
    run_prefill(emu, b, variant, seed=5)
    assert b.rel_err() < REL_TOL[torch.float16]
