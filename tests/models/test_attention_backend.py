"""TorchAttentionBackend against dense attention computed independently (SDPA with an explicit mask);
the attention layer's prologue (q/k norm, rotary) run by its backend."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from paged_batch import PagedBatch

from voltllm.layers.attention import (
    Attention,
    AttentionPrologue,
    AttentionSpec,
    TorchAttentionBackend,
    available_attention_backends,
    get_attention_backend,
)
from voltllm.layers.attention.backend import split_qkv
from voltllm.layers.norm import RMSNorm
from voltllm.layers.rotary import RotaryEmbedding

NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE, NUM_BLOCKS = 4, 2, 16, 4, 48


def _dense_reference(spec: AttentionSpec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q: [query_len, H, D], the last query_len positions of a context k/v: [seq_len, KV, D]."""
    query_len, seq_len = q.shape[0], k.shape[0]
    q_pos = torch.arange(seq_len - query_len, seq_len)[:, None]
    k_pos = torch.arange(seq_len)[None, :]
    mask = k_pos <= q_pos
    if spec.sliding_window is not None:
        mask &= q_pos - k_pos < spec.sliding_window
    rep = spec.num_queries_per_kv
    out = F.scaled_dot_product_attention(
        q.double().transpose(0, 1),
        k.double().repeat_interleave(rep, dim=1).transpose(0, 1),
        v.double().repeat_interleave(rep, dim=1).transpose(0, 1),
        attn_mask=mask,
        scale=spec.scale,
    )
    return out.transpose(0, 1)


@pytest.mark.parametrize("sliding_window", [None, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_matches_dense(sliding_window: int | None, dtype: torch.dtype) -> None:
    spec = AttentionSpec(NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, HEAD_SIZE**-0.5, sliding_window)
    backend = TorchAttentionBackend()
    gen = torch.Generator().manual_seed(0)
    kv_cache = torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE, dtype=dtype)
    batch = PagedBatch(3, NUM_BLOCKS, BLOCK_SIZE)
    keys: list[list[torch.Tensor]] = [[], [], []]
    values: list[list[torch.Tensor]] = [[], [], []]

    # A prefill step, then a mixed step: two decodes and a 6-token chunk after a cached prefix.
    for query_lens in ([9, 3, 14], [1, 6, 1]):
        metadata = batch.step(query_lens)
        n = sum(query_lens)
        q = torch.randn(n, NUM_HEADS, HEAD_SIZE, generator=gen).to(dtype)
        k = torch.randn(n, NUM_KV_HEADS, HEAD_SIZE, generator=gen).to(dtype)
        v = torch.randn(n, NUM_KV_HEADS, HEAD_SIZE, generator=gen).to(dtype)
        out = backend.forward(spec, q, k, v, kv_cache, metadata)
        assert out.shape == q.shape and out.dtype == dtype

        start = 0
        for i, query_len in enumerate(query_lens):
            rows = slice(start, start + query_len)
            keys[i].append(k[rows])
            values[i].append(v[rows])
            expected = _dense_reference(spec, q[rows], torch.cat(keys[i]), torch.cat(values[i]))
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            torch.testing.assert_close(out[rows].double(), expected, atol=tol, rtol=tol)
            start += query_len


def test_slot_minus_one_is_not_written() -> None:
    spec = AttentionSpec(NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, 1.0)
    kv_cache = torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE)
    metadata = PagedBatch(1, NUM_BLOCKS, BLOCK_SIZE).step([3])
    slots = metadata.slot_mapping.clone()
    slots[1] = -1
    metadata = type(metadata)(**{**metadata.__dict__, "slot_mapping": slots})
    k = torch.randn(3, NUM_KV_HEADS, HEAD_SIZE)
    v = torch.randn(3, NUM_KV_HEADS, HEAD_SIZE)
    TorchAttentionBackend().forward(spec, torch.randn(3, NUM_HEADS, HEAD_SIZE), k, v, kv_cache, metadata)
    flat_k = kv_cache[0].view(-1, NUM_KV_HEADS, HEAD_SIZE)
    torch.testing.assert_close(flat_k[slots[0]], k[0])
    torch.testing.assert_close(flat_k[slots[2]], k[2])
    assert int((flat_k.abs().sum(dim=(1, 2)) != 0).sum()) == 2  # nothing else was touched


