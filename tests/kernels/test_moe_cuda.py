"""The mixture-of-experts kernels on a CUDA GPU (skipped without one), against their torch definitions,
with fresh random inputs every run: the fused top-k softmax against `topk_softmax_ref`, and the whole
expert pipeline (`fused_moe`: align, gated stage, down stage, combine) by both kernels, the decode GEMV
and the tensor-core grouped GEMM, and the pair-by-pair decode path, against the torch form of the
experts in fp32, for 1 to 8,192 tokens,
top-k 1, 2 and 8, an expert that gets no token and every token routed to the same experts; then the
decode step captured in a CUDA graph replaying fresh routings."""

from __future__ import annotations

import pytest
import torch
from cuda_graphs import capture

from voltllm.layers.fused_moe import experts_grouped
from voltllm.ops._dispatch import kernel_ops
from voltllm.ops.moe import (
    PAIR_DOWN_STAGED_CHUNKS,
    PAIRS_MAX_TOKENS,
    fused_moe,
    fused_moe_applies,
    fused_moe_pairs,
    moe_align,
    moe_tile_rows,
    topk_softmax,
    topk_softmax_ref,
    use_grouped_gemm,
)

pytestmark = pytest.mark.gpu


def _generator() -> torch.Generator:
    return torch.Generator(device="cuda").manual_seed(int(torch.randint(0, 2**31, ())))


def _distinct_logits(
    num_tokens: int, num_experts: int, gen: torch.Generator, dtype: torch.dtype
) -> torch.Tensor:
    """Logits that fp16 and bf16 hold exactly and distinct (up to 512 experts): a fresh permutation of
    multiples of 1/64 in [-4, 4) per row, so that the ranking has no ties."""
    ranks = torch.rand(num_tokens, num_experts, device="cuda", generator=gen).argsort(dim=1)
    return (ranks.float() / 64 - num_experts / 128).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 7, 8192])
@pytest.mark.parametrize("num_experts,top_k", [(8, 2), (60, 4), (128, 8), (128, 1), (512, 32)])
@pytest.mark.parametrize("renormalize", [True, False])
def test_topk_softmax_matches_its_definition(dtype, num_tokens, num_experts, top_k, renormalize):
    logits = _distinct_logits(num_tokens, num_experts, _generator(), dtype)
    weights, ids = topk_softmax(logits, top_k, renormalize)
    assert ids.dtype == torch.int32
    ref_weights, ref_ids = topk_softmax_ref(logits, top_k, renormalize)
    assert torch.equal(ids.long(), ref_ids)
    torch.testing.assert_close(weights, ref_weights, atol=1e-6, rtol=1e-5)


def _weights(num_experts: int, hidden: int, inter: int, dtype: torch.dtype, gen: torch.Generator):
    w13 = (torch.randn(num_experts, 2 * inter, hidden, device="cuda", generator=gen) / hidden**0.5).to(dtype)
    w2 = (torch.randn(num_experts, hidden, inter, device="cuda", generator=gen) / inter**0.5).to(dtype)
    return w13, w2


def _routing(kind: str, num_tokens: int, num_experts: int, gen: torch.Generator, dtype: torch.dtype):
    logits = torch.randn(num_tokens, num_experts, device="cuda", generator=gen)
    if kind == "idle expert":
        logits[:, 0] = -1e4  # never among anyone's top k
    elif kind == "all to one":
        logits[:, 3] += 1e4  # everyone's first choice
    return logits.to(dtype)


