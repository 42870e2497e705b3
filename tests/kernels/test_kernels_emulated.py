"""The v8 attention kernels' and the v9 prefill kernel's exact CUDA source, run on the CPU through the
emulator in tests/kernels/emu.

`emu/harness.cpp` compiles the kernel headers with g++ against `emu/cuda_emu.h`, which runs every
thread of a block as a fiber and implements mma.sync m16n8k16, ldmatrix, cp.async, shuffles and
barriers as the PTX ISA documents them, and WMMA m16n16k16 (`emu/include/mma.h`) with fragment
element orders that are deliberately no GPU's. Blocks and threads run in seeded random orders, cp.async
copies land only when waited for, and shared memory starts as garbage, so ordering mistakes show up as
wrong results. Outputs start as NaN; each case compares against `paged_attention_ref`.

This is what proves the v8 / v9 index arithmetic (and that v9 assumes no WMMA layout) without a GPU;
the GPU tests (test_kernels_cuda.py) prove the same kernels on hardware.
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
        """NaN-filled split partials as the decode kernels leave them: outputs [seqs, heads, splits, head]
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
    warps: int,
    partition: int | None = None,
    window: int = 0,
    fused: bool = True,
    seed: int = 1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One v8 decode launch; returns the tickets and the split partials (out, stats)."""
    span = b.decode_span(window)
    partition = partition or -(-span // 16) * 16
    splits = -(-span // partition)
    num_seqs = len(b.seq_lens)
    partial_out, stats = b.split_partials(splits)
    tickets = torch.zeros(num_seqs * b.num_kv_heads, dtype=torch.int32)
    k, v = b.kv[0].contiguous(), b.kv[1].contiguous()
    emu.emu_decode_v8(
        ctypes.c_int(b.bf16), ctypes.c_int(b.head), ptr(b.out), ptr(b.query), ptr(k), ptr(v),
        ptr(b.tables), ptr(b.seq_lens_t), ptr(partial_out), ptr(stats[0]), ptr(stats[1]),
        ptr(tickets), ctypes.c_longlong(b.query.stride(0)), ctypes.c_longlong(b.out.stride(0)),
        ctypes.c_int(num_seqs), ctypes.c_int(b.num_heads), ctypes.c_int(b.num_kv_heads),
        ctypes.c_int(b.tables.shape[1]), ctypes.c_int(splits), ctypes.c_int(partition), ctypes.c_int(window),
        ctypes.c_float(b.scale * LOG2E), ctypes.c_int(int(fused)), ctypes.c_int(warps), ctypes.c_uint(seed),
    )  # fmt: skip
    return tickets, partial_out, stats


def run_decode_v6(emu: ctypes.CDLL, b: Paged, partition: int, window: int = 0, wmma_order: int = 0) -> None:
    """One v6 decode launch and, where the context is split, the split merge (into b.out)."""
    splits = -(-b.decode_span(window) // partition)
    num_seqs = len(b.seq_lens)
    partial_out, stats = b.split_partials(splits)
    k, v = b.kv[0].contiguous(), b.kv[1].contiguous()
    emu.emu_decode_v6(
        ctypes.c_int(b.bf16), ctypes.c_int(b.head), ptr(b.out), ptr(b.query), ptr(k), ptr(v), ptr(b.tables),
        ptr(b.seq_lens_t), ptr(partial_out), ptr(stats[0]), ptr(stats[1]),
        ctypes.c_longlong(b.query.stride(0)), ctypes.c_longlong(b.out.stride(0)), ctypes.c_int(num_seqs),
        ctypes.c_int(b.num_heads), ctypes.c_int(b.num_kv_heads), ctypes.c_int(b.tables.shape[1]),
        ctypes.c_int(splits), ctypes.c_int(partition), ctypes.c_int(window), ctypes.c_float(b.scale * LOG2E),
        ctypes.c_int(wmma_order), ctypes.c_uint(len(b.seq_lens) + partition),
    )  # fmt: skip


@pytest.mark.parametrize(
    "head,group,partition,window,wmma_order",
    [
        (128, 8, 64, 0, 0),  # split: partials and the merge; warps with 1 or no blocks
        (128, 8, 4096, 0, 1),  # one split per sequence: the kernel writes the output itself
        (64, 4, 128, 0, 0),
        (256, 1, 32, 0, 0),  # no register prefetch at head 256
        (128, 16, 64, 37, 0),  # 16 query heads per kv head, and a window
    ],
)
def test_decode_v6(
    emu: ctypes.CDLL, head: int, group: int, partition: int, window: int, wmma_order: int
) -> None:
    """The v6 kernel (the default decode kernel) and its split merge, on WMMA element orders no GPU has."""
    seq_lens = [300, 17, 160, 1, 64, 65]
    b = Paged([1] * len(seq_lens), seq_lens, 2, group, head, torch.float16, seed=head + group, poison=True)
    run_decode_v6(emu, b, partition, window, wmma_order)
    assert b.rel_err(window or None) < REL_TOL[torch.float16]


@pytest.mark.parametrize(
    "head,group,dtype,warps",
    [
        (128, 8, torch.float16, 4),
        (128, 8, torch.float16, 16),
        (128, 4, torch.bfloat16, 8),
        (64, 4, torch.float16, 4),
        (256, 1, torch.float16, 8),
        (64, 12, torch.float16, 4),  # two 8-head column tiles
        (128, 16, torch.bfloat16, 8),
    ],
)
def test_decode_v8_unsplit(emu: ctypes.CDLL, head: int, group: int, dtype: torch.dtype, warps: int) -> None:
    seq_lens = [1, 15, 16, 17, 100, 333]
    b = Paged([1] * len(seq_lens), seq_lens, 2, group, head, dtype, seed=head + group)
    run_decode(emu, b, warps)
    assert b.rel_err() < REL_TOL[dtype]


@pytest.mark.parametrize(
    "seed,head,group,warps",
    [
        (1, 128, 8, 4),  # fewer threads than output quads: one thread per quad
        (2, 128, 8, 16),  # 1 x 32k's shape: two threads share each quad's splits
        (3, 64, 3, 16),  # ten threads per quad, two threads left over
    ],
)
def test_decode_v8_split_merge_in_kernel(
    emu: ctypes.CDLL, seed: int, head: int, group: int, warps: int
) -> None:
    """Splits of different sequences finish in a different order for each seed; the last one merges."""
    seq_lens = [700, 17, 160, 1, 64, 65]
    b = Paged([1] * len(seq_lens), seq_lens, 2, group, head, torch.float16, seed=seed, poison=True)
    tickets, _, _ = run_decode(emu, b, warps=warps, partition=64, seed=seed)
    assert b.rel_err() < REL_TOL[torch.float16]
    assert torch.equal(tickets, torch.zeros_like(tickets))  # reset for the next call / graph replay


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
    """The v8 kernel with its merge off leaves v6-layout partials; the split merge kernel
    (paged_decode_reduce_kernel, which v6 and v8-reduce launch) turns them into the attention."""
    b = Paged([1] * len(seq_lens), seq_lens, 2, 8, head, torch.float16, seed=len(seq_lens) + partition)
    tickets, partial_out, stats = run_decode(emu, b, warps=4, partition=partition, window=window, fused=False)
    assert torch.equal(tickets, torch.zeros_like(tickets))
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


@pytest.mark.parametrize("window", [1, 37, 100])
def test_decode_v8_sliding_window(emu: ctypes.CDLL, window: int) -> None:
    seq_lens = [1, 50, 300, 301, 90]
    b = Paged([1] * 5, seq_lens, 1, 8, 128, torch.float16, seed=window)
    tickets, _, _ = run_decode(emu, b, warps=8, partition=32, window=window)
    assert b.rel_err(window) < REL_TOL[torch.float16]
    assert not tickets.any()


def test_decode_v8_plan(emu: ctypes.CDLL) -> None:
    def plan(span: int, base: int, sms: int, resident: tuple[int, int, int], max_warps: int = 16):
        out = (ctypes.c_longlong * 3)()
        sizes = (ctypes.c_longlong(span), ctypes.c_longlong(base), ctypes.c_longlong(sms))
        emu.emu_plan_decode_v8(*sizes, *resident, max_warps, out)
        return tuple(out)

    # H200, head 128, group 8: 16-warp blocks fit once per SM, 8-warp twice, 4-warp four times.
    resident = (4, 2, 1)
    assert plan(32768, 4, 132, resident) == (16, 33, 1008)  # 1 x 32k: one wave of 16-warp blocks
    assert plan(8192, 64, 132, resident) == (16, 2, 4096)  # 16 x 8k
    assert plan(4096, 256, 132, resident) == (8, 1, 4096)  # 64 x 4k: one wave of 8-warp blocks
    assert plan(1024, 1024, 132, resident) == (4, 1, 1024)  # 256 x 1k: many waves, smallest blocks
    assert plan(1, 4, 132, resident) == (16, 1, 16)  # a one-token context is never split
    assert plan(32768, 4, 132, resident, max_warps=8) == (8, 64, 512)  # launch bounds cap the block
    assert plan(32768, 4, 132, (4, 2, 0)) == (8, 64, 512)  # 16 warps do not fit at all


# ---------------------------------------------------------------- prefill


WMMA_ORDERS = {"scrambled": 0, "paired": 1}  # emu/include/mma.h


def run_prefill(
    emu: ctypes.CDLL, b: Paged, variant: str, window: int = 0, order: str = "scrambled", seed: int = 1
) -> None:
    """One prefill launch of `variant` ("v8" or "v9") after the row-tile map, as the torch glue runs them;
    `order` is the emulated WMMA fragment order (v8 uses no WMMA)."""
    number = int(variant.removeprefix("v"))
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
def test_prefill_v8(
    emu: ctypes.CDLL, query_lens: list[int], seq_lens: list[int], head: int, group: int, dtype: torch.dtype
) -> None:
    b = Paged(query_lens, seq_lens, 1, group, head, dtype, seed=sum(seq_lens), poison=True)
    run_prefill(emu, b, "v8")
    assert b.rel_err() < REL_TOL[dtype]


@pytest.mark.parametrize("window", [1, 37, 128])
def test_prefill_v8_sliding_window(emu: ctypes.CDLL, window: int) -> None:
    b = Paged([150, 1, 33], [300, 50, 33], 1, 2, 128, torch.float16, seed=window)
    run_prefill(emu, b, "v8", window=window, seed=window)
    assert b.rel_err(window) < REL_TOL[torch.float16]


# ---------------------------------------------------------------- WMMA emulation and the v9 prefill kernel


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
    # The order the v9 kernel discovers: every element exactly once, never the SM80 order.
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
def test_prefill_v9(
    emu: ctypes.CDLL,
    query_lens: list[int],
    seq_lens: list[int],
    head: int,
    group: int,
    dtype: torch.dtype,
    order: str,
) -> None:
    b = Paged(query_lens, seq_lens, 1, group, head, dtype, seed=sum(seq_lens), poison=True)
    run_prefill(emu, b, "v9", order=order, seed=len(query_lens) + head)
    assert b.rel_err() < REL_TOL[dtype]


@pytest.mark.parametrize("order", WMMA_ORDERS)
@pytest.mark.parametrize("window", [1, 37, 128])
def test_prefill_v9_sliding_window(emu: ctypes.CDLL, window: int, order: str) -> None:
    b = Paged([150, 1, 33], [300, 50, 33], 1, 2, 128, torch.float16, seed=window, poison=True)
    run_prefill(emu, b, "v9", window=window, order=order, seed=window)
    assert b.rel_err(window) < REL_TOL[torch.float16]


def test_prefill_v9_two_kv_heads_many_short_sequences(emu: ctypes.CDLL) -> None:
    """Sequences shorter than a key tile, a window that starts mid-tile, GQA 4 over two KV heads."""
    query_lens, seq_lens = [5, 16, 3, 64, 1], [5, 80, 19, 64, 200]
    b = Paged(query_lens, seq_lens, 2, 4, 64, torch.float16, seed=11, poison=True)
    run_prefill(emu, b, "v9", window=40, order="paired", seed=3)
    assert b.rel_err(40) < REL_TOL[torch.float16]


@pytest.mark.parametrize("variant", ["v8", "v9"])
def test_prefill_tile_map_over_more_sequences_than_a_warp(emu: ctypes.CDLL, variant: str) -> None:
    """40 sequences: the one-warp tile map carries its prefix sum from one 32-sequence pass to the next."""
    query_lens = [1 + (7 * i) % 20 for i in range(40)]
    seq_lens = [q + (5 * i) % 30 for i, q in enumerate(query_lens)]
    b = Paged(query_lens, seq_lens, 1, 2, 64, torch.float16, seed=40, poison=True)
    run_prefill(emu, b, variant, seed=5)
    assert b.rel_err() < REL_TOL[torch.float16]
