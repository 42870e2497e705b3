"""Quantized experts on a CUDA GPU (skipped without one): `fused_moe_quantized`'s two paths (pair by
pair, the stacks dequantized for the fp16 expert kernels) against `dequantize` then the torch
grouped form of the experts in fp32, for every packed kind, bit width, group size and act-order
(tests/kernels/quant_cases.py), 1 to 2,048 tokens, top-k 1, 2 and 8, an expert that gets no token and
every token routed to the same experts; fresh random weights and inputs every run. Then the decode step
captured in a CUDA graph replaying fresh routings, and the Qwen3-30B-A3B expert shape."""

from __future__ import annotations

import pytest
import torch
from cuda_graphs import capture
from emulator import fresh_generator
from quant_cases import CASES, QuantCase, make_weight

from voltllm.layers.fused_moe import experts_grouped
from voltllm.layers.quantization.quantized_weight import dequantize
from voltllm.ops.moe import topk_softmax, topk_softmax_ref
from voltllm.ops.moe_quantized import (
    QUANT_PAIRS_MAX_TOKENS,
    dequantize_experts,
    fused_moe_quantized,
    fused_moe_quantized_applies,
    pack_experts,
    quantized_path,
)

pytestmark = pytest.mark.gpu


def _cases(*names: str) -> list[QuantCase]:
    return [c for c in CASES if c.name in names]


def _experts(case: QuantCase, num_experts: int, hidden: int, inter: int, gen: torch.Generator):
    """`(packed w13, packed w2, dense w13, dense w2)`: the dense stacks are `dequantize`'s fp32 values."""
    w13 = [make_weight(case, 2 * inter, hidden, gen, "cuda") for _ in range(num_experts)]
    w2 = [make_weight(case, hidden, inter, gen, "cuda") for _ in range(num_experts)]
    dense13 = torch.stack([dequantize(w, torch.float16) for w in w13]).float()
    dense2 = torch.stack([dequantize(w, torch.float16) for w in w2]).float()
    return pack_experts(w13), pack_experts(w2), dense13, dense2


