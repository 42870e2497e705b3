"""Decode-path kernels on the CPU emulator (tests/kernels/emu): the fused attention prologue (q/k norm +
rotary + KV write) against the unfused torch references it replaces, the GEMV (plain and with the
SwiGLU epilogue) against an fp32 product, and the GEMV with the residual add + RMSNorm prologue against
the unfused sequence (add, norm, product) computed in fp32 from the same rounded intermediates."""

from __future__ import annotations

import ctypes

import pytest
import torch
import torch.nn.functional as F
from emulator import build_emulator, needs_gxx, ptr

from voltllm import ops
from voltllm.ops.norm import fused_add_rms_norm_ref
from voltllm.ops.prologue import qk_norm_rope_kv_write_ref

pytestmark = needs_gxx


@pytest.fixture(scope="module")
def emu(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    return build_emulator(tmp_path_factory.mktemp("emu"), "decode_ops_harness.cpp")


@pytest.mark.parametrize(
    "head,num_heads,num_kv_heads,norm,dtype",
    [
        (128, 16, 8, True, torch.float16),  # Qwen3-0.6B
        (128, 32, 8, False, torch.float16),  # Llama-3-8B: 40 q/k heads over 16 warps
        (64, 4, 2, False, torch.bfloat16),
        (256, 4, 1, True, torch.float16),
    ],
)
def test_prologue_matches_unfused_references(emu, head, num_heads, num_kv_heads, norm, dtype):
    gen = torch.Generator().manual_seed(head + num_heads)
    num_tokens, num_blocks, max_position = 5, 4, 64
    width = (num_heads + 2 * num_kv_heads) * head
    qkv = torch.randn(num_tokens, width + 8, generator=gen).to(dtype)[:, :width]  # strided rows
    positions = torch.tensor([0, 7, 63, 64, 30])  # 64: past the table, left unrotated
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head, 2).float() / head))
    cos_sin = ops.cos_sin_cache(inv_freq, max_position, "cpu")
    q_weight = (1 + 0.1 * torch.randn(head, generator=gen)).to(dtype) if norm else None
    k_weight = (1 + 0.1 * torch.randn(head, generator=gen)).to(dtype) if norm else None
    kv_cache = torch.full((2, num_blocks, 16, num_kv_heads, head), float("nan")).to(dtype)
    slots = torch.tensor([3, -1, 17, 40, 63])  # -1: padding, not written
    ref_qkv, ref_cache = qkv.clone(), kv_cache.clone()
    qk_norm_rope_kv_write_ref(
        ref_qkv, positions, cos_sin, q_weight, k_weight, 1e-6, num_heads, ref_cache, slots
    )
    emu.emu_qk_norm_rope(
        ctypes.c_int(int(dtype == torch.bfloat16)), ctypes.c_int(head), ptr(qkv), ptr(positions),
        ptr(cos_sin), ptr(q_weight), ptr(k_weight), ptr(kv_cache[0]), ptr(kv_cache[1]), ptr(slots),
        ctypes.c_longlong(qkv.stride(0)), ctypes.c_longlong(max_position), ctypes.c_longlong(num_blocks * 16),
        ctypes.c_int(num_heads), ctypes.c_int(num_kv_heads), ctypes.c_float(1e-6), ctypes.c_int(num_tokens),
        ctypes.c_uint(3),
    )  # fmt: skip
    tol = 1e-2 if dtype == torch.float16 else 5e-2
    torch.testing.assert_close(qkv.float(), ref_qkv.float(), atol=tol, rtol=tol)
    written = torch.zeros(num_blocks * 16, dtype=torch.bool)
    written[slots[slots >= 0]] = True
    got, want = kv_cache.view(2, num_blocks * 16, -1), ref_cache.view(2, num_blocks * 16, -1)
    torch.testing.assert_close(got[:, written].float(), want[:, written].float(), atol=tol, rtol=tol)
    assert got[:, ~written].isnan().all(), "a slot that was not scheduled was written"


def run_gemv(emu, x, weight, bias, out, swiglu: bool) -> None:
    """The GEMV kernel into `out` (x's dtype, or float32: the kernel that stores float32 logits)."""
    emu.emu_gemv(
        ctypes.c_int(int(x.dtype == torch.bfloat16)), ptr(out), ptr(x), ptr(weight), ptr(bias),
        ctypes.c_longlong(out.stride(0)), ctypes.c_longlong(x.stride(0)), ctypes.c_int(x.shape[0]),
        ctypes.c_int(out.shape[1]), ctypes.c_int(x.shape[1]), ctypes.c_int(int(swiglu)),
        ctypes.c_int(int(out.dtype == torch.float32)), ctypes.c_uint(5),
    )  # fmt: skip


