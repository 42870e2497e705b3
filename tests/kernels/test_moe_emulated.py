"""The mixture-of-experts kernels (csrc/moe/) on the CPU emulator (tests/kernels/emu): the fused top-k
softmax against its definition (`topk_softmax_ref`), the align kernel's tiles against the invariants
the expert stages rely on, and the whole expert pipeline (align, gated stage, down stage, combine) by
both kernels, the decode GEMV and the tensor-core grouped GEMM, and the pair-by-pair path, against the
torch form of the experts.
Fresh random inputs every run; the shapes leave partial tiles in every dimension."""

from __future__ import annotations

import ctypes

import pytest
import torch
from emulator import build_emulator, fresh_generator, needs_gxx, ptr

from voltllm.layers.fused_moe import experts_grouped
from voltllm.ops.moe import moe_max_tiles, topk_softmax_ref

pytestmark = needs_gxx


@pytest.fixture(scope="module")
def emu(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    return build_emulator(tmp_path_factory.mktemp("emu"), "moe_harness.cpp")


def _distinct_logits(num_tokens: int, num_experts: int, gen: torch.Generator) -> torch.Tensor:
    """Logits that fp16 and bf16 hold exactly and distinct (up to 512 experts): a fresh permutation of
    multiples of 1/64 in [-4, 4) per row, so that the ranking has no ties."""
    rows = [torch.randperm(num_experts, generator=gen) for _ in range(num_tokens)]
    return torch.stack(rows).float() / 64 - num_experts / 128


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_experts,top_k", [(8, 2), (60, 4), (128, 8), (7, 1), (40, 32)])
@pytest.mark.parametrize("renormalize", [True, False])
def test_topk_softmax_matches_its_definition(emu, dtype, num_experts, top_k, renormalize):
    gen, seed = fresh_generator()
    num_tokens = 9  # 3 blocks of 4 warps, the last one partly idle
    logits = torch.zeros(num_tokens, num_experts + 8, dtype=dtype)[:, :num_experts]  # strided rows
    logits.copy_(_distinct_logits(num_tokens, num_experts, gen))
    weights = torch.full((num_tokens, top_k), float("nan"))
    ids = torch.full((num_tokens, top_k), -7, dtype=torch.int32)
    emu.emu_moe_topk_softmax(
        ctypes.c_int(int(dtype == torch.bfloat16)), ptr(weights), ptr(ids), ptr(logits),
        ctypes.c_longlong(logits.stride(0)), ctypes.c_int(num_tokens), ctypes.c_int(num_experts),
        ctypes.c_int(top_k), ctypes.c_int(int(renormalize)), ctypes.c_uint(seed),
    )  # fmt: skip
    ref_weights, ref_ids = topk_softmax_ref(logits, top_k, renormalize)
    assert torch.equal(ids.long(), ref_ids), f"seed {seed}"
    torch.testing.assert_close(weights, ref_weights, atol=1e-6, rtol=1e-5)


def _align(emu, topk_ids: torch.Tensor, num_experts: int, tile_rows: int, seed: int):
    ids = topk_ids.to(torch.int32).contiguous()
    max_tiles = moe_max_tiles(ids.numel(), num_experts, tile_rows)
    sorted_pair_ids = torch.full((max_tiles * tile_rows,), -9, dtype=torch.int32)  # -9: never written
    tile_experts = torch.full((max_tiles,), -9, dtype=torch.int32)
    num_tiles = torch.full((1,), -9, dtype=torch.int32)
    emu.emu_moe_align(
        ptr(ids), ptr(sorted_pair_ids), ptr(tile_experts), ptr(num_tiles), ctypes.c_int(ids.numel()),
        ctypes.c_int(num_experts), ctypes.c_int(tile_rows), ctypes.c_uint(seed),
    )  # fmt: skip
    return sorted_pair_ids, tile_experts, int(num_tiles[0]), max_tiles


def _routings(num_tokens: int, num_experts: int, top_k: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Random routings, one that leaves expert 0 without a token and one that sends every token to
    the same experts."""
    spread = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(num_tokens)])
    idle = torch.stack(
        [1 + torch.randperm(num_experts - 1, generator=gen)[:top_k] for _ in range(num_tokens)]
    )
    same = torch.arange(top_k).repeat(num_tokens, 1)
    return {"spread": spread, "idle expert 0": idle, "all to the same": same}


@pytest.mark.parametrize("tile_rows", [8, 64])
@pytest.mark.parametrize("num_tokens,num_experts,top_k", [(1, 8, 2), (37, 16, 4), (300, 128, 8)])
def test_align_tiles_every_pair_once_by_expert(emu, tile_rows, num_tokens, num_experts, top_k):
    gen, seed = fresh_generator()
    for name, topk_ids in _routings(num_tokens, num_experts, top_k, gen).items():
        sorted_pair_ids, tile_experts, num_tiles, max_tiles = _align(
            emu, topk_ids, num_experts, tile_rows, seed
        )
        counts = torch.bincount(topk_ids.flatten(), minlength=num_experts)
        assert num_tiles == int(((counts + tile_rows - 1) // tile_rows).sum()) <= max_tiles, name
        slots = sorted_pair_ids[: num_tiles * tile_rows].view(num_tiles, tile_rows)
        flat_ids = topk_ids.flatten()
        for tile in range(num_tiles):
            row = slots[tile]
            pairs = row[row >= 0]
            assert torch.all(row[: len(pairs)] >= 0), f"{name}: padding before pairs in tile {tile}"
            assert torch.all(flat_ids[pairs.long()] == tile_experts[tile]), f"{name}: tile {tile}"
        assert torch.equal(
            torch.sort(slots[slots >= 0]).values, torch.arange(flat_ids.numel(), dtype=torch.int32)
        )
        assert torch.all(tile_experts[:num_tiles].diff() >= 0), f"{name}: tiles not by expert"
        assert torch.all(sorted_pair_ids[num_tiles * tile_rows :] == -9), f"{name}: wrote past the used tiles"


def _run_experts(emu, x, w13, w2, topk_weights, topk_ids, grouped_gemm: bool, seed: int) -> torch.Tensor:
    """The kernel pipeline of `voltllm.ops.moe.fused_moe`, stage by stage on the emulator."""
    bf16 = ctypes.c_int(int(x.dtype == torch.bfloat16))
    num_tokens, hidden = x.shape
    num_experts, two_i, _ = w13.shape
    top_k = topk_ids.shape[1]
    tile_rows = emu.emu_moe_tile_rows(ctypes.c_int(int(grouped_gemm)))
    sorted_pair_ids, tile_experts, num_tiles, max_tiles = _align(emu, topk_ids, num_experts, tile_rows, seed)
    num_tiles_t = torch.tensor([num_tiles], dtype=torch.int32)
    weights = topk_weights.reshape(-1).float().contiguous()
    act = torch.full((max_tiles * tile_rows, two_i // 2), float("nan")).to(x.dtype)
    y = torch.full((topk_ids.numel(), hidden), float("nan"))
    for gated, out, a, w, n, k in ((1, act, x, w13, two_i // 2, hidden), (0, y, act, w2, hidden, two_i // 2)):
        emu.emu_moe_experts(
            bf16, ctypes.c_int(int(grouped_gemm)), ctypes.c_int(gated), ptr(out), ptr(a), ptr(w),
            ptr(sorted_pair_ids), ptr(tile_experts), ptr(num_tiles_t), ptr(weights),
            ctypes.c_longlong(a.stride(0)), ctypes.c_int(top_k), ctypes.c_int(n), ctypes.c_int(k),
            ctypes.c_int(max_tiles), ctypes.c_uint(seed),
        )  # fmt: skip
    out = torch.full((num_tokens, hidden), float("nan")).to(x.dtype)
    emu.emu_moe_combine(
        bf16, ptr(out), ptr(y), ctypes.c_longlong(out.stride(0)), ctypes.c_int(num_tokens),
        ctypes.c_int(top_k), ctypes.c_int(hidden), ctypes.c_uint(seed),
    )  # fmt: skip
    return out


@pytest.mark.parametrize("grouped_gemm", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_tokens,top_k", [(1, 2), (6, 1), (11, 3)])
def test_expert_pipeline_matches_the_torch_form(emu, grouped_gemm, dtype, num_tokens, top_k):
    # hidden 96 and intermediate 48: a partial 64-wide column block in both stages, and a k of 48 that
    # ends inside a 32-wide step of the grouped GEMM's down stage.
    gen, seed = fresh_generator()
    num_experts, hidden, inter = 6, 96, 48
    x = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden**0.5).to(dtype)
    w2 = (torch.randn(num_experts, hidden, inter, generator=gen) / inter**0.5).to(dtype)
    for name, topk_ids in _routings(num_tokens, num_experts, top_k, gen).items():
        topk_weights = torch.rand(num_tokens, top_k, generator=gen)
        got = _run_experts(emu, x, w13, w2, topk_weights, topk_ids, grouped_gemm, seed)
        expected = experts_grouped(x.float(), w13.float(), w2.float(), topk_weights, topk_ids)
        tol = 2e-2 if dtype == torch.float16 else 8e-2
        torch.testing.assert_close(
            got.float(), expected, atol=tol, rtol=tol, msg=lambda m, n=name: f"{n}: {m}"
        )


def _run_pair_experts_stage(emu, gated: bool, a, w, topk_weights, topk_ids, down_chunks: int, seed: int):
    """One pair stage on the emulator, as `fused_moe_pairs` launches it: gated, act [pairs, I] from x;
    down (by `down_chunks`' kernel), out [tokens, H], each token's top-k sum, from act."""
    num_tokens, top_k = topk_ids.shape
    n, k = (w.shape[1] // 2 if gated else w.shape[1]), w.shape[2]
    ids = topk_ids.to(torch.int32).contiguous()  # held: the call reads them through raw pointers
    weights = topk_weights.float().contiguous()
    dst = torch.full((num_tokens * top_k if gated else num_tokens, n), float("nan")).to(a.dtype)
    emu.emu_moe_pair_experts(
        ctypes.c_int(int(a.dtype == torch.bfloat16)), ctypes.c_int(int(gated)), ptr(dst), ptr(a), ptr(w),
        ptr(ids), ptr(weights), ctypes.c_longlong(a.stride(0)), ctypes.c_longlong(dst.stride(0)),
        ctypes.c_int(num_tokens), ctypes.c_int(top_k), ctypes.c_int(n), ctypes.c_int(k),
        ctypes.c_int(down_chunks), ctypes.c_uint(seed),
    )  # fmt: skip
    return dst


def _run_pair_experts(emu, x, w13, w2, topk_weights, topk_ids, seed: int) -> torch.Tensor:
    """The pair-by-pair decode path of `voltllm.ops.moe.fused_moe` on the emulator: two launches."""
    act = _run_pair_experts_stage(emu, True, x, w13, topk_weights, topk_ids, 0, seed)
    return _run_pair_experts_stage(emu, False, act, w2, topk_weights, topk_ids, 0, seed)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_tokens,top_k", [(1, 1), (1, 5), (2, 8), (3, 3)])
def test_pair_path_matches_the_torch_form(emu, dtype, num_tokens, top_k):
    # hidden 1048 = 4 * 256 + 24: the gated stage's row ends inside a 4-chunk step, the down stage's k of
    # 40 inside its first chunk; top-k of 5 leaves a partial round of the down stage's 4 pairs in flight.
    gen, seed = fresh_generator()
    num_experts, hidden, inter = 10, 1048, 40
    x = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden**0.5).to(dtype)
    w2 = (torch.randn(num_experts, hidden, inter, generator=gen) / inter**0.5).to(dtype)
    for name, topk_ids in _routings(num_tokens, num_experts, top_k, gen).items():
        topk_weights = torch.rand(num_tokens, top_k, generator=gen)
        got = _run_pair_experts(emu, x, w13, w2, topk_weights, topk_ids, seed)
        expected = experts_grouped(x.float(), w13.float(), w2.float(), topk_weights, topk_ids)
        tol = 2e-2 if dtype == torch.float16 else 8e-2
        torch.testing.assert_close(
            got.float(), expected, atol=tol, rtol=tol, msg=lambda m, n=name: f"{n}: {m}"
        )


# Both kernels in fp16, the staged one in bf16 too (the emulator is slow: CI runs these).
@pytest.mark.parametrize("down_chunks,dtype", [(0, torch.float16), (12, torch.float16), (12, torch.bfloat16)])
@pytest.mark.parametrize(
    "num_tokens,top_k,inter",
    [
        (1, 8, 776),  # 97 chunks a row, 776 a feature: 3 rounds of 12 chunks a lane, the last partial
        (3, 5, 264),  # rows of 33 chunks: a lane's 32-chunk step crosses rows mid-warp
        (2, 3, 40),  # rows of 5 chunks: one step crosses several rows
    ],
)
def test_pair_down_stage_matches_its_definition(emu, down_chunks, dtype, num_tokens, top_k, inter):
    """Both down-stage kernels: out[t] = sum_j weight_j * (act[t * top_k + j] @ w2[e_j].T) in fp32, rounded
    once. n = 20 output features leaves the staged kernel's last block with 4 warps past n."""
    gen, seed = fresh_generator()
    num_experts, hidden = 12, 20
    act = torch.randn(num_tokens * top_k, inter, generator=gen).to(dtype)
    w2 = (torch.randn(num_experts, hidden, inter, generator=gen) / inter**0.5).to(dtype)
    for name, topk_ids in _routings(num_tokens, num_experts, top_k, gen).items():
        topk_weights = torch.rand(num_tokens, top_k, generator=gen)
        got = _run_pair_experts_stage(emu, False, act, w2, topk_weights, topk_ids, down_chunks, seed)
        products = torch.einsum("pk,pnk->pn", act.float(), w2.float()[topk_ids.flatten()])
        expected = (products.view(num_tokens, top_k, hidden) * topk_weights[..., None]).sum(dim=1)
        tol = 2e-3 if dtype == torch.float16 else 1e-2  # the one rounding of the output
        torch.testing.assert_close(
            got.float(), expected, atol=tol, rtol=tol, msg=lambda m, n=name: f"{n}, seed {seed}: {m}"
        )
