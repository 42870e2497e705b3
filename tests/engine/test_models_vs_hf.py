"""Engine output against Hugging Face transformers on the same weights (the correctness oracle)."""

from __future__ import annotations

import random

import pytest
from tiny_models import (
    PLAIN_CONFIGS,
    assert_greedy_matches_hf,
    cpu_test_engine,
    engine_prompts,
    save_plain_model,
)

from voltllm.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from voltllm.engine.llm_engine import LLMEngine
from voltllm.protocol import EngineCoreRequest, EngineSamplingParams

NEW_TOKENS = 32


@pytest.mark.parametrize("arch", sorted(PLAIN_CONFIGS))
def test_greedy_matches_transformers(arch, tmp_path):
    model_dir, hf_model = save_plain_model(arch, tmp_path / arch)
    assert_greedy_matches_hf(cpu_test_engine(model_dir, num_kv_blocks=256), hf_model, num_prompts=10)


@pytest.mark.slow
def test_default_model_knows_the_capital_of_france():
    transformers = pytest.importorskip("transformers")
    from voltllm.loader import DefaultModelMissingError, default_model_dir

    try:
        model_dir = default_model_dir()
    except DefaultModelMissingError as e:
        pytest.skip(str(e))
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if not isinstance(prompt, list):  # transformers 5 returns a BatchEncoding
        prompt = prompt["input_ids"]
    engine = LLMEngine(EngineConfig(model=ModelConfig(model=str(model_dir)), device="cpu"))
    params = EngineSamplingParams(temperature=0.0, max_tokens=24)
    out = engine.generate_token_ids([EngineCoreRequest("paris", prompt, params, 0.0)])["paris"]
    text = tokenizer.decode(out.new_token_ids, skip_special_tokens=True)
    assert "Paris" in text, text


def _llama_engine(model_dir, num_kv_blocks: int, prefix: bool = True) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=ModelConfig(model=str(model_dir), dtype="float32"),
            cache=CacheConfig(block_size=8, num_kv_blocks=num_kv_blocks, enable_prefix_caching=prefix),
            scheduler=SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=16),
            device="cpu",
        )
    )


def test_prefix_cache_and_preemption_keep_outputs(tmp_path):
    model_dir, _ = save_plain_model("llama", tmp_path / "llama")
    params = EngineSamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    rng = random.Random(3)
    prefix = [rng.randrange(3, 320) for _ in range(48)]
    first, second = prefix + [7, 8, 9], prefix + [10, 11]

    cached = _llama_engine(model_dir, 128)
    cached.generate_token_ids([EngineCoreRequest("a", first, params, 0.0)])
    before = cached.get_stats().num_prompt_tokens
    out = cached.generate_token_ids([EngineCoreRequest("b", second, params, 0.0)])["b"]
    assert out.num_cached_tokens == 48
    assert cached.get_stats().num_prompt_tokens - before == len(second) - 48  # only the new tokens
    uncached = _llama_engine(model_dir, 128, prefix=False)
    assert uncached.generate_token_ids([EngineCoreRequest("b", second, params, 0.0)])["b"].new_token_ids == (
        out.new_token_ids
    )

    prompts = engine_prompts(320, 10, seed=5)
    requests = [EngineCoreRequest(str(i), p, params, 0.0) for i, p in enumerate(prompts)]
    roomy = _llama_engine(model_dir, 256).generate_token_ids(requests)
    tight_engine = _llama_engine(model_dir, 16)  # 128 tokens of cache for ~10 x 60 tokens
    tight = tight_engine.generate_token_ids(requests)
    assert tight_engine.get_stats().num_preemptions > 0
    assert {k: v.new_token_ids for k, v in tight.items()} == {k: v.new_token_ids for k, v in roomy.items()}
