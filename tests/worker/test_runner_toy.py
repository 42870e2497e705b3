"""ModelRunner + scheduler + KV cache end to end on the toy model, against its dense (cache-free) twin."""

from __future__ import annotations

import random

import pytest
import torch
from toy_model import VOCAB, ToyLoaded, ToyModel

from voltllm.config import CacheConfig, EngineConfig, SchedulerConfig
from voltllm.engine.core import EngineCore
from voltllm.engine.llm_engine import LLMEngine
from voltllm.protocol import EngineCoreRequest, EngineSamplingParams

MODEL = ToyModel()


def engine(num_blocks=256, block_size=4, budget=16, max_seqs=16, prefix=True, max_model_len=512) -> LLMEngine:
    config = EngineConfig(
        cache=CacheConfig(block_size=block_size, num_kv_blocks=num_blocks, enable_prefix_caching=prefix),
        scheduler=SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs),
        device="cpu",
    )
    core = EngineCore(config, ToyLoaded(MODEL, max_model_len=max_model_len), torch.device("cpu"))
    return LLMEngine(config, core)


def greedy_req(rid: str, prompt: list[int], n: int, **kw) -> EngineCoreRequest:
    sp = EngineSamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kw)
    return EngineCoreRequest(rid, prompt, sp, 0.0)


def prompts(seed: int, count: int, shared_prefix: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(1, VOCAB) for _ in range(shared_prefix)]
    out = []
    for i in range(count):
        own = [rng.randrange(1, VOCAB) for _ in range(rng.randrange(1, 40))]
        out.append(prefix + own if i % 2 == 0 else own)
    return out


@pytest.fixture(scope="module")
def reference():
    ps = prompts(0, 10, shared_prefix=13)
    return ps, [MODEL.greedy(p, 12) for p in ps]


def test_chunked_mixed_batches_match_dense_greedy(reference):
    ps, expected = reference
    eng = engine(budget=16)  # prompts up to 52 tokens: several chunks each, mixed with decodes
    out = eng.generate_token_ids([greedy_req(str(i), p, 12) for i, p in enumerate(ps)])
    assert [out[str(i)].new_token_ids for i in range(len(ps))] == expected
    assert all(out[str(i)].finish_reason == "length" for i in range(len(ps)))
    stats = eng.get_stats()
    assert stats.num_generation_tokens == 12 * len(ps)
    assert eng.core.scheduler.kv.num_free_blocks == 256


def test_preemption_gives_identical_outputs(reference):
    ps, expected = reference
    eng = engine(num_blocks=20, budget=64)  # 80 tokens of cache for ~10 x 40 tokens
    out = eng.generate_token_ids([greedy_req(str(i), p, 12) for i, p in enumerate(ps)])
    assert [out[str(i)].new_token_ids for i in range(len(ps))] == expected
    assert eng.get_stats().num_preemptions > 0


def test_prefix_cache_computes_only_new_tokens_with_same_output():
    rng = random.Random(1)
    prefix = [rng.randrange(1, VOCAB) for _ in range(40)]
    first, second = prefix + [5, 6, 7], prefix + [8, 9]
    eng = engine(budget=64)
    eng.generate_token_ids([greedy_req("a", first, 4)])
    computed_before = eng.get_stats().num_prompt_tokens
    out = eng.generate_token_ids([greedy_req("b", second, 8)])
    stats = eng.get_stats()
    assert out["b"].num_cached_tokens == 40  # 10 full blocks of 4
    assert stats.num_prompt_tokens - computed_before == len(second) - 40
    assert stats.prefix_cache_hits == 40
    assert out["b"].new_token_ids == MODEL.greedy(second, 8)
    no_cache = engine(budget=64, prefix=False).generate_token_ids([greedy_req("b", second, 8)])
    assert no_cache["b"].new_token_ids == out["b"].new_token_ids


def test_seeded_sampling_is_independent_of_batch_and_preemption():
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    seeded = EngineCoreRequest(
        "s", prompt, EngineSamplingParams(temperature=1.0, seed=1234, max_tokens=16), 0.0
    )
    alone = engine().generate_token_ids([seeded])["s"].new_token_ids
    others = [
        EngineCoreRequest(
            f"o{i}", p, EngineSamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True), 0.0
        )
        for i, p in enumerate(prompts(7, 6))
    ]
    crowded = engine(num_blocks=24, budget=8).generate_token_ids([*others, seeded])["s"].new_token_ids
    assert alone == crowded
    other_seed = EngineCoreRequest(
        "s", prompt, EngineSamplingParams(temperature=1.0, seed=99, max_tokens=16), 0.0
    )
    assert engine().generate_token_ids([other_seed])["s"].new_token_ids != alone


def test_logprobs_and_last_step_logits():
    prompt = [11, 12, 13, 14, 15]
    out = engine().generate_token_ids([greedy_req("a", prompt, 3, logprobs=4)])["a"]
    assert len(out.new_logprobs) == 3
    tokens = prompt + out.new_token_ids
    for i, lp in enumerate(out.new_logprobs):
        ref = MODEL.dense_logits(tokens[: len(prompt) + i])[-1].double().log_softmax(-1)
        assert lp.token_ids[0] == out.new_token_ids[i] and lp.rank == 1
        assert lp.token_ids[1:] == ref.topk(4).indices.tolist()
        assert lp.logprobs == pytest.approx(ref[lp.token_ids].tolist(), abs=1e-5)


def test_kv_cache_sizing():
    from voltllm.worker.model_runner import ModelRunner

    runner = ModelRunner(
        MODEL,
        device=torch.device("cpu"),
        dtype=torch.float64,
        vocab_size=VOCAB,
        eos_token_ids=(0,),
        block_size=4,
        max_model_len=64,
        max_num_batched_tokens=16,
        max_num_seqs=2,
    )
    per_block = 2 * 4 * 2 * 8 * 8 * MODEL.num_layers  # K+V, tokens, kv heads, head size, float64, layers
    assert runner.kv_cache_bytes_per_block() == per_block
    assert runner.determine_num_blocks(CacheConfig(num_kv_blocks=7)) == 7
    assert runner.determine_num_blocks(CacheConfig(kv_cache_memory_bytes=per_block * 10 + 5)) == 10
    assert runner.determine_num_blocks(CacheConfig()) == 4 * 2 * 16  # 1 GiB, capped at 4 full batches
    with pytest.raises(RuntimeError, match="no memory left"):
        runner.determine_num_blocks(CacheConfig(kv_cache_memory_bytes=per_block - 1))