@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("swiglu", [False, True])
@pytest.mark.parametrize(("n", "k", "dtype"), [(9, 520, torch.float16), (6, 2056, torch.bfloat16)])
def test_gemv_matches_fp32_product(emu, rows, swiglu, n, k, dtype):
    gen = torch.Generator().manual_seed(n * k + rows)
    x = torch.randn(rows, k + 8, generator=gen).to(dtype)[:, :k]  # rows k + 8 apart
    weight = (torch.randn(2 * n if swiglu else n, k, generator=gen) / k**0.5).to(dtype)
    bias = torch.randn(weight.shape[0], generator=gen).to(dtype)
    out = torch.full((rows, n), float("nan")).to(dtype)
    run_gemv(emu, x, weight, bias, out, swiglu)
    ref = F.linear(x.float(), weight.float(), bias.float())
    if swiglu:
        gate, up = ref.to(dtype).float().chunk(2, dim=-1)
        ref = F.silu(gate) * up
    tol = 1e-2 if dtype == torch.float16 else 5e-2
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)
    if not swiglu:  # float32 logits straight from the GEMV: the T result widened, bit for bit
        wide = torch.full((rows, n), float("nan"))
        run_gemv(emu, x, weight, bias, wide, swiglu)
        assert torch.equal(wide, out.float())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("swiglu", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
def test_add_rms_norm_gemv_matches_unfused_sequence(emu, dtype, rows, swiglu, with_bias):
    # k = 1032 is no multiple of any chunk (1024 or 2048 elements) and leaves most of the 256 norm
    # threads of a row with one 8-element slice and a few with two; 2 blocks of 16 warps for 37
    # features make warps loop over a second feature.
    n, k, blocks, eps = 37, 1032, 2, 1e-6
    gen = torch.Generator().manual_seed(rows * 100 + 10 * swiglu + with_bias + (dtype == torch.bfloat16))
    hidden = torch.randn(rows, k + 8, generator=gen).to(dtype)[:, :k]  # rows k + 8 apart
    residual = (4 * torch.randn(rows, k + 16, generator=gen)).to(dtype)[:, :k]  # rows k + 16 apart
    norm_weight = (1 + 0.1 * torch.randn(k, generator=gen)).to(dtype)
    weight = (torch.randn(2 * n if swiglu else n, k, generator=gen) / k**0.5).to(dtype)
    bias = torch.randn(weight.shape[0], generator=gen).to(dtype) if with_bias else None
    out = torch.full((rows, n), float("nan")).to(dtype)
    residual_out = torch.full((rows, k), float("nan")).to(dtype)
    hidden_before, residual_before = hidden.clone(), residual.clone()
    emu.emu_add_rms_norm_gemv(
        ctypes.c_int(int(dtype == torch.bfloat16)), ptr(out), ptr(residual_out), ptr(hidden), ptr(residual),
        ptr(norm_weight), ptr(weight), ptr(bias), ctypes.c_longlong(out.stride(0)),
        ctypes.c_longlong(residual_out.stride(0)), ctypes.c_longlong(hidden.stride(0)),
        ctypes.c_longlong(residual.stride(0)), ctypes.c_float(eps), ctypes.c_int(rows), ctypes.c_int(n),
        ctypes.c_int(k), ctypes.c_int(int(swiglu)), ctypes.c_int(blocks), ctypes.c_uint(7),
    )  # fmt: skip
    normed, summed = fused_add_rms_norm_ref(hidden, residual, norm_weight, eps)
    ref = F.linear(normed.float(), weight.float(), None if bias is None else bias.float())
    if swiglu:  # the unfused projection is stored in dtype before the activation
        gate, up = ref.to(dtype).float().chunk(2, dim=-1)
        ref = F.silu(gate) * up
    assert torch.equal(residual_out, summed), "the new residual is the rounded sum, exactly"
    assert torch.equal(hidden, hidden_before) and torch.equal(residual, residual_before)
    # Plain: the same fp32 sum rounded once, so within an ulp. SwiGLU: a gate product that rounds the
    # other way moves silu(gate) * up by a few ulps where silu is steep relative to its value.
    assert ulps_off(out, ref).max() <= (4.0 if swiglu else 1.0)


def ulps_off(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """|got - want| in units of the last place of got's dtype at want's magnitude (at least 1/16)."""
    magnitude = want.abs().clamp_min(1 / 16)
    ulp = torch.finfo(got.dtype).eps * torch.exp2(torch.floor(torch.log2(magnitude)))
    return (got.float() - want).abs() / ulp
