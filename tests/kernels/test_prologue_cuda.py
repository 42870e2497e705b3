"""The fused attention prologue kernel on a GPU against the unfused torch references."""

from __future__ import annotations

import pytest
import torch

from voltllm import ops

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    "head,num_heads,num_kv_heads,norm",
    [(128, 16, 8, True), (128, 32, 8, False), (64, 4, 2, True), (256, 8, 1, False)],
)
@pytest.mark.parametrize("num_tokens", [1, 37, 300])
def test_prologue_kernel_matches_reference(dtype, head, num_heads, num_kv_heads, norm, num_tokens):
    gen = torch.Generator(device="cuda").manual_seed(num_tokens + head)
    num_blocks, max_position = 64, 4096
    width = (num_heads + 2 * num_kv_heads) * head
    qkv = torch.randn(num_tokens, width, device="cuda", generator=gen).to(dtype)
    positions = torch.randint(0, max_position, (num_tokens,), device="cuda", generator=gen)
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, head, 2, device="cuda").float() / head))
    cos_sin = ops.cos_sin_cache(inv_freq, max_position, "cuda")
    weights = [(1 + 0.1 * torch.randn(head, device="cuda", generator=gen)).to(dtype) for _ in range(2)]
    q_weight, k_weight = weights if norm else (None, None)
    kv_cache = torch.full((2, num_blocks, 16, num_kv_heads, head), float("nan"), device="cuda", dtype=dtype)
    slots = torch.randperm(num_blocks * 16, device="cuda", generator=gen)[:num_tokens]
    slots[::5] = -1  # padding tokens write nothing
    ref_qkv, ref_cache = qkv.clone(), kv_cache.clone()
    ops.qk_norm_rope_kv_write_ref(
        ref_qkv, positions, cos_sin, q_weight, k_weight, 1e-6, num_heads, ref_cache, slots
    )
    ops.qk_norm_rope_kv_write(qkv, positions, cos_sin, q_weight, k_weight, 1e-6, num_heads, kv_cache, slots)
    tol = 1e-2 if dtype == torch.float16 else 5e-2
    torch.testing.assert_close(qkv.float(), ref_qkv.float(), atol=tol, rtol=tol)
    written = torch.zeros(num_blocks * 16, dtype=torch.bool, device="cuda")
    written[slots[slots >= 0]] = True
    got, want = kv_cache.view(2, num_blocks * 16, -1), ref_cache.view(2, num_blocks * 16, -1)
    torch.testing.assert_close(got[:, written].float(), want[:, written].float(), atol=tol, rtol=tol)
    assert got[:, ~written].isnan().all()