def test_rejects_inconsistent_metadata() -> None:
    spec = AttentionSpec(NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, 1.0)
    kv_cache = torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE)
    metadata = PagedBatch(1, NUM_BLOCKS, BLOCK_SIZE).step([3])
    q = torch.randn(4, NUM_HEADS, HEAD_SIZE)  # one row more than the metadata describes
    kv = torch.randn(4, NUM_KV_HEADS, HEAD_SIZE)
    with pytest.raises(ValueError, match="query tokens"):
        TorchAttentionBackend().forward(spec, q, kv, kv, kv_cache, metadata)


def test_selector() -> None:
    assert isinstance(get_attention_backend("torch", "cpu"), TorchAttentionBackend)
    assert isinstance(get_attention_backend("auto", "cpu"), TorchAttentionBackend)
    assert {"auto", "torch", "sm70"} <= set(available_attention_backends())
    with pytest.raises(ValueError, match="unknown attention backend"):
        get_attention_backend("flash", "cpu")
    with pytest.raises(RuntimeError, match="CUDA"):
        get_attention_backend("sm70", "cpu")


def test_auto_passes_over_kernels_without_the_head_size(caplog: pytest.LogCaptureFixture) -> None:
    # Decided before any CUDA call, so it runs without a GPU: the kernels have no head size 80.
    with caplog.at_level(logging.WARNING, logger="voltllm.layers.attention.selector"):
        backend = get_attention_backend("auto", "cuda", head_size=80)
    assert isinstance(backend, TorchAttentionBackend)
    assert "no head size 80" in caplog.text


def test_attention_layer_runs_the_prologue_through_its_backend() -> None:
    """`Attention` hands the fused qkv projection to `forward_qkv`: q/k norm, rotary, cache write and
    attention equal the layers applied one by one before `forward`."""
    gen = torch.Generator().manual_seed(3)
    spec = AttentionSpec(NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, HEAD_SIZE**-0.5)
    rotary = RotaryEmbedding(HEAD_SIZE, {"rope_type": "default", "rope_theta": 1e4}, 64)
    q_norm, k_norm = RMSNorm(HEAD_SIZE), RMSNorm(HEAD_SIZE)
    with torch.no_grad():
        q_norm.weight.copy_(1 + 0.2 * torch.randn(HEAD_SIZE, generator=gen))
        k_norm.weight.copy_(1 + 0.2 * torch.randn(HEAD_SIZE, generator=gen))
    layer = Attention(spec, TorchAttentionBackend(), rotary, q_norm, k_norm)
    assert not list(layer.parameters())  # the norms stay the model's: names as in the checkpoint

    metadata = PagedBatch(2, NUM_BLOCKS, BLOCK_SIZE).step([5, 3])
    positions = torch.tensor([0, 1, 2, 3, 4, 0, 1, 2])
    qkv = torch.randn(8, (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_SIZE, generator=gen)
    cache, expected_cache = (
        torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE) for _ in range(2)
    )
    out = layer(positions, qkv.clone(), cache, metadata)

    q, k, v = split_qkv(spec, qkv)
    q, k = rotary(positions, q_norm(q), k_norm(k))
    expected = TorchAttentionBackend().forward(spec, q, k, v, expected_cache, metadata)
    assert torch.equal(out, expected.reshape(8, -1))
    assert torch.equal(cache, expected_cache)
    with pytest.raises(ValueError, match="come together"):
        AttentionPrologue(rotary, q_norm, None)


def test_sm70_fuses_the_prologue_where_its_kernel_applies() -> None:
    from voltllm.layers.attention.sm70 import SM70AttentionBackend

    applies = SM70AttentionBackend._fused_prologue_applies
    spec = AttentionSpec(NUM_HEADS, NUM_KV_HEADS, 64, 0.125)
    with_rope = AttentionPrologue(RotaryEmbedding(64, {"rope_type": "default", "rope_theta": 1e4}, 64))
    half = torch.zeros(1, 8, dtype=torch.float16)
    assert applies(spec, with_rope, half, half)
    assert not applies(spec, with_rope, half.float(), half.float())  # fp32: norm + rope + write
    assert not applies(spec, with_rope, half, half.bfloat16())  # the cache in another dtype
    assert not applies(spec, AttentionPrologue(), half, half)  # nothing to rotate
    assert not applies(AttentionSpec(NUM_HEADS, NUM_KV_HEADS, 80, 0.1), with_rope, half, half)
