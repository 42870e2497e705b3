"""Decode-path kernels on the CPU emulator (tests/kernels/emu): the fused attention prologue (q/k norm +
rotary + KV write) against the unfused torch references it replaces, and the GEMV (plain and with the
SwiGLU epilogue) against an fp32 product."""

from __future__ import annotations

import ctypes

import pytest
import torch
import torch.nn.functional as F
from emulator import build_emulator, needs_gxx, ptr

from voltllm import ops
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


@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("swiglu", [False, True])
@pytest.mark.parametrize(("n", "k", "dtype"), [(9, 520, torch.float16), (6, 2056, torch.bfloat16)])
def test_gemv_matches_fp32_product(emu, rows, swiglu, n, k, dtype):
    gen = torch.Generator().manual_seed(n * k + rows)
    x = torch.randn(rows, k + 8, generator=gen).to(dtype)[:, :k]  # rows k + 8 apart
    weight = (torch.randn(2 * n if swiglu else n, k, generator=gen) / k**0.5).to(dtype)
    bias = torch.randn(weight.shape[0], generator=gen).to(dtype)
    out = torch.full((rows, n), float("nan")).to(dtype)
    emu.emu_gemv(
        ctypes.c_int(int(dtype == torch.bfloat16)), ptr(out), ptr(x), ptr(weight), ptr(bias),
        ctypes.c_longlong(out.stride(0)), ctypes.c_longlong(x.stride(0)), ctypes.c_int(rows), ctypes.c_int(n),
        ctypes.c_int(k), ctypes.c_int(int(swiglu)), ctypes.c_uint(5),
    )  # fmt: skip
    ref = F.linear(x.float(), weight.float(), bias.float())
    if swiglu:
        gate, up = ref.to(dtype).float().chunk(2, dim=-1)
        ref = F.silu(gate) * up
    tol = 1e-2 if dtype == torch.float16 else 5e-2
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)
