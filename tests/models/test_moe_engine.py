"""Mixture-of-experts models through the whole engine against transformers' greedy generation: 32 new
tokens of each prompt, token for token, with chunked prefill (a 40-token step budget splits the long
prompts), mixed prefill/decode steps, a shared prefix read from the prefix cache, and the last step's
logprobs within float tolerance (CPU, fp32)."""

from __future__ import annotations

import pytest
import torch
from tiny_models import MOE_CONFIGS, engine_prompts, hf_greedy, save_moe_model

from voltllm.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from voltllm.engine.llm_engine import LLMEngine
from voltllm.protocol import EngineCoreRequest, EngineSamplingParams

NEW_TOKENS = 32


@pytest.mark.parametrize("name", sorted(MOE_CONFIGS))
def test_greedy_matches_transformers(name: str, tmp_path) -> None:
    hf_model = save_moe_model(name, tmp_path, plain=True)
    config = EngineConfig(
        model=ModelConfig(model=str(tmp_path), dtype="float32"),
        cache=CacheConfig(block_size=8, num_kv_blocks=128),
        scheduler=SchedulerConfig(max_num_batched_tokens=40, max_num_seqs=8),  # forces chunked prefill
        device="cpu",
    )
    engine = LLMEngine(config)
    prompts = engine_prompts(engine.vocab_size, 6)
    params = EngineSamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=20)
    requests = [EngineCoreRequest(str(i), p, params, float(i)) for i, p in enumerate(prompts)]
    outputs = engine.generate_token_ids(requests)
    assert engine.get_stats().prefix_cache_hits > 0  # the shared prefix was reused
    with torch.inference_mode():
        for i, prompt in enumerate(prompts):
            ref_tokens, ref_last_logprobs = hf_greedy(hf_model, prompt, NEW_TOKENS)
            out = outputs[str(i)]
            assert out.new_token_ids == ref_tokens, f"prompt {i} ({len(prompt)} tokens)"
            last = out.new_logprobs[-1]
            ref = ref_last_logprobs[last.token_ids].tolist()
            assert last.logprobs == pytest.approx(ref, abs=2e-4), f"prompt {i}: last-step logprobs"