def _check_pipeline(x, w13, w2, logits, top_k, renormalize, grouped_gemm):
    assert fused_moe_applies(x, w13, w2, top_k)
    weights, ids = topk_softmax(logits, top_k, renormalize)
    got = fused_moe(x, w13, w2, weights, ids, grouped_gemm=grouped_gemm)
    expected = experts_grouped(x.float(), w13.float(), w2.float(), weights, ids.long())
    tol = 2e-2 if x.dtype == torch.float16 else 6e-2
    torch.testing.assert_close(got.float(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("grouped_gemm", [False, True])
@pytest.mark.parametrize("num_tokens", [1, 2, 8, 64, 257, 1024, 8192])
@pytest.mark.parametrize("top_k", [1, 2, 8])
@pytest.mark.parametrize("kind", ["random", "idle expert", "all to one"])
def test_fused_moe_matches_the_torch_form(grouped_gemm, num_tokens, top_k, kind):
    gen = _generator()
    num_experts, hidden, inter = 64, 256, 96  # a partial 64-wide column block in the gated stage
    w13, w2 = _weights(num_experts, hidden, inter, torch.float16, gen)
    x = torch.randn(num_tokens, hidden, device="cuda", generator=gen).half()
    logits = _routing(kind, num_tokens, num_experts, gen, torch.float16)
    _check_pipeline(x, w13, w2, logits, top_k, kind != "random" or num_tokens % 2 == 0, grouped_gemm)


@pytest.mark.parametrize("down_chunks", [0, PAIR_DOWN_STAGED_CHUNKS[-1]])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 2, 3, 8, 16])
@pytest.mark.parametrize("top_k", [1, 5, 8])
@pytest.mark.parametrize("kind", ["random", "idle expert", "all to one"])
def test_pair_path_matches_the_torch_form(down_chunks, dtype, num_tokens, top_k, kind):
    # hidden 1048 = 4 * 256 + 24: the gated stage's rows end inside a 4-chunk step; the down stage's
    # k of 40 inside its first chunk (the staged kernel's 32-chunk steps cross several rows); top-k 5
    # leaves a partial round of the unstaged kernel's 4 pairs in flight.
    gen = _generator()
    num_experts, hidden, inter = 16, 1048, 40
    w13, w2 = _weights(num_experts, hidden, inter, dtype, gen)
    x = torch.randn(num_tokens, hidden, device="cuda", generator=gen).to(dtype)
    logits = _routing(kind, num_tokens, num_experts, gen, dtype)
    weights, ids = topk_softmax(logits, top_k, kind != "random")
    got = fused_moe_pairs(x, w13, w2, weights, ids, down_chunks)
    expected = experts_grouped(x.float(), w13.float(), w2.float(), weights, ids.long())
    tol = 2e-2 if dtype == torch.float16 else 6e-2
    torch.testing.assert_close(got.float(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("down_chunks", PAIR_DOWN_STAGED_CHUNKS)
@pytest.mark.parametrize("num_tokens", [1, 8, 16])
def test_staged_pair_down_agrees_with_the_unstaged_kernel(down_chunks, num_tokens):
    """The Qwen3-30B-A3B down stage (128 experts of 768 -> 2048, top-8) by each kernel on the same act:
    the same fp32 sum in another order, so within one rounding of the fp16 output."""
    gen = _generator()
    _, w2 = _weights(128, 2048, 768, torch.float16, gen)
    act = torch.randn(num_tokens * 8, 768, device="cuda", generator=gen).half()
    weights, ids = topk_softmax(_routing("random", num_tokens, 128, gen, torch.float16), 8, True)
    outs = []
    for chunks in (0, down_chunks):
        out = torch.empty(num_tokens, 2048, dtype=torch.float16, device="cuda")
        kernel_ops().moe_pair_experts(out, act, w2, ids, weights, False, chunks)
        outs.append(out.float())
    expected = torch.einsum("pk,pnk->pn", act.float(), w2.float()[ids.flatten().long()])
    expected = (expected.view(num_tokens, 8, 2048) * weights[..., None]).sum(dim=1)
    for out in outs:
        torch.testing.assert_close(out, expected, atol=4e-3, rtol=4e-3)
    torch.testing.assert_close(outs[1], outs[0], atol=4e-3, rtol=4e-3)


def test_moe_pair_experts_refuses_an_unknown_down_variant():
    gen = _generator()
    w13, w2 = _weights(16, 256, 96, torch.float16, gen)
    weights, ids = topk_softmax(_routing("random", 1, 16, gen, torch.float16), 2, True)
    act = torch.randn(2, 96, device="cuda", generator=gen).half()
    out = torch.empty(1, 256, dtype=torch.float16, device="cuda")
    for dropped in (16, 24):  # 24: the staged kernel's other A/B candidate, dropped (issue 17)
        with pytest.raises(RuntimeError, match="down_chunks must be 0"):
            kernel_ops().moe_pair_experts(out, act, w2, ids, weights, False, dropped)
    x = torch.randn(1, 256, device="cuda", generator=gen).half()
    with pytest.raises(RuntimeError, match="down stage only"):
        kernel_ops().moe_pair_experts(act, x, w13, ids, weights, True, PAIR_DOWN_STAGED_CHUNKS[0])


def test_fused_moe_runs_pair_by_pair_up_to_the_threshold(monkeypatch):
    import voltllm.ops.moe as moe_ops

    calls = []
    monkeypatch.setattr(moe_ops, "fused_moe_pairs", lambda *a: calls.append(a[0].shape[0]) or a[0])
    gen = _generator()
    w13, w2 = _weights(16, 256, 96, torch.float16, gen)
    for num_tokens in (1, PAIRS_MAX_TOKENS, PAIRS_MAX_TOKENS + 1):
        x = torch.randn(num_tokens, 256, device="cuda", generator=gen).half()
        weights, ids = topk_softmax(_routing("random", num_tokens, 16, gen, torch.float16), 2, True)
        moe_ops.fused_moe(x, w13, w2, weights, ids)
    assert calls == [1, PAIRS_MAX_TOKENS]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("num_tokens", [1, 64, 2048])
def test_fused_moe_on_the_qwen3_30b_a3b_expert_shape(dtype, renormalize, num_tokens):
    """128 experts of 2048 -> 768 -> 2048, top-8, by the path `use_grouped_gemm` picks."""
    gen = _generator()
    w13, w2 = _weights(128, 2048, 768, dtype, gen)
    x = torch.randn(num_tokens, 2048, device="cuda", generator=gen).to(dtype)
    logits = _routing("random", num_tokens, 128, gen, dtype)
    _check_pipeline(x, w13, w2, logits, 8, renormalize, None)


def test_align_fills_the_tiles_in_use_only():
    gen = _generator()
    ids = torch.randint(0, 16, (37, 4), device="cuda", generator=gen, dtype=torch.int32)
    for grouped_gemm in (False, True):
        rows = moe_tile_rows(grouped_gemm)
        sorted_pair_ids, tile_experts, num_tiles = moe_align(ids, 16, rows)
        counts = torch.bincount(ids.flatten().long(), minlength=16)
        used = int(num_tiles.item())
        assert used == int(((counts + rows - 1) // rows).sum())
        slots = sorted_pair_ids[: used * rows]
        assert torch.equal(slots[slots >= 0].sort().values.long(), torch.arange(ids.numel(), device="cuda"))
        assert torch.equal(tile_experts[:used].long(), torch.repeat_interleave(
            torch.arange(16, device="cuda"), (counts + rows - 1) // rows))  # fmt: skip


def test_use_grouped_gemm_follows_the_pairs_per_expert():
    device = torch.device("cuda")
    assert not use_grouped_gemm(8, 128, torch.float16, device)  # batch-1 decode
    assert not use_grouped_gemm(128, 128, torch.float16, device)  # batch-16 decode
    assert use_grouped_gemm(512, 128, torch.float16, device)  # batch-64 decode
    assert use_grouped_gemm(8192 * 8, 128, torch.float16, device)  # prefill


@pytest.mark.parametrize("num_tokens", [1, 8, 64, 256])
def test_fused_moe_captures_in_a_cuda_graph(num_tokens):
    gen = _generator()
    w13, w2 = _weights(128, 256, 128, torch.float16, gen)
    x = torch.randn(num_tokens, 256, device="cuda", generator=gen).half()
    logits = torch.randn(num_tokens, 128, device="cuda", generator=gen).half()

    def step():
        weights, ids = topk_softmax(logits, 8, True)
        return fused_moe(x, w13, w2, weights, ids)

    with torch.inference_mode():
        graph, out = capture(step)
        for _ in range(2):  # fresh inputs and routings replay into the same buffers
            x.copy_(torch.randn(num_tokens, 256, device="cuda", generator=gen))
            logits.copy_(torch.randn(num_tokens, 128, device="cuda", generator=gen))
            graph.replay()
            weights, ids = topk_softmax_ref(logits, 8, True)
            expected = experts_grouped(x.float(), w13.float(), w2.float(), weights, ids)
            torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)
