"""`LLM.generate` under asynchronous scheduling (on the CPU, a tiny random Llama with a real byte-level
tokenizer): stop strings end the text where the synchronous engine ends it, though the engine has
already computed a token past the stop when the text layer finds it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from voltllm import LLM, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from tiny_models import add_fixture_tokenizer  # noqa: E402

PROMPTS = ["The capital of France is", "One, two, three,", "def fibonacci(n):", "Water boils at"]


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> dict[bool, LLM]:
    model_dir = tmp_path_factory.mktemp("async_llm")
    config = LlamaConfig(
        vocab_size=384,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
    )
    config.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(model_dir)
    add_fixture_tokenizer(model_dir)
    return {
        mode: LLM(str(model_dir), num_kv_blocks=128, seed=0, async_scheduling=mode) for mode in (False, True)
    }


def completions(llm: LLM, params: list[SamplingParams]) -> list[tuple]:
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    return [(c.text, c.token_ids, c.finish_reason, c.stop_reason) for out in outs for c in out.outputs]


def test_async_engine_is_asynchronous(engines: dict[bool, LLM]) -> None:
    assert engines[True].engine.core.async_scheduling
    assert not engines[False].engine.core.async_scheduling


@pytest.mark.parametrize("include_stop", [False, True])
def test_stop_strings_end_at_the_same_text(engines: dict[bool, LLM], include_stop: bool) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain = engines[False].generate(PROMPTS, greedy, use_tqdm=False)
    params = []
    for out in plain:
        text = out.outputs[0].text
        stop = text[len(text) // 2 : len(text) // 2 + 3]  # a piece from the middle: it stops mid-stream
        params.append(
            SamplingParams(
                temperature=0.0, max_tokens=24, stop=[stop], include_stop_str_in_output=include_stop
            )
        )
    expected = completions(engines[False], params)
    assert sum(reason == "stop" for _, _, reason, _ in expected) >= len(PROMPTS) // 2  # mid-stream stops
    assert completions(engines[True], params) == expected


def test_sampled_stop_token_ids_and_max_tokens_match(engines: dict[bool, LLM]) -> None:
    params = [
        SamplingParams(temperature=0.7, seed=3, max_tokens=5 + 4 * i, stop_token_ids=[13])
        for i in range(len(PROMPTS))
    ]
    assert completions(engines[True], params) == completions(engines[False], params)
