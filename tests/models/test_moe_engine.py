"""Mixture-of-experts models through the whole engine against transformers' greedy generation: 32 new
tokens of each prompt, token for token, with chunked prefill (a 40-token step budget splits the long
prompts), mixed prefill/decode steps, a shared prefix read from the prefix cache, and the last step's
logprobs within float tolerance (CPU, fp32)."""

from __future__ import annotations

import pytest
from tiny_models import MOE_CONFIGS, assert_greedy_matches_hf, cpu_test_engine, save_moe_model


@pytest.mark.parametrize("name", sorted(MOE_CONFIGS))
def test_greedy_matches_transformers(name: str, tmp_path) -> None:
    hf_model = save_moe_model(name, tmp_path, plain=True)
    assert_greedy_matches_hf(cpu_test_engine(tmp_path, num_kv_blocks=128), hf_model, num_prompts=6)
