"""The decode attention kernel's fusions on a GPU: the attention prologue folded in
(`paged_decode_attention_prologue` against `qk_norm_rope_kv_write` + `paged_decode_attention`), the
in-kernel split merge (merge tickets) against the split-merge kernel, and each sequence split by its own
length inside a CUDA graph captured for a longer one."""

from __future__ import annotations

import math
import random

import pytest
import torch

from voltllm import ops
from voltllm.ops.attention import DECODE_MERGES, TICKET_MERGE_MAX_SPLITS, merge_tickets

pytestmark = pytest.mark.gpu

DEVICE = "cuda"
REL_TOL = {torch.float16: 4e-3, torch.bfloat16: 2e-2}


def _dtypes() -> list[torch.dtype]:
    if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 8:
        return [torch.float16, torch.bfloat16]
    return [torch.float16]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all(), "output has NaN/inf: an element was not written"
    return float((out.double() - ref.double()).norm() / ref.double().norm())


class DecodeLayer:
    """One decoder layer's decode step inputs: a qkv projection row per sequence, the rotary table, the
    optional q/k norm weights and a paged cache (shuffled blocks) whose newest slots hold NaN."""

    def __init__(
        self,
        seq_lens: list[int],
        num_heads: int,
        num_kv_heads: int,
        head: int,
        dtype: torch.dtype,
        norm: bool,
        seed: int,
    ) -> None:
        gen = torch.Generator(device=DEVICE).manual_seed(seed)
        rng = random.Random(seed)
        self.seq_lens, self.num_heads, self.head = seq_lens, num_heads, head
        blocks = [-(-s // 16) for s in seq_lens]
        num_blocks = sum(blocks) + 3
        perm = list(range(num_blocks))
        rng.shuffle(perm)
        tables = torch.zeros(len(seq_lens), max(blocks) + 1, dtype=torch.int32)
        used = 0
        for i, n in enumerate(blocks):
            tables[i, :n] = torch.tensor(perm[used : used + n], dtype=torch.int32)
            used += n
        self.block_tables = tables.to(DEVICE)
        self.seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
        slots = [int(tables[i, (s - 1) // 16]) * 16 + (s - 1) % 16 for i, s in enumerate(seq_lens)]
        self.slot_mapping = torch.tensor(slots, dtype=torch.int64, device=DEVICE)
        self.positions = torch.tensor([s - 1 for s in seq_lens], dtype=torch.int64, device=DEVICE)
        self.kv_cache = torch.randn(2, num_blocks, 16, num_kv_heads, head, generator=gen, device=DEVICE).to(
            dtype
        )
        self.kv_cache.view(2, -1, num_kv_heads, head)[:, self.slot_mapping] = float("nan")
        width = (num_heads + 2 * num_kv_heads) * head
        self.qkv = (torch.randn(len(seq_lens), width, generator=gen, device=DEVICE) * 2).to(dtype)
        inv_freq = 1.0 / (1e6 ** (torch.arange(0, head, 2, device=DEVICE).float() / head))
        self.cos_sin = ops.cos_sin_cache(inv_freq, 40960, DEVICE)
        weights = [(1 + 0.2 * torch.randn(head, generator=gen, device=DEVICE)).to(dtype) for _ in range(2)]
        self.q_weight, self.k_weight = weights if norm else (None, None)
        self.scale = 1 / math.sqrt(head)

    def unfused(self, kv_cache: torch.Tensor, qkv: torch.Tensor, merge: str = "kernel") -> torch.Tensor:
        """The prologue kernel, then decode attention over the cache it wrote."""
        ops.qk_norm_rope_kv_write(
            qkv, self.positions, self.cos_sin, self.q_weight, self.k_weight, 1e-6, self.num_heads, kv_cache,
            self.slot_mapping,
        )  # fmt: skip
        query = qkv[:, : self.num_heads * self.head].view(-1, self.num_heads, self.head)
        return ops.paged_decode_attention(
            query, kv_cache, self.block_tables, self.seq_lens_t, self.seq_lens, self.scale, merge=merge
        )

    def fused(
        self,
        kv_cache: torch.Tensor,
        merge: str = "auto",
        out: torch.Tensor | None = None,
        max_len: int | None = None,
        l2_prefetch: tuple[torch.Tensor, ...] = (),
    ) -> torch.Tensor:
        out = torch.full((len(self.seq_lens), self.num_heads, self.head), float("nan"), device=DEVICE,
                         dtype=self.qkv.dtype) if out is None else out  # fmt: skip
        return ops.paged_decode_attention_prologue(
            self.qkv, self.positions, self.cos_sin, self.q_weight, self.k_weight, 1e-6, self.num_heads,
            kv_cache, self.slot_mapping, self.block_tables, self.seq_lens_t,
            [max_len] if max_len else self.seq_lens, self.scale, out=out, merge=merge,
            l2_prefetch=l2_prefetch,
        )  # fmt: skip


@pytest.mark.parametrize("dtype", _dtypes())
@pytest.mark.parametrize(
    "head,num_heads,num_kv_heads,norm",
    [(128, 16, 8, True), (128, 32, 8, False), (64, 8, 2, True), (256, 8, 1, False), (128, 64, 4, True)],
)
@pytest.mark.parametrize("seq_lens", [[265], [1, 17, 300, 4000, 64, 1024, 33], [8192] * 3])
def test_prologue_folded_into_decode_matches_the_unfused_pair(
    dtype, head, num_heads, num_kv_heads, norm, seq_lens
):
    """Same cache contents and the same attention (to rounding of the merge order) as the prologue kernel
    followed by the decode kernel; qkv is left as it was."""
    layer = DecodeLayer(seq_lens, num_heads, num_kv_heads, head, dtype, norm, seed=len(seq_lens) + head)
    qkv_before = layer.qkv.clone()
    ref_cache, ref_qkv = layer.kv_cache.clone(), layer.qkv.clone()
    reference = layer.unfused(ref_cache, ref_qkv)
    cache = layer.kv_cache.clone()
    out = layer.fused(cache)
    assert torch.equal(layer.qkv, qkv_before)
    assert torch.equal(cache[1], ref_cache[1])  # values are copied
    torch.testing.assert_close(
        cache[0], ref_cache[0], rtol=2e-3, atol=2e-3
    )  # keys: the same norm and rotation
    assert rel_err(out, reference.float()) < REL_TOL[dtype] / 4


@pytest.mark.parametrize("merge", DECODE_MERGES)
@pytest.mark.parametrize("seq_lens", [[300], [32768], [8192] * 16, [17, 5000, 1, 700]])
def test_every_split_merge_gives_the_reference(merge: str, seq_lens: list[int]) -> None:
    """Merged by the split-merge kernel, by the last split block (tickets, up to 64 splits at 1 x 32k) or as
    `auto` picks: the reference attention, and every ticket back at 0."""
    layer = DecodeLayer(seq_lens, 16, 8, 128, torch.float16, True, seed=len(seq_lens))
    cache = layer.kv_cache.clone()
    out = layer.fused(cache, merge=merge)
    query = layer.qkv.clone()
    ops.qk_norm_rope_kv_write(
        query, layer.positions, layer.cos_sin, layer.q_weight, layer.k_weight, 1e-6, 16, layer.kv_cache,
        layer.slot_mapping,
    )  # fmt: skip
    query = query[:, : 16 * 128].view(-1, 16, 128)
    reference = ops.paged_attention_ref(
        query, layer.kv_cache, layer.block_tables, [1] * len(seq_lens), seq_lens, layer.scale
    )
    assert rel_err(out, reference) < REL_TOL[torch.float16]
    torch.cuda.synchronize()
    assert (merge_tickets(torch.device(DEVICE), 1) == 0).all()


def test_fused_decode_graph_replays_with_other_lengths() -> None:
    """Captured with max_seq_len 8192 (a graph for max_model_len), replayed with short and long device
    lengths: each sequence splits by its own length and the output is the reference each time. (Every
    row owns blocks for 8192 positions, so no sequence's newest slot lies in another's context.)"""
    layer = DecodeLayer([8192] * 4, 32, 8, 128, torch.float16, False, seed=5)
    out = torch.full((4, 32, 128), float("nan"), device=DEVICE, dtype=torch.float16)
    cache = layer.kv_cache.clone()
    layer.fused(cache, out=out, max_len=8192)  # eager warm-up, as the engine does before capturing
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        layer.fused(cache, out=out, max_len=8192)
    for lens in ([8192, 100, 1, 2500], [17, 3000, 1, 300], [1, 1, 1, 1], [257, 256, 513, 8000]):
        layer.seq_lens_t.copy_(torch.tensor(lens, dtype=torch.int32))
        slots = [int(layer.block_tables[i, (s - 1) // 16]) * 16 + (s - 1) % 16 for i, s in enumerate(lens)]
        layer.slot_mapping.copy_(torch.tensor(slots))
        layer.positions.copy_(torch.tensor([s - 1 for s in lens]))
        out.fill_(float("nan"))
        graph.replay()
        query, ref_cache = layer.qkv.clone(), cache.clone()
        ops.qk_norm_rope_kv_write(
            query, layer.positions, layer.cos_sin, None, None, 0.0, 32, ref_cache, layer.slot_mapping
        )
        reference = ops.paged_attention_ref(
            query[:, : 32 * 128].view(4, 32, 128), ref_cache, layer.block_tables, [1] * 4, lens, layer.scale
        )
        assert rel_err(out, reference) < REL_TOL[torch.float16], lens


def test_padding_rows_write_nothing() -> None:
    """A slot of -1 (a CUDA graph's padding row) leaves the cache as it was."""
    layer = DecodeLayer([40, 1], 16, 8, 128, torch.float16, True, seed=9)
    layer.slot_mapping[1] = -1
    cache = layer.kv_cache.clone()
    cache.view(2, -1, 8, 128)[:, int(layer.block_tables[1, 0]) * 16] = 1.0  # what the padding row attends to
    before = cache.clone()
    layer.fused(cache)
    changed = (cache != before) & ~(cache.isnan() & before.isnan())
    flat = changed.view(2, -1, 8, 128).any(-1).any(-1).any(0)
    assert flat.nonzero().flatten().tolist() == [int(layer.slot_mapping[0])]


def test_bad_merge_and_tickets_are_refused() -> None:
    layer = DecodeLayer([40], 16, 8, 128, torch.float16, True, seed=2)
    with pytest.raises(ValueError, match=r"unknown decode merge 'last'"):
        layer.fused(layer.kv_cache.clone(), merge="last")
    query = layer.qkv[:, : 16 * 128].view(1, 16, 128)
    short = torch.zeros(3, dtype=torch.int32, device=DEVICE)
    with pytest.raises(RuntimeError, match="merge_tickets"):
        torch.ops.voltllm_C.paged_decode_attention(
            torch.empty_like(query), query, layer.kv_cache, layer.block_tables, layer.seq_lens_t, 40, 0.1, 0,
            256, short, TICKET_MERGE_MAX_SPLITS, [],
        )  # fmt: skip
    with pytest.raises(RuntimeError, match="min_split must be"):
        ops.paged_decode_attention(
            query, layer.kv_cache, layer.block_tables, layer.seq_lens_t, [40], 0.1, min_split=4
        )
    with pytest.raises(RuntimeError, match="qkv must be"):
        ops.paged_decode_attention_prologue(
            layer.qkv[:, :-8], layer.positions, layer.cos_sin, None, None, 0.0, 16, layer.kv_cache,
            layer.slot_mapping, layer.block_tables, layer.seq_lens_t, [40], 0.1,
        )  # fmt: skip


def _weights(*sizes: int) -> tuple[torch.Tensor, ...]:
    """fp16 tensors of these many elements (odd sizes: a last partial 128-byte line)."""
    return tuple(torch.randn(n, device=DEVICE).half() for n in sizes)


@pytest.mark.parametrize("seq_lens", [[265], [1, 17, 4000, 33], [8192]])
def test_l2_prefetch_changes_nothing_but_the_cache(seq_lens: list[int]) -> None:
    """Asking L2 for the next weights (a 17 MB o_proj-sized tensor, a small one of a partial line, and one
    past half the L2, which the glue cuts) leaves the output and the cache writes bit for bit as they
    were, eagerly and in a CUDA graph, on idle and working splits alike."""
    weights = _weights(8_388_608, 1_000_003, 64 << 20)
    layer = DecodeLayer(seq_lens, 32, 4, 128, torch.float16, True, seed=11)
    plain_cache = layer.kv_cache.clone()
    longest = layer.block_tables.shape[1] * 16  # a graph's grid: captured for the longest context
    plain = layer.fused(plain_cache, max_len=longest).clone()
    cache = layer.kv_cache.clone()
    assert torch.equal(layer.fused(cache, max_len=longest, l2_prefetch=weights), plain)
    assert torch.equal(cache.nan_to_num(), plain_cache.nan_to_num())
    out = torch.full_like(plain, float("nan"))
    graph_cache = layer.kv_cache.clone()
    layer.fused(graph_cache, out=out, max_len=longest, l2_prefetch=weights)  # warm-up, as the engine does
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        layer.fused(graph_cache, out=out, max_len=longest, l2_prefetch=weights)
    out.fill_(float("nan"))
    graph.replay()
    assert torch.equal(out, plain)


def test_bad_l2_prefetch_is_refused() -> None:
    """More tensors than the kernel takes, a host tensor, a strided one or one not 16-byte aligned: a
    RuntimeError naming it."""
    layer = DecodeLayer([40], 16, 8, 128, torch.float16, True, seed=3)
    with pytest.raises(RuntimeError, match="at most 4 l2_prefetch tensors, got 5"):
        layer.fused(layer.kv_cache.clone(), l2_prefetch=_weights(*[256] * 5))
    with pytest.raises(RuntimeError, match="l2_prefetch tensor must be a CUDA tensor"):
        layer.fused(layer.kv_cache.clone(), l2_prefetch=(torch.zeros(64),))
    with pytest.raises(RuntimeError, match="l2_prefetch tensors must be contiguous"):
        layer.fused(layer.kv_cache.clone(), l2_prefetch=(torch.zeros(64, 64, device=DEVICE).t(),))
    with pytest.raises(RuntimeError, match="l2_prefetch tensors must start 16-byte aligned"):
        layer.fused(layer.kv_cache.clone(), l2_prefetch=(torch.zeros(64, device=DEVICE).half()[1:],))
