"""The quantized kernels (csrc/quantization/) on the CPU emulator (tests/kernels/emu): the GEMV (plain and
with the SwiGLU epilogue), the WMMA GEMM (every row tile, with and without split k), the streaming
GEMMs and the dequantize kernel against `dequantize` then an fp32 product, for every kind, bit width,
group size and act-order, with weights packed by `voltllm.ops.quantized_linear.pack` (the layout the GPU
reads). The register-dequantizing GEMM runs on the emulator's WMMA layouts (include/mma.h: scrambled,
paired, and at 16 elements per lane repeated), each probed by its kernel and repacked from the probe."""

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
from voltllm.ops.quantized_linear import (
    GEMV_ONE_ROW_SHAPES,
    PackedQuantWeight,
    fragment_layout_from_probe,
    fragment_unsupported_reason,
    pack,
    pack_fragments,
)

pytestmark = needs_gxx


@pytest.fixture(scope="module")
def emu(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    return build_emulator(tmp_path_factory.mktemp("emu"), "quant_harness.cpp")


@pytest.fixture(scope="module")
def emu16(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    """The harness with 16 operand elements per lane, every element held twice (as on GPUs)."""
    return build_emulator(
        tmp_path_factory.mktemp("emu16"), "quant_harness.cpp", ("VOLTLLM_EMU_WMMA_OPERAND_ELEMENTS=16",)
    )


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


# WMMA orders of include/mma.h (0 scrambled, 1 paired, 2 repeated) at 8 and 16 operand elements per lane:
# (elements, order, the layout the probe leads to, tuples of codes).
_FRAG_ORDERS = [(8, 0, 0, 32), (8, 1, 1, 32), (16, 0, 0, 32), (16, 1, 1, 16), (16, 2, 2, 32)]


def _probe(lib: ctypes.CDLL, order: int) -> torch.Tensor:
    probe = torch.full((32, 16), 7777, dtype=torch.int32)
    lib.emu_quant_wmma_b_layout(ctypes.c_int(order), ptr(probe), ctypes.c_uint(order + 1))
    return probe


@pytest.mark.parametrize("elements,order,layout,tuples", _FRAG_ORDERS)
def test_fragment_layout_probe(emu, emu16, elements: int, order: int, layout: int, tuples: int):
    """The probe kernel reports each emulated order, and the repack plan reproduces every lane's slots."""
    probe = _probe(emu16 if elements == 16 else emu, order)
    plan = fragment_layout_from_probe(probe)
    assert (plan.elements, plan.layout, plan.tuples.shape[0]) == (elements, layout, tuples)
    held = probe[:, : plan.slots].long()
    assert torch.equal(plan.tuples[plan.lane_tuple], held)
    params = plan.slots // plan.run
    assert torch.equal(plan.lane_cols[:, :params], held[:, :: plan.run] // 16)
    assert bool((probe[:, elements:] == -1).all())
    # The layout-free form (0) is what any probe gives when capped there.
    assert fragment_layout_from_probe(probe, max_layout=0).layout == 0


def test_fragment_layout_rejects_a_partial_probe(emu):
    probe = _probe(emu, 0)
    probe[3, 2] = probe[3, 1]  # one element held twice, another never
    with pytest.raises(ValueError, match="each of the 256 elements"):
        fragment_layout_from_probe(probe)


# int4-g128 (the AWQ shape) under every order and every layout it allows; the other 4-bit formats under the
# two GPU-like orders at their probed layouts; group 32 (refused) once.
_FRAG_RUNS = [
    *((g, e, o, lay) for g in (128,) for e, o, lay, _ in _FRAG_ORDERS),
    (128, 16, 2, 0),
    (128, 16, 2, 1),
    *((g, 16, o, o) for g in (64, -1) for o in (1, 2)),
    *((g, 16, 2, 2) for g in ("sym", "actorder")),
    (32, 8, 0, 0),
]
_FRAG_CASE_BY_KEY = {
    **{c.group_size: c for c in CASES if c.kind == "int" and c.bits == 4 and c.zeros and not c.act_order},
    "sym": next(c for c in CASES if c.name == "int4-g128-sym"),
    "actorder": next(c for c in CASES if c.name == "int4-g128-actorder"),
}
# (m_frags, n_frags, splits, deep): k split unevenly (10 k-chunks in 3 splits), one split, splits of one
# chunk; the deep ring at one weight fragment (structured layouts only).
_FRAG_SHAPES = [(1, 1, 3, False), (2, 2, 10, False), (3, 2, 2, False), (4, 1, 1, False)]
_FRAG_DEEP_SHAPES = [(1, 1, 2, True), (4, 1, 1, True)]


@pytest.mark.parametrize(
    "case,elements,order,layout",
    [(_FRAG_CASE_BY_KEY[key], e, o, lay) for key, e, o, lay in _FRAG_RUNS],
    ids=[f"{_FRAG_CASE_BY_KEY[key].name}-{e}-{o}-{lay}" for key, e, o, lay in _FRAG_RUNS],
)
def test_frag_gemm_matches_dequantize_then_matmul(
    emu, emu16, case: QuantCase, elements: int, order: int, layout: int
):
    """The register-dequantizing GEMM, repacked from the probe of the order it runs under: ragged rows
    and features (n = 136: a padded tile pair), the split reduction, counters left at zero; formats it
    does not take are refused by name."""
    gen = torch.Generator().manual_seed(_case_seed(case.name, elements, order, layout))
    m, n, k = 20, 136, 640
    weight = make_weight(case, n, k, gen)
    reason = fragment_unsupported_reason(weight)
    if case.group_size == 32:
        assert reason is not None and "group size 32" in reason
        return
    assert reason is None
    lib = emu16 if elements == 16 else emu
    plan = fragment_layout_from_probe(_probe(lib, order), max_layout=layout)
    assert plan.layout == layout
    packed = pack_fragments(weight, plan)
    x = torch.randn(m, k, generator=gen).to(torch.float16)
    bias = torch.randn(n, generator=gen).to(torch.float16)
    ref = _reference(weight, x, bias)
    xg = (x if packed.column_order is None else x[:, packed.column_order]).contiguous()
    num_groups = packed.group_params.shape[1]
    shift = 0 if num_groups == 1 else (case.group_size // 64).bit_length() - 1
    lane_tuple = plan.lane_tuple.to(torch.uint8).contiguous()
    lane_cols = plan.lane_cols.to(torch.uint8).contiguous()
    counters = torch.zeros(16, dtype=torch.int32)
    shapes = _FRAG_SHAPES if case.name == "int4-g128" or layout == 0 else _FRAG_SHAPES[:2]
    if layout > 0:
        shapes = shapes + (_FRAG_DEEP_SHAPES if case.name == "int4-g128" else _FRAG_DEEP_SHAPES[:1])
    for m_frags, n_frags, splits, deep in shapes:
        tiles = -(-m // (16 * m_frags)) * -(-n // (128 * n_frags))
        partial = torch.full((splits * tiles * 16 * m_frags * 128 * n_frags,), float("nan"))
        out = torch.full((m, n), float("nan"), dtype=torch.float16)
        lib.emu_quant_gemm_frag(
            ctypes.c_int(layout), ctypes.c_int(m_frags), ctypes.c_int(n_frags), ctypes.c_int(splits),
            ptr(out), ptr(partial), ptr(counters), ptr(xg), ptr(packed.codes), ptr(packed.group_params),
            ptr(bias), ctypes.c_longlong(out.stride(0)), ctypes.c_longlong(xg.stride(0)), ctypes.c_int(m),
            ctypes.c_int(n), ctypes.c_int(k), ctypes.c_int(num_groups), ctypes.c_int(shift),
            ctypes.c_int(packed.codes.shape[2] // 16), ptr(lane_tuple), ptr(lane_cols), ctypes.c_int(deep),
            ctypes.c_int(order), ctypes.c_uint(splits + 7 * m_frags),
        )  # fmt: skip
        shape = f"m_frags {m_frags} n_frags {n_frags} splits {splits} deep {deep}"
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