def _inputs(num_tokens: int, dense13: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """fp16 `[num_tokens, hidden]` inputs scaled so that the projections are a few units: 8-bit codes
    (weights up to ~2.5) on unit inputs would overflow fp16 in the down stage."""
    hidden = dense13.shape[2]
    scale = 2.0 / (float(dense13.pow(2).mean().sqrt()) * hidden**0.5)
    return (torch.randn(num_tokens, hidden, generator=gen) * scale).half().cuda()


def _logits(kind: str, num_tokens: int, num_experts: int, gen: torch.Generator) -> torch.Tensor:
    logits = torch.randn(num_tokens, num_experts, generator=gen)
    if kind == "idle expert":
        logits[:, 0] = -1e4  # never among anyone's top k
    elif kind == "all to one":
        logits[:, 3] += 1e4  # everyone's first choice
    return logits.half().cuda()


def _check(x, w13, w2, dense13, dense2, logits, top_k, path, seed):
    assert fused_moe_quantized_applies(x, w13, w2, top_k)
    weights, ids = topk_softmax(logits, top_k, True)
    got = fused_moe_quantized(x, w13, w2, weights, ids, path=path)
    expected = experts_grouped(x.float(), dense13, dense2, weights, ids.long())
    tol = 2e-3 * float(expected.abs().max()) + 2e-3
    torch.testing.assert_close(got.float(), expected, atol=tol, rtol=1e-2, msg=f"seed {seed}")


# hidden 2560: gate/up rows of 80 (4-bit) / 160 (8-bit) chunks, two and three steps of the GEMV loop, the
# last partial; expert width 384: down rows of 12 / 24 chunks, fewer than a warp's lanes.
NUM_EXPERTS, HIDDEN, INTER = 16, 2560, 384
# (tokens, path: one of PATHS or None for `quantized_path`'s choice, top_k, routing)
SIZES = [
    (1, "pairs", 8, "random"),
    (3, "pairs", 1, "all to one"),
    (8, None, 8, "idle expert"),
    (64, "pairs", 8, "random"),
    (QUANT_PAIRS_MAX_TOKENS, None, 8, "all to one"),
    (5, "dequantized", 8, "idle expert"),
    (QUANT_PAIRS_MAX_TOKENS + 1, None, 8, "idle expert"),
    (1500, None, 2, "random"),
]


@pytest.fixture(scope="module", params=CASES, ids=lambda c: c.name)
def experts(request):
    """Each case's experts, drawn once per run (fresh every run)."""
    gen, seed = fresh_generator()
    return (*_experts(request.param, NUM_EXPERTS, HIDDEN, INTER, gen), seed)


@pytest.mark.parametrize(
    "num_tokens,path,top_k,kind", SIZES, ids=[f"{t}-{p}-top{k}-{r}" for t, p, k, r in SIZES]
)
def test_fused_moe_quantized_matches_dequantize_then_the_torch_form(experts, num_tokens, path, top_k, kind):
    w13, w2, dense13, dense2, seed = experts
    gen = torch.Generator().manual_seed(seed + num_tokens)
    x = _inputs(num_tokens, dense13, gen)
    _check(x, w13, w2, dense13, dense2, _logits(kind, num_tokens, NUM_EXPERTS, gen), top_k, path, seed)


@pytest.mark.parametrize(
    "case", _cases("int4-g128", "int8-g64-sym-actorder", "fp8-g128"), ids=lambda c: c.name
)
@pytest.mark.parametrize("num_tokens", [1, 64, 2048])
def test_quantized_experts_on_the_qwen3_30b_a3b_expert_shape(case, num_tokens):
    """Experts of 2048 -> 768 -> 2048, top-8 (16 of them: drawing 128 takes long on the host), by the
    path `quantized_path` picks: pairs at 1 and 64 tokens, dequantized at 2,048."""
    gen, seed = fresh_generator()
    w13, w2, dense13, dense2 = _experts(case, 16, 2048, 768, gen)
    x = _inputs(num_tokens, dense13, gen)
    _check(x, w13, w2, dense13, dense2, _logits("random", num_tokens, 16, gen), 8, None, seed)


@pytest.mark.parametrize("case", _cases("int4-g128", "int4-g128-actorder"), ids=lambda c: c.name)
def test_dequantize_experts_is_the_definition(case):
    gen, _ = fresh_generator()
    weights = [make_weight(case, 96, 256, gen, "cuda") for _ in range(3)]
    dense = dequantize_experts(pack_experts(weights))
    assert torch.equal(dense, torch.stack([dequantize(w, torch.float16) for w in weights]))


def test_quantized_path_follows_the_threshold():
    assert quantized_path(1) == quantized_path(QUANT_PAIRS_MAX_TOKENS) == "pairs"
    assert quantized_path(QUANT_PAIRS_MAX_TOKENS + 1) == "dequantized"


def test_fused_moe_quantized_refuses_what_it_does_not_take():
    gen, _ = fresh_generator()
    w13, w2, _, _ = _experts(CASES[0], 4, 64, 64, gen)
    x = torch.randn(2, 64, generator=gen).cuda()
    assert not fused_moe_quantized_applies(x.bfloat16(), w13, w2, 2)  # fp16 activations only
    assert not fused_moe_quantized_applies(x.half(), w13, w2, 5)  # top-k above the experts
    assert not fused_moe_quantized_applies(x.half()[:, :32], w13, w2, 2)  # hidden size mismatch
    weights, ids = topk_softmax(_logits("random", 2, 4, gen), 2, True)
    with pytest.raises(ValueError, match="int32 topk_ids"):
        fused_moe_quantized(x.half(), w13, w2, weights, ids.long())
    with pytest.raises(ValueError, match="unknown quantized expert path"):
        fused_moe_quantized(x.half(), w13, w2, weights, ids, path="dense")


@pytest.mark.parametrize("case", _cases("int4-g128", "int4-g128-actorder"), ids=lambda c: c.name)
@pytest.mark.parametrize("num_tokens", [1, 64, 512])  # pairs, pairs, dequantized
def test_fused_moe_quantized_captures_in_a_cuda_graph(case, num_tokens):
    gen, seed = fresh_generator()
    num_experts, hidden = 32, 256
    w13, w2, dense13, dense2 = _experts(case, num_experts, hidden, 128, gen)
    x = torch.randn(num_tokens, hidden, generator=gen).half().cuda()
    logits = torch.randn(num_tokens, num_experts, generator=gen).half().cuda()

    def step():
        weights, ids = topk_softmax(logits, 8, True)
        return fused_moe_quantized(x, w13, w2, weights, ids)

    with torch.inference_mode():
        graph, out = capture(step)
        for _ in range(2):  # fresh inputs and routings replay into the same buffers
            x.copy_(torch.randn(num_tokens, hidden, generator=gen))
            logits.copy_(torch.randn(num_tokens, num_experts, generator=gen))
            graph.replay()
            weights, ids = topk_softmax_ref(logits, 8, True)
            expected = experts_grouped(x.float(), dense13, dense2, weights, ids)
            tol = 2e-3 * float(expected.abs().max()) + 2e-3
            torch.testing.assert_close(out.float(), expected, atol=tol, rtol=1e-2, msg=f"seed {seed}")
