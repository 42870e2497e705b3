"""CPU checks of the torch references that serve as the kernels' oracles, and of CPU dispatch."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from voltllm import ops
from voltllm.layers.attention.backend import AttentionSpec
from voltllm.layers.rotary import apply_rotary, compute_inv_freq
from voltllm.ops.attention import (
    PREFILL_BLOCK_M,
    PREFILL_VARIANTS,
    attend,
    gather_context,
    prefill_row_tiles,
    prefill_variant,
    prefill_variants,
    runs_sm80_kernels,
)


def _paged(seq_lens: list[int], num_kv_heads: int, head_size: int, gen: torch.Generator):
    """A random fp32 KV cache with shuffled blocks and each sequence's contiguous keys/values."""
    blocks_per_seq = [-(-s // 16) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    perm = torch.randperm(num_blocks, generator=gen)
    kv_cache = torch.randn(2, num_blocks, 16, num_kv_heads, head_size, generator=gen)
    block_tables = torch.zeros(len(seq_lens), max(blocks_per_seq), dtype=torch.int32)
    used = 0
    for i, n in enumerate(blocks_per_seq):
        block_tables[i, :n] = perm[used : used + n].int()
        used += n
    return kv_cache, block_tables


@pytest.mark.parametrize("group", [1, 4])
def test_paged_attention_ref_matches_sdpa(group: int) -> None:
    gen = torch.Generator().manual_seed(0)
    num_kv_heads, head_size = 2, 32
    num_heads = num_kv_heads * group
    query_lens, seq_lens = [5, 1, 40], [5, 33, 70]  # prefill, decode, chunk after a cached prefix
    kv_cache, block_tables = _paged(seq_lens, num_kv_heads, head_size, gen)
    query = torch.randn(sum(query_lens), num_heads, head_size, generator=gen)
    scale = 1 / math.sqrt(head_size)
    out = ops.paged_attention_ref(query, kv_cache, block_tables, query_lens, seq_lens, scale)
    start = 0
    for i, (q_len, s_len) in enumerate(zip(query_lens, seq_lens, strict=True)):
        keys, values = gather_context(kv_cache, block_tables[i], s_len)
        q = query[start : start + q_len].transpose(0, 1)  # [heads, q, d]
        k = keys.repeat_interleave(group, dim=1).transpose(0, 1)
        v = values.repeat_interleave(group, dim=1).transpose(0, 1)
        mask = torch.arange(s_len)[None, :] <= torch.arange(s_len - q_len, s_len)[:, None]
        expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale).transpose(0, 1)
        torch.testing.assert_close(out[start : start + q_len], expected, rtol=1e-5, atol=1e-5)
        start += q_len


def test_paged_attention_ref_matches_torch_backend_with_window() -> None:
    gen = torch.Generator().manual_seed(1)
    spec = AttentionSpec(num_heads=8, num_kv_heads=2, head_size=16, scale=0.25, sliding_window=7)
    query_lens, seq_lens = [12, 1], [30, 19]
    kv_cache, block_tables = _paged(seq_lens, 2, 16, gen)
    query = torch.randn(13, 8, 16, generator=gen)
    out = ops.paged_attention_ref(query, kv_cache, block_tables, query_lens, seq_lens, 0.25, sliding_window=7)
    for i, (start, q_len, s_len) in enumerate([(0, 12, 30), (12, 1, 19)]):
        keys, values = gather_context(kv_cache, block_tables[i], s_len)
        expected = attend(query[start : start + q_len], keys, values, spec.scale, spec.sliding_window)
        torch.testing.assert_close(out[start : start + q_len], expected, rtol=1e-5, atol=1e-5)


def test_cpu_dispatch_runs_the_references() -> None:
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(4, 64, generator=gen)
    w = torch.randn(64, generator=gen)
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-6), ops.rms_norm_ref(x, w, 1e-6))
    residual = torch.randn(4, 64, generator=gen)
    expected_x, expected_res = ops.fused_add_rms_norm_ref(x, residual, w, 1e-6)
    x2, res2 = x.clone(), residual.clone()
    ops.fused_add_rms_norm(x2, res2, w, 1e-6)
    torch.testing.assert_close(res2, x + residual)
    torch.testing.assert_close((x2, res2), (expected_x, expected_res))
    gate_up = torch.randn(4, 128, generator=gen)
    torch.testing.assert_close(ops.silu_and_mul(gate_up), F.silu(gate_up[:, :64]) * gate_up[:, 64:])
    with pytest.raises(ValueError, match="even"):
        ops.silu_and_mul(torch.randn(2, 7))


def test_kv_cache_write_ref_skips_padding() -> None:
    kv_cache = torch.zeros(2, 3, 16, 2, 8)
    key, value = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    ops.kv_cache_write(key, value, kv_cache, torch.tensor([5, -1, 40]))
    assert torch.equal(kv_cache[0, 0, 5], key[0]) and torch.equal(kv_cache[1, 2, 8], value[2])
    assert int((kv_cache != 0).any(dim=(-1, -2)).sum()) == 4  # two slots in each of K and V


