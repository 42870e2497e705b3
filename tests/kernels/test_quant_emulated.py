"""The quantized kernels (csrc/quantization/) on the CPU emulator (tests/kernels/emu): the GEMV (plain and
with the SwiGLU epilogue), the WMMA GEMM (every row tile, with and without split k) and the dequantize
kernel against `dequantize` then an fp32 product, for every kind, bit width, group size and act-order,
with weights packed by `voltllm.ops.quantized_linear.pack` (the layout the GPU reads)."""

from __future__ import annotations

import ctypes

import pytest
import torch
import torch.nn.functional as F
from emulator import build_emulator, needs_gxx, ptr
from quant_cases import CASES, QuantCase, make_weight

from voltllm.layers.quantization.quantized_weight import dequantize
from voltllm.ops.activation import silu_and_mul_ref
from voltllm.ops.norm import fused_add_rms_norm_ref
from voltllm.ops.quantized_linear import PackedQuantWeight, pack

pytestmark = needs_gxx


@pytest.fixture(scope="module")
def emu(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    return build_emulator(tmp_path_factory.mktemp("emu"), "quant_harness.cpp")


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


def _tolerance(reference: torch.Tensor) -> float:
    return 2e-3 * float(reference.abs().max()) + 1e-3


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
@pytest.mark.parametrize("rows,swiglu", [(1, False), (3, True), (8, False)])
def test_gemv_matches_dequantize_then_matmul(emu, case: QuantCase, rows: int, swiglu: bool):
    gen = torch.Generator().manual_seed(hash((case.name, rows, swiglu)) % 2**31)
    n, k = (26, 256) if swiglu else (13, 256)  # odd n: the last warp has one feature
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
        ctypes.c_uint(7),
    )  # fmt: skip
    torch.testing.assert_close(out.float(), ref, atol=_tolerance(ref), rtol=0)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
@pytest.mark.parametrize("rows,swiglu,blocks", [(1, False, 1), (2, True, 1), (3, False, 2)])
def test_persistent_gemv_matches_dequantize_then_matmul(
    emu, case: QuantCase, rows: int, swiglu: bool, blocks: int
):
    """The persistent GEMV: warps walk several row groups (10 groups of 4 rows, or 5 of 2 features with
    SwiGLU, over 8 or 16 warps) of several steps each (k: 80 4-bit or 160 8-bit chunks, 64 per step)."""
    gen = torch.Generator().manual_seed(hash((case.name, rows, swiglu, "persistent")) % 2**31)
    n, k = (78, 2560) if swiglu else (39, 2560)  # a last group with fewer rows
    weight = make_weight(case, n, k, gen)
    packed = pack(weight)
    x = torch.randn(rows, k, generator=gen).to(torch.float16)
    bias = torch.randn(n, generator=gen).to(torch.float16)
    ref = _reference(weight, x, bias)
    if swiglu:
        ref = silu_and_mul_ref(ref.to(torch.float16).float())
    xg = _gathered(packed, x)
    out = torch.full((rows, ref.shape[1]), float("nan"), dtype=torch.float16)
    emu.emu_quant_gemv_persistent(
        ctypes.c_int(packed.kind), ptr(out), ptr(xg), ptr(packed.packed), ptr(packed.group_params), ptr(bias),
        ctypes.c_longlong(out.stride(0)), ctypes.c_longlong(xg.stride(0)), ctypes.c_int(rows),
        ctypes.c_int(ref.shape[1]), ctypes.c_int(k), *_group_args(packed), ctypes.c_int(int(swiglu)),
        ctypes.c_int(blocks), ctypes.c_uint(5),
    )  # fmt: skip
    torch.testing.assert_close(out.float(), ref, atol=_tolerance(ref), rtol=0)


