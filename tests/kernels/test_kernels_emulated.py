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


def run_decode(
    emu: ctypes.CDLL,
    b: Paged,
    partition: int,
    window: int = 0,
    wmma_order: int = 0,
    merge: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode launch and, with `merge` where the context is split, the split merge (into b.out);
    returns the split partials (out, stats)."""
    splits = -(-b.decode_span(window) // partition)
    num_seqs = len(b.seq_lens)
    partial_out, stats = b.split_partials(splits)
    k, v = b.kv[0].contiguous(), b.kv[1].contiguous()
    emu.emu_decode(
        ctypes.c_int(b.bf16), ctypes.c_int(b.head), ptr(b.out), ptr(b.query), ptr(k), ptr(v), ptr(b.tables),
        ptr(b.seq_lens_t), ptr(partial_out), ptr(stats[0]), ptr(stats[1]),
        ctypes.c_longlong(b.query.stride(0)), ctypes.c_longlong(b.out.stride(0)), ctypes.c_int(num_seqs),
        ctypes.c_int(b.num_heads), ctypes.c_int(b.num_kv_heads), ctypes.c_int(b.tables.shape[1]),
        ctypes.c_int(splits), ctypes.c_int(partition), ctypes.c_int(window), ctypes.c_float(b.scale * LOG2E),
        ctypes.c_int(int(merge)), ctypes.c_int(wmma_order), ctypes.c_uint(len(b.seq_lens) + partition),
    )  # fmt: skip
    return partial_out, stats


@pytest.mark.parametrize(
    "head,group,dtype,partition,window,wmma_order",
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
    emu: ctypes.CDLL, head: int, group: int, dtype: torch.dtype, partition: int, window: int, wmma_order: int
) -> None:
    """The decode kernel and its split merge, on WMMA element orders no GPU has."""
    seq_lens = [300, 17, 160, 1, 64, 65]
    b = Paged([1] * len(seq_lens), seq_lens, 2, group, head, dtype, seed=head + group, poison=True)
    run_decode(emu, b, partition, window, wmma_order)
    assert b.rel_err(window or None) < REL_TOL[dtype]


@pytest.mark.parametrize("window", [1, 100])
def test_decode_sliding_window(emu: ctypes.CDLL, window: int) -> None:
    seq_lens = [1, 50, 300, 301, 90]
    b = Paged([1] * 5, seq_lens, 1, 8, 128, torch.float16, seed=window, poison=True)
    run_decode(emu, b, partition=32, window=window)
    assert b.rel_err(window) < REL_TOL[torch.float16]


@pytest.mark.parametrize(
    "seq_lens,partition,head,window",
    [
        ([500, 17, 129], 128, 64, 0),  # one group per split, one batch
        ([3000, 40, 1000], 32, 64, 700),  # a window: splits cover only its last blocks
    ],
)
def test_decode_split_merge_kernel(
    emu: ctypes.CDLL, seq_lens: list[int], partition: int, head: int, window: int
) -> None:
    """The decode kernel leaves split sequences to the merge, as partials; the split merge kernel
    (paged_decode_reduce_kernel) turns them into the attention."""
    b = Paged([1] * len(seq_lens), seq_lens, 2, 8, head, torch.float16, seed=len(seq_lens) + partition)
    partial_out, stats = run_decode(emu, b, partition, window, merge=False)
    first_block_pos = [max(0, s - window) // 16 * 16 if window else 0 for s in seq_lens]
    split = [i for i, (s, f) in enumerate(zip(seq_lens, first_block_pos, strict=True)) if s - f > partition]
    assert split and torch.isnan(b.out[split]).all()  # split sequences are left to the merge
    emu.emu_decode_split_merge(
        ctypes.c_int(0), ctypes.c_int(head), ptr(b.out), ptr(b.seq_lens_t), ptr(partial_out), ptr(stats[0]),
        ptr(stats[1]), ctypes.c_longlong(b.out.stride(0)), ctypes.c_int(len(seq_lens)),
        ctypes.c_int(b.num_heads), ctypes.c_int(partial_out.shape[2]), ctypes.c_int(partition),
        ctypes.c_int(window), ctypes.c_uint(7),
    )  # fmt: skip
    assert b.rel_err(window or None) < REL_TOL[torch.float16]


def test_decode_split_merge_kernel_many_splits(emu: ctypes.CDLL) -> None:
    """Random partials of 1 to 300 splits (more than one batch of loads per thread): the merge kernel
    equals the log-sum-exp merge written out in torch."""
    gen = torch.Generator().manual_seed(5)
    seq_lens, partition, heads, head = [300 * 16, 16, 129 * 16, 1], 16, 2, 64
    splits = 300
    partial_out = torch.randn(4, heads, splits, head, generator=gen)
    maxima = torch.randn(4, heads, splits, generator=gen) * 4
    sums = torch.rand(4, heads, splits, generator=gen) * 10 + 0.1
    out = torch.full((4, heads, head), float("nan"), dtype=torch.float16)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32)
    emu.emu_decode_split_merge(
        ctypes.c_int(0), ctypes.c_int(head), ptr(out), ptr(seq_lens_t),
        ptr(partial_out), ptr(maxima), ptr(sums), ctypes.c_longlong(out.stride(0)), ctypes.c_int(4),
        ctypes.c_int(heads), ctypes.c_int(splits), ctypes.c_int(partition), ctypes.c_int(0), ctypes.c_uint(3),
    )  # fmt: skip
    for i, s_len in enumerate(seq_lens):
        n = -(-s_len // partition)
        if n == 1:
            assert torch.isnan(out[i]).all()  # one split: the attention kernel writes it, not the merge
            continue
        w = sums[i, :, :n] * torch.exp2(maxima[i, :, :n] - maxima[i, :, :n].max(-1, keepdim=True).values)
        expected = (w[..., None] * partial_out[i, :, :n]).sum(1) / w.sum(-1, keepdim=True)
        torch.testing.assert_close(out[i].float(), expected, rtol=2e-3, atol=2e-3)


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
