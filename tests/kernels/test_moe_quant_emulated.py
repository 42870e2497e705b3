"""The quantized experts' pair path (csrc/moe/quant_pair_gemv.cuh) on the CPU emulator (tests/kernels/emu):
each stage against `dequantize` then an fp32 product, for every packed kind, bit width, group size and
act-order (tests/kernels/quant_cases.py), and both stages together against the torch grouped form of
the experts on the dequantized weights. Experts packed by `voltllm.ops.moe_quantized.pack_experts` (the
layout the GPU reads). Fresh random inputs every run; routings with idle experts, one expert for every
token, top-k of 1 and of 6 (two rounds of the down stage's pairs in flight, the second partial)."""

from __future__ import annotations

import ctypes

import pytest
import torch
import torch.nn.functional as F
from emulator import build_emulator, fresh_generator, needs_gxx, ptr
from quant_cases import (
    CASES,
    FP16_EPS,
    QuantCase,
    assert_within,
    fp16_dot_error_bound,
    make_weight,
    swiglu_error_bound,
)

from voltllm.layers.fused_moe import experts_grouped
from voltllm.layers.quantization.quantized_weight import dequantize
from voltllm.ops.activation import silu_and_mul_ref
from voltllm.ops.moe_quantized import PackedQuantExperts, pack_experts

pytestmark = needs_gxx

# Small, for the emulator's speed: rows of 4-8 chunks (fewer than a warp's lanes); the GPU tests cover
# rows of several steps.
NUM_EXPERTS, HIDDEN, INTER = 8, 256, 128
WHOLE_PATH_CASES = ("int4-g128", "int4-g32-sym-actorder", "fp8-g128")