@pytest.mark.parametrize("case", [c for c in CASES if not c.act_order], ids=lambda c: c.name)
@pytest.mark.parametrize("swiglu", [False, True])
def test_add_rms_norm_gemv_matches_norm_then_matmul(emu, case: QuantCase, swiglu: bool):
    """The norm-prologue GEMV on 2 blocks (each normalizes the row): the sum is stored once, exactly,
    and the product is the reference's on the normalized row."""
    gen = torch.Generator().manual_seed(hash((case.name, swiglu, "norm")) % 2**31)
    n, k = (78, 1280) if swiglu else (39, 1280)
    weight = make_weight(case, n, k, gen)
    packed = pack(weight)
    hidden = torch.randn(1, k, generator=gen).to(torch.float16)
    residual = (4 * torch.randn(1, k, generator=gen)).to(torch.float16)
    norm_weight = (1 + 0.1 * torch.randn(k, generator=gen)).to(torch.float16)
    bias = torch.randn(n, generator=gen).to(torch.float16)
    normed, summed = fused_add_rms_norm_ref(hidden, residual, norm_weight, 1e-6)
    ref = _reference(weight, normed, bias)
    if swiglu:
        ref = silu_and_mul_ref(ref.to(torch.float16).float())
    out = torch.full((1, ref.shape[1]), float("nan"), dtype=torch.float16)
    residual_out = torch.full_like(hidden, float("nan"))
    emu.emu_quant_add_rms_norm_gemv(
        ctypes.c_int(packed.kind), ptr(out), ptr(residual_out), ptr(hidden), ptr(residual), ptr(norm_weight),
        ctypes.c_float(1e-6), ptr(packed.packed), ptr(packed.group_params), ptr(bias),
        ctypes.c_int(ref.shape[1]), ctypes.c_int(k), *_group_args(packed), ctypes.c_int(int(swiglu)),
        ctypes.c_int(2), ctypes.c_uint(9),
    )  # fmt: skip
    assert torch.equal(residual_out, summed)
    torch.testing.assert_close(out.float(), ref, atol=_tolerance(ref), rtol=0)


# The cases that run every row tile, split k unevenly (the rest run block_m 16 with k split in two).
_ALL_TILES = {"int4-g128", "int8-channel", "fp8-g128"}


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_gemm_matches_dequantize_then_matmul(emu, case: QuantCase):
    gen = torch.Generator().manual_seed(hash(case.name) % 2**31)
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
# k split unevenly, two by two with a ring shorter than the k-chunks, four row fragments.
_STREAM_SHAPES = [(1, 1, 4, 3), (2, 2, 2, 1), (4, 1, 2, 2)]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_stream_gemm_matches_dequantize_then_matmul(emu, case: QuantCase):
    gen = torch.Generator().manual_seed(hash(case.name) % 2**31 + 2)
    # m: a ragged last row fragment; n: a partial warp and block of features; 10 k-chunks of 64 columns.
    m, n, k = 20, 136, 640
    weight = make_weight(case, n, k, gen)
    packed = pack(weight)
    x = torch.randn(m, k, generator=gen).to(torch.float16)
    bias = torch.randn(n, generator=gen).to(torch.float16)
    ref = _reference(weight, x, bias)
    shapes = _STREAM_SHAPES if case.name in _ALL_TILES else _STREAM_SHAPES[:1]
    for m_frags, n_frags, depth, splits in shapes:
        xg = _gathered(packed, x)
        out = torch.full((m, n), float("nan"), dtype=torch.float16)
        partial = torch.zeros(m, n)
        emu.emu_quant_gemm_stream(
            ctypes.c_int(packed.kind), ctypes.c_int(m_frags), ctypes.c_int(n_frags), ctypes.c_int(depth),
            ctypes.c_int(splits), ptr(out), ptr(partial), ptr(xg), ptr(packed.packed),
            ptr(packed.group_params), ptr(bias), ctypes.c_longlong(out.stride(0)),
            ctypes.c_longlong(xg.stride(0)), ctypes.c_int(m), ctypes.c_int(n), ctypes.c_int(k),
            *_group_args(packed), ctypes.c_uint(depth),
        )  # fmt: skip
        shape = f"m_frags {m_frags} n_frags {n_frags} depth {depth} splits {splits}"
        torch.testing.assert_close(out.float(), ref, atol=_tolerance(ref), rtol=0, msg=shape)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_dequantize_kernel_is_the_definition(emu, case: QuantCase):
    """Bit for bit: the kernels' fp16 weights are `dequantize(weight, float16)`."""
    gen = torch.Generator().manual_seed(hash(case.name) % 2**31 + 1)
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
