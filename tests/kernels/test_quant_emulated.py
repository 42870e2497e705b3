"""The quantized kernels (csrc/quantization/) on the CPU emulator (tests/kernels/emu): the GEMV (plain,
with the SwiGLU epilogue and with the add + RMSNorm one), the WMMA GEMM (every row tile, with and without
split k), the streaming GEMM, the SM80 register-dequantizing 4-bit GEMM and the dequantize kernel against
`dequantize` then an fp32 product, for every kind, bit width, group size and act-order, with weights
packed by `voltllm.ops.quantized_linear.pack` (the layout the GPU reads)."""

from __future__ import annotations

import ctypes
import zlib

import pytest
import torch
import torch.nn.functional as F
from emulator import build_emulator, needs_gxx, ptr
from quant_cases import CASES, QuantCase, make_weight

from voltllm.layers.quantization.quantized_weight import dequantize
from voltllm.ops.activation import silu_and_mul_ref
from voltllm.ops.norm import fused_add_rms_norm_ref
from voltllm.ops.quantized_linear import (
    GEMV_ONE_ROW_SHAPES,
    PackedQuantWeight,
    pack,
)

pytestmark = needs_gxx


@pytest.fixture(scope="module")
def emu(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    return build_emulator(tmp_path_factory.mktemp("emu"), "quant_harness.cpp")


def _case_seed(*parts: object) -> int:
    """A seed fixed by the case: `hash()` of a str changes with every process (PYTHONHASHSEED), which
    made these draws fresh each run against tolerances that a few draws in a few hundred exceed."""
    return zlib.crc32(repr(parts).encode())


def _group_args(packed: PackedQuantWeight) -> tuple[ctypes.c_int, ctypes.c_int]:
    num_groups = packed.group_params.shape[1]
    chunk = 32 if packed.kind == 0 else 16
    shift = 0 if num_groups == 1 else (packed.group_size // chunk).bit_length() - 1
    return ctypes.c_int(num_groups), ctypes.c_int(shift)


def _reference(weight, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """fp32 product with the fp16 weights `dequantize` defines (x in the checkpoint's column order)."""
    dense = dequantize(weight, torch.float16).float()
    return F.linear(x.float(), dense, None if bias is None else bias.float())


def _gathered(packed: PackedQuantWeight, x: torch.Tensor) -> torch.Tensor:
    return (x if packed.column_order is None else x[:, packed.column_order]).contiguous()


def _tolerance(reference: torch.Tensor, relative: float = 2e-3) -> float:
    return relative * float(reference.abs().max()) + 1e-3


# (rows, swiglu, shape): one row in every built shape (QuantGemvOneRowShape), more rows in the default.
GEMV_RUNS = [
    *((1, swiglu, shape) for shape in range(GEMV_ONE_ROW_SHAPES) for swiglu in (False, True)),
    (3, True, -1),
    (8, False, -1),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
@pytest.mark.parametrize("rows,swiglu,shape", GEMV_RUNS)
def test_gemv_matches_dequantize_then_matmul(emu, case: QuantCase, rows: int, swiglu: bool, shape: int):
    gen = torch.Generator().manual_seed(_case_seed(case.name, rows, swiglu, shape))
    # Odd n: the last warp has one feature. One row: k of 2,304 (72 int4 chunks, 144 8-bit ones) gives
    # the k-split warps several steps each, a short last one and, for int4, an idle warp.
    k = 2304 if rows == 1 else 256
    n = 26 if swiglu else 13
    weight = make_weight(case, n, k, gen)
    packed = pack(weight)
    x = torch.randn(rows, k, generator=gen).to(torch.float16)
    bias = torch.randn(n, generator=gen).to(torch.float16)
    ref = _reference(weight, x, bias)
    if swiglu:
        # The kernel rounds each projection to fp16 before the activation, as the unfused layer stores it.
        ref = silu_and_mul_ref(ref.to(torch.float16).float())
    xg = _gathered(packed, x)
    out = torch.full((rows, ref.shape[1]), float("nan"), dtype=torch.float16)
    emu.emu_quant_gemv(
        ctypes.c_int(packed.kind), ptr(out), ptr(xg), ptr(packed.packed), ptr(packed.group_params), ptr(bias),
        ctypes.c_longlong(out.stride(0)), ctypes.c_longlong(xg.stride(0)), ctypes.c_int(rows),
        ctypes.c_int(ref.shape[1]), ctypes.c_int(k), *_group_args(packed), ctypes.c_int(int(swiglu)),
        ctypes.c_int(shape), ctypes.c_uint(7),
    )  # fmt: skip
    # At k = 2,304 the fp16 products (runs of 8 per fp16 sum) add up to more than at 256, and SwiGLU
    # multiplies two such rounded sums: at 3e-3 (the GPU tests' bound) one random int8 SwiGLU draw of a
    # few hundred failed.
    relative = 5e-3 if swiglu else 3e-3
    torch.testing.assert_close(out.float(), ref, atol=_tolerance(ref, relative), rtol=0)


# One case per kind and bit width, and act-order: the epilogue does not depend on the group layout.
NORM_CASES = [c for c in CASES if c.name in {"int4-g128", "int4-g32-sym-actorder", "int8-g128", "fp8-g128"}]


@pytest.mark.parametrize("case", NORM_CASES, ids=lambda c: c.name)
@pytest.mark.parametrize("rows,shape", [(1, 0), (1, 1), (3, -1)])
def test_gemv_add_norm_epilogue_normalizes_the_new_residual(emu, case: QuantCase, rows: int, shape: int):
    """The GEMV with its add + RMSNorm epilogue equals the projection (rounded to fp16) then
    `fused_add_rms_norm`, leaves the arrival counter at zero for the next launch, and gives the same
    bits whichever block finishes last (the emulator's seed orders the blocks)."""
    gen = torch.Generator().manual_seed(_case_seed(case.name, rows, shape, "norm"))
    k, n = (2304, 40) if rows == 1 else (256, 40)  # n = 40: three or five blocks, the last one partial
    weight = make_weight(case, n, k, gen)
    packed = pack(weight)
    x = torch.randn(rows, k, generator=gen).to(torch.float16)
    bias = torch.randn(n, generator=gen).to(torch.float16)
    residual = torch.randn(rows, n, generator=gen).to(torch.float16)
    norm_weight = (1 + 0.1 * torch.randn(n, generator=gen)).to(torch.float16)
    eps = 1e-5
    projection = _reference(weight, x, bias).to(torch.float16)
    ref_normed, ref_residual = fused_add_rms_norm_ref(projection, residual, norm_weight, eps)
    xg = _gathered(packed, x)
    arrivals = torch.zeros(1, dtype=torch.int32)
    results = []
    for seed in (7, 8):
        normed = torch.full((rows, n), float("nan"), dtype=torch.float16)
        new_residual = torch.full((rows, n), float("nan"), dtype=torch.float16)
        block_squares = torch.full((rows * -(-n // 8),), float("nan"))
        emu.emu_quant_gemv_add_norm(
            ctypes.c_int(packed.kind), ptr(normed), ptr(new_residual), ptr(xg), ptr(packed.packed),
            ptr(packed.group_params), ptr(bias), ptr(residual), ptr(norm_weight), ctypes.c_float(eps),
            ptr(block_squares), ptr(arrivals), ctypes.c_longlong(normed.stride(0)),
            ctypes.c_longlong(xg.stride(0)), ctypes.c_int(rows), ctypes.c_int(n), ctypes.c_int(k),
            *_group_args(packed), ctypes.c_int(shape), ctypes.c_uint(seed),
        )  # fmt: skip
        assert arrivals.item() == 0, "the last block resets the counter"
        results.append((normed, new_residual))
    normed, new_residual = results[0]
    assert torch.equal(normed, results[1][0]) and torch.equal(new_residual, results[1][1])
    # The projection's fp16 products may round a sum one ulp apart from the reference's fp32 ones.
    torch.testing.assert_close(
        new_residual.float(), ref_residual.float(), atol=_tolerance(ref_residual.float()), rtol=0
    )
    torch.testing.assert_close(
        normed.float(), ref_normed.float(), atol=_tolerance(ref_normed.float()), rtol=0
    )
    # Given the kernel's own sum, the norm is fused_add_rms_norm's up to the order of the squares' sum.
    exact = fused_add_rms_norm_ref(torch.zeros_like(new_residual), new_residual, norm_weight, eps)[0]
    torch.testing.assert_close(normed.float(), exact.float(), atol=2e-3, rtol=2e-3)


# The cases that run every row tile, split k unevenly (the rest run block_m 16 with k split in two).
_ALL_TILES = {"int4-g128", "int8-channel", "fp8-g128"}


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_gemm_matches_dequantize_then_matmul(emu, case: QuantCase):
    gen = torch.Generator().manual_seed(_case_seed(case.name))
    # Tails in m (not a multiple of 16) and n (not of 128); 10 k-tiles, more than the deepest register
    # ring of k-tiles in flight (4), so that every ring slot is reloaded.
    m, n, k = 20, 136, 640
    weight = make_weight(case, n, k, gen)
    packed = pack(weight)
    x = torch.randn(m, k, generator=gen).to(torch.float16)
    bias = torch.randn(n, generator=gen).to(torch.float16)
    ref = _reference(weight, x, bias)
    xg = _gathered(packed, x)
    configs = [(16, 1), (64, 3), (128, 4)] if case.name in _ALL_TILES else [(16, 2)]
    for block_m, splits in configs:
        out = torch.full((m, n), float("nan"), dtype=torch.float16)
        partial = torch.zeros(m, n)
        emu.emu_quant_gemm(
            ctypes.c_int(packed.kind), ctypes.c_int(block_m), ctypes.c_int(splits), ptr(out), ptr(partial),
            ptr(xg), ptr(packed.packed), ptr(packed.group_params), ptr(bias),
            ctypes.c_longlong(out.stride(0)), ctypes.c_longlong(xg.stride(0)), ctypes.c_int(m),
            ctypes.c_int(n), ctypes.c_int(k), *_group_args(packed), ctypes.c_uint(block_m),
        )  # fmt: skip
        torch.testing.assert_close(out.float(), ref, atol=_tolerance(ref), rtol=0, msg=f"block_m {block_m}")


# (m_frags, n_frags, depth, splits) the emulator harness builds: one row fragment with a deep ring and
# (m_frags, n_frags, splits): k split unevenly (10 k-chunks in 3 splits of 4, 4, 2: more than the ring's
# depth and the x window's, so that both are refilled), one split, splits of one chunk; every shape.
_STREAM_SHAPES = [(1, 1, 3), (1, 2, 1), (2, 2, 10), (3, 1, 2), (4, 1, 3), (4, 2, 4)]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_stream_gemm_matches_dequantize_then_matmul(emu, case: QuantCase):
    """Every shape, ragged rows and features, the last split's reduction (in a seeded block order) and
    the counters it leaves at zero for the next call."""
    gen = torch.Generator().manual_seed(_case_seed(case.name) + 2)
    # m: a ragged last row fragment (two row blocks at one fragment); n: a partial warp and block of
    # features (two blocks at one weight fragment per warp); 10 k-chunks of 64 columns.
    m, n, k = 20, 136, 640
    weight = make_weight(case, n, k, gen)
    packed = pack(weight)
    x = torch.randn(m, k, generator=gen).to(torch.float16)
    bias = torch.randn(n, generator=gen).to(torch.float16)
    ref = _reference(weight, x, bias)
    shapes = _STREAM_SHAPES if case.name in _ALL_TILES else _STREAM_SHAPES[:1]
    xg = _gathered(packed, x)
    counters = torch.zeros(16, dtype=torch.int32)
    for m_frags, n_frags, splits in shapes:
        tiles = -(-m // (16 * m_frags)) * -(-n // (128 * n_frags))
        tile_floats = emu.emu_quant_gemm_stream_tile_floats(ctypes.c_int(m_frags), ctypes.c_int(n_frags))
        out = torch.full((m, n), float("nan"), dtype=torch.float16)
        partial = torch.full((splits * tiles * tile_floats,), float("nan"))
        emu.emu_quant_gemm_stream(
            ctypes.c_int(packed.kind), ctypes.c_int(m_frags), ctypes.c_int(n_frags), ctypes.c_int(splits),
            ptr(out), ptr(partial), ptr(counters), ptr(xg), ptr(packed.packed), ptr(packed.group_params),
            ptr(bias), ctypes.c_longlong(out.stride(0)), ctypes.c_longlong(xg.stride(0)), ctypes.c_int(m),
            ctypes.c_int(n), ctypes.c_int(k), *_group_args(packed), ctypes.c_uint(splits + 7 * m_frags),
        )  # fmt: skip
        shape = f"m_frags {m_frags} n_frags {n_frags} splits {splits}"
        torch.testing.assert_close(out.float(), ref, atol=_tolerance(ref), rtol=0, msg=shape)
        assert not counters.any(), f"{shape}: split counters left at {counters.tolist()}"


INT4_CASES = [case for case in CASES if case.kind == "int" and case.bits == 4]
# (m_frags, splits, form): 10 stretches of 128 columns in 3 splits of 4, 4, 2 (past the ring's depth
# and the x windows, so that both refill), one split, splits of one stretch; every built m_frags in
# every form (0: x through registers, 1: x by cp.async, 2: weights and x staged, m_frags 2 or 4).
_MMA_SHAPES = [(1, 3, 0), (2, 1, 0), (3, 10, 0), (4, 3, 0), (1, 1, 1), (2, 3, 1), (3, 10, 1), (4, 3, 1),
               (2, 3, 2), (4, 1, 2), (4, 10, 2)]  # fmt: skip


@pytest.mark.parametrize("case", INT4_CASES, ids=lambda c: c.name)
def test_mma_gemm_matches_dequantize_then_matmul(emu, case: QuantCase):
    """The SM80 register-dequantizing GEMM (its permuted k order, the lanes' rotated words): every 4-bit
    case, every row-fragment count, ragged rows and features, the split reduction and its counters."""
    gen = torch.Generator().manual_seed(_case_seed(case.name) + 3)
    # m: a ragged last row fragment; n: a partial n-tile, warp and block (two blocks of 256 features);
    # 10 stretches of 128 columns.
    m, n, k = 20, 268, 1280
    weight = make_weight(case, n, k, gen)
    packed = pack(weight)
    x = torch.randn(m, k, generator=gen).to(torch.float16)
    bias = torch.randn(n, generator=gen).to(torch.float16)
    ref = _reference(weight, x, bias)
    xg = _gathered(packed, x)
    counters = torch.zeros(16, dtype=torch.int32)
    for m_frags, splits, form in _MMA_SHAPES:
        tiles = -(-m // (16 * m_frags)) * -(-n // (128 if form == 2 else 256))
        tile_floats = emu.emu_quant_gemm_mma_tile_floats(ctypes.c_int(m_frags), ctypes.c_int(form))
        out = torch.full((m, n), float("nan"), dtype=torch.float16)
        partial = torch.full((splits * tiles * tile_floats,), float("nan"))
        emu.emu_quant_gemm_mma(
            ctypes.c_int(m_frags), ctypes.c_int(form), ctypes.c_int(splits), ptr(out), ptr(partial),
            ptr(counters), ptr(xg), ptr(packed.packed), ptr(packed.group_params), ptr(bias),
            ctypes.c_longlong(out.stride(0)), ctypes.c_longlong(xg.stride(0)), ctypes.c_int(m),
            ctypes.c_int(n), ctypes.c_int(k), *_group_args(packed), ctypes.c_uint(splits + 7 * m_frags),
        )  # fmt: skip
        shape = f"m_frags {m_frags} splits {splits} form {form}"
        torch.testing.assert_close(out.float(), ref, atol=_tolerance(ref), rtol=0, msg=shape)
        assert not counters.any(), f"{shape}: split counters left at {counters.tolist()}"


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_dequantize_kernel_is_the_definition(emu, case: QuantCase):
    """Bit for bit: the kernels' fp16 weights are `dequantize(weight, float16)`."""
    gen = torch.Generator().manual_seed(_case_seed(case.name) + 1)
    n, k = 24, 256
    weight = make_weight(case, n, k, gen)
    packed = pack(weight)
    out = torch.full((n, k), float("nan"), dtype=torch.float16)
    emu.emu_quant_dequantize(
        ctypes.c_int(packed.kind), ptr(out), ptr(packed.packed), ptr(packed.group_params), ctypes.c_int(n),
        ctypes.c_int(k), *_group_args(packed), ctypes.c_uint(3),
    )  # fmt: skip
    expected = dequantize(weight, torch.float16)
    if packed.column_order is not None:
        expected = expected[:, packed.column_order]
    assert torch.equal(out, expected)