def test_rotary_ref_neox_matches_layer_and_gptj_matches_pairwise() -> None:
    gen = torch.Generator().manual_seed(3)
    head_size, num_heads = 32, 3
    inv_freq = compute_inv_freq(
        head_size,
        {
            "rope_type": "llama3",
            "rope_theta": 5e5,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        64,
    )
    table = ops.cos_sin_cache(inv_freq, 300)
    positions = torch.tensor([0, 7, 299, 128])
    q = torch.randn(4, num_heads * head_size, generator=gen)
    k = torch.randn(4, head_size, generator=gen)
    rq, rk = ops.rotary_embedding_ref(positions, q, k, table, head_size, is_neox=True)
    torch.testing.assert_close(
        rq.view(4, num_heads, head_size),
        apply_rotary(positions, q.view(4, num_heads, head_size), inv_freq),
        rtol=1e-5,
        atol=1e-5,
    )
    gq, _ = ops.rotary_embedding_ref(positions, q, None, table, head_size, is_neox=False)
    heads = q.view(4, num_heads, head_size)
    angle = positions.float()[:, None] * inv_freq[None, :]
    x, y = heads[..., 0::2], heads[..., 1::2]
    c, s = angle.cos()[:, None], angle.sin()[:, None]
    expected = torch.stack((x * c - y * s, y * c + x * s), dim=-1).flatten(-2)
    torch.testing.assert_close(gq.view(4, num_heads, head_size), expected, rtol=1e-5, atol=1e-5)
    q_inplace = q.clone()
    ops.rotary_embedding(positions, q_inplace, None, table, head_size, is_neox=True)
    torch.testing.assert_close(q_inplace, rq)
    with pytest.raises(IndexError):
        ops.rotary_embedding_ref(torch.tensor([300]), q[:1], None, table, head_size, True)


def test_prefill_row_tiles() -> None:
    assert set(PREFILL_BLOCK_M) == set(PREFILL_VARIANTS)
    for block_m in PREFILL_BLOCK_M.values():
        assert block_m == {64: 128, 128: 128, 256: 64}
    assert prefill_row_tiles([1, 64, 65, 0, 128], 64) == 1 + 1 + 2 + 0 + 2
    assert prefill_row_tiles([1, 128, 129, 0], PREFILL_BLOCK_M["mma_sm80"][128]) == 1 + 1 + 2 + 0
    assert prefill_row_tiles([1, 128, 129, 0], PREFILL_BLOCK_M["wmma"][256]) == 1 + 2 + 3 + 0


def test_prefill_kernel_selection(monkeypatch: pytest.MonkeyPatch) -> None:
    """The device's compute capability picks the prefill kernel; `variant=` names one; no environment."""
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr("voltllm.ops.attention._capability", lambda index: (9, 0))
    assert prefill_variant(cuda) == "mma_sm80" and prefill_variants(cuda) == ("mma_sm80", "wmma")
    monkeypatch.setattr("voltllm.ops.attention._capability", lambda index: (7, 0))  # Volta
    assert prefill_variant(cuda) == "wmma" and prefill_variants(cuda) == ("wmma",)
    assert prefill_variant(cuda, "mma_sm80") == "mma_sm80"  # named: the glue refuses it below SM80, loudly
    monkeypatch.setenv("VOLTLLM_PREFILL_KERNEL", "mma_sm80")  # read by nothing any more
    assert prefill_variant(cuda) == "wmma"
    cpu = torch.device("cpu")
    assert not runs_sm80_kernels(cpu) and prefill_variant(cpu) == "wmma"
    # Revision names are gone (v8 / v9), as is the retired v6 prefill: asking names the variants there are.
    for old in ("v6", "v8", "v9"):
        with pytest.raises(ValueError, match=rf"'{old}'; known: \('mma_sm80', 'wmma'\)"):
            prefill_variant(cpu, old)


@pytest.mark.parametrize("prefill", [*PREFILL_VARIANTS, None])
def test_every_variant_runs_the_reference_on_cpu(prefill: str | None) -> None:
    gen = torch.Generator().manual_seed(4)
    seq_lens = [3, 40]
    kv_cache, block_tables = _paged(seq_lens, 2, 16, gen)
    query = torch.randn(2, 8, 16, generator=gen)
    out = ops.paged_decode_attention(query, kv_cache, block_tables, torch.tensor(seq_lens), seq_lens, 0.25)
    expected = ops.paged_attention_ref(query, kv_cache, block_tables, [1, 1], seq_lens, 0.25)
    torch.testing.assert_close(out, expected)
    qsl = torch.tensor([0, 1, 2], dtype=torch.int32)
    lens = torch.tensor(seq_lens)
    out = ops.paged_prefill_attention(
        query, kv_cache, block_tables, lens, qsl, [1, 1], seq_lens, 0.25, variant=prefill
    )
    torch.testing.assert_close(out, expected)
