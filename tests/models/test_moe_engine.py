"""Mixture-of-experts models through the whole engine against transformers' greedy generation: 32 new
tokens of each prompt, token for token, with chunked prefill (a 40-token step budget splits the long
prompts), mixed prefill/decode steps, a shared prefix read from the prefix cache, and the last step's
logprobs within float tolerance (CPU, fp32)."""

from __future__ import annotations

import random

import pytest
import torch
from tiny_models import MOE_CONFIGS, save_moe_model

from voltllm.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from voltllm.engine.llm_engine import LLMEngine
from voltllm.protocol import EngineCoreRequest, EngineSamplingParams

NEW_TOKENS = 32


def make_prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    """6 prompts of 3..70 tokens; every third starts with the same 24-token prefix."""
    rng = random.Random(seed)
    prefix = [rng.randrange(3, vocab) for _ in range(24)]
    out = []
    for i in range(6):
        own = [rng.randrange(3, vocab) for _ in range(rng.randrange(3, 46))]
        out.append(prefix + own if i % 3 == 0 else own)
    return out


def hf_greedy(model: torch.nn.Module, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    out = model.generate(
        torch.tensor([prompt]),
        max_new_tokens=NEW_TOKENS,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
    )
    return out.sequences[0, len(prompt) :].tolist(), out.logits[-1][0].float().log_softmax(-1)


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
    prompts = make_prompts(engine.vocab_size)
    params = EngineSamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=20)
    requests = [EngineCoreRequest(str(i), p, params, float(i)) for i, p in enumerate(prompts)]
    outputs = engine.generate_token_ids(requests)
    assert engine.get_stats().prefix_cache_hits > 0  # the shared prefix was reused
    with torch.inference_mode():
        for i, prompt in enumerate(prompts):
            ref_tokens, ref_last_logprobs = hf_greedy(hf_model, prompt)
            out = outputs[str(i)]
            assert out.new_token_ids == ref_tokens, f"prompt {i} ({len(prompt)} tokens)"
            last = out.new_logprobs[-1]
            ref = ref_last_logprobs[last.token_ids].tolist()
            assert last.logprobs == pytest.approx(ref, abs=2e-4), f"prompt {i}: last-step logprobs"