@pytest.fixture(scope="module")
def emu(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    return build_emulator(tmp_path_factory.mktemp("emu"), "moe_harness.cpp")


def _experts(case: QuantCase, rows: int, k: int, gen: torch.Generator):
    weights = [make_weight(case, rows, k, gen) for _ in range(NUM_EXPERTS)]
    return weights, pack_experts(weights)


def _group_args(experts: PackedQuantExperts) -> tuple[ctypes.c_int, ctypes.c_int]:
    num_groups = experts.group_params.shape[2]
    chunk = 32 if experts.kind == 0 else 16
    shift = 0 if num_groups == 1 else (experts.group_size // chunk).bit_length() - 1
    return ctypes.c_int(num_groups), ctypes.c_int(shift)


def _routing(kind: str, num_tokens: int, top_k: int, gen: torch.Generator) -> torch.Tensor:
    if kind == "same":  # every token to the same experts
        return torch.arange(top_k, dtype=torch.int32).repeat(num_tokens, 1)
    # expert 0 idle
    rows = [1 + torch.randperm(NUM_EXPERTS - 1, generator=gen)[:top_k] for _ in range(num_tokens)]
    return torch.stack(rows).to(torch.int32)


def _pair_rows(
    rows: torch.Tensor, experts: PackedQuantExperts, ids: torch.Tensor
) -> tuple[torch.Tensor, int]:
    """The stage's input rows in each pair's packed column order (act-order), or the rows as they are."""
    if experts.column_order is None:
        return rows.contiguous(), 0
    return rows.gather(1, experts.column_order[ids.reshape(-1).long()]).contiguous(), 1


def _run_stage(emu, experts, gated, out, a, ids, weights, rows_per_pair, seed):
    num_tokens, top_k = ids.shape
    n = out.shape[1]
    k = a.shape[1]
    emu.emu_moe_quant_pair_experts(
        ctypes.c_int(experts.kind), ctypes.c_int(int(gated)), ptr(out), ptr(a), ptr(experts.packed),
        ptr(experts.group_params), ptr(ids), ptr(weights), ctypes.c_longlong(a.stride(0)),
        ctypes.c_longlong(out.stride(0)), ctypes.c_int(rows_per_pair), ctypes.c_int(num_tokens),
        ctypes.c_int(top_k), ctypes.c_int(n), ctypes.c_int(k), *_group_args(experts), ctypes.c_uint(seed),
    )  # fmt: skip


def _gated(emu, experts, x, ids, weights, seed) -> torch.Tensor:
    top_k = ids.shape[1]
    rows = x.repeat_interleave(top_k, dim=0) if experts.column_order is not None else x
    a, per_pair = _pair_rows(rows, experts, ids)
    act = torch.full((ids.numel(), experts.rows // 2), float("nan"), dtype=torch.float16)
    _run_stage(emu, experts, True, act, a, ids, weights, per_pair, seed)
    return act


def _down(emu, experts, act, ids, weights, seed) -> torch.Tensor:
    a, _ = _pair_rows(act, experts, ids)
    out = torch.full((ids.shape[0], experts.rows), float("nan"), dtype=torch.float16)
    _run_stage(emu, experts, False, out, a, ids, weights, 1, seed)
    return out


# Every case with top-k 6 and an idle expert; two with every token on one expert (top-1).
STAGE_CASES = [(c, "idle", 6) for c in CASES] + [
    (c, "same", 1) for c in CASES if c.name in WHOLE_PATH_CASES[:2]
]


def _stage_id(param: tuple[QuantCase, str, int]) -> str:
    return f"{param[0].name}-{param[1]}-top{param[2]}"


@pytest.mark.parametrize("case,routing,top_k", STAGE_CASES, ids=[_stage_id(p) for p in STAGE_CASES])
def test_gated_stage_matches_dequantize_then_matmul(emu, case: QuantCase, routing: str, top_k: int):
    gen, seed = fresh_generator()
    num_tokens = 2
    weights, experts = _experts(case, 2 * INTER, HIDDEN, gen)
    x = torch.randn(num_tokens, HIDDEN, generator=gen).to(torch.float16)
    ids = _routing(routing, num_tokens, top_k, gen)
    topk_weights = torch.rand(num_tokens, top_k, generator=gen)
    act = _gated(emu, experts, x, ids, topk_weights, seed)
    for pair, expert in enumerate(ids.reshape(-1).tolist()):
        dense = dequantize(weights[expert], torch.float16).float()
        row = x[pair // top_k].float()
        proj = F.linear(row, dense)
        # Each projection rounded to fp16 before the activation, as the unfused layer stores it.
        ref = silu_and_mul_ref(proj.to(torch.float16).float()[None])[0]
        bound = swiglu_error_bound(proj, fp16_dot_error_bound(row, dense))
        assert_within(act[pair], ref, bound, f"pair {pair}, seed {seed}")


@pytest.mark.parametrize("case,routing,top_k", STAGE_CASES, ids=[_stage_id(p) for p in STAGE_CASES])
def test_down_stage_matches_dequantize_then_weighted_sum(emu, case: QuantCase, routing: str, top_k: int):
    gen, seed = fresh_generator()
    num_tokens = 2
    weights, experts = _experts(case, HIDDEN, INTER, gen)
    act = torch.randn(num_tokens * top_k, INTER, generator=gen).to(torch.float16)
    ids = _routing(routing, num_tokens, top_k, gen)
    topk_weights = torch.rand(num_tokens, top_k, generator=gen)
    out = _down(emu, experts, act, ids, topk_weights, seed)
    for token in range(num_tokens):
        ref = torch.zeros(HIDDEN)
        bound = torch.zeros(HIDDEN)
        for j in range(top_k):
            pair = token * top_k + j
            dense = dequantize(weights[int(ids[token, j])], torch.float16).float()
            ref += topk_weights[token, j] * F.linear(act[pair].float(), dense)
            bound += topk_weights[token, j] * fp16_dot_error_bound(act[pair], dense)
        # The sum over pairs is fp32, rounded to fp16 once.
        assert_within(out[token], ref, bound + FP16_EPS * ref.abs(), f"token {token}, seed {seed}")


@pytest.mark.parametrize("case", [c for c in CASES if c.name in WHOLE_PATH_CASES], ids=lambda c: c.name)
def test_pair_path_matches_the_experts_on_dequantized_weights(emu, case: QuantCase):
    gen, seed = fresh_generator()
    num_tokens, top_k = 2, 4
    w13, w13_packed = _experts(case, 2 * INTER, HIDDEN, gen)
    w2, w2_packed = _experts(case, HIDDEN, INTER, gen)
    x = (torch.randn(num_tokens, HIDDEN, generator=gen) * 4).to(torch.float16)
    ids = _routing("idle", num_tokens, top_k, gen)
    topk_weights = torch.softmax(torch.randn(num_tokens, top_k, generator=gen), dim=-1)
    act = _gated(emu, w13_packed, x, ids, topk_weights, seed)
    out = _down(emu, w2_packed, act, ids, topk_weights, seed)
    dense13 = torch.stack([dequantize(w, torch.float16) for w in w13])
    dense2 = torch.stack([dequantize(w, torch.float16) for w in w2])
    ref = experts_grouped(x, dense13, dense2, topk_weights, ids.long()).float()
    # Each pair's activation error (the gated stage's bound) carried through its down projection, plus
    # the down stage's own; doubled, since the torch form rounds in fp16 at the same places.
    bound = torch.zeros_like(ref)
    for pair, expert in enumerate(ids.reshape(-1).tolist()):
        token = pair // top_k
        proj = F.linear(x[token].float(), dense13[expert].float())
        act_bound = swiglu_error_bound(proj, fp16_dot_error_bound(x[token], dense13[expert]))
        w2_abs = dense2[expert].float().abs()
        down = w2_abs @ act_bound + fp16_dot_error_bound(act[pair], dense2[expert])
        bound[token] += topk_weights.reshape(-1)[pair] * down
    assert_within(out, ref, 2 * bound + 2 * FP16_EPS * ref.abs(), f"seed {seed}")
