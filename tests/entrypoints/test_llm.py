"""The offline API on the embedded default model, on the CPU."""

from __future__ import annotations

import pytest

from voltllm import LLM, SamplingParams

PROMPTS = [
    "The capital of France is",
    "One, two, three,",
    "def fibonacci(n):",
    "Water boils at",
]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(num_kv_blocks=512, seed=0)


def test_generate_keeps_order_and_matches_single_prompt_runs(llm: LLM) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=12)
    batch = llm.generate(PROMPTS, greedy, use_tqdm=False)
    assert [o.prompt for o in batch] == PROMPTS
    for prompt, out in zip(PROMPTS, batch, strict=True):
        alone = llm.generate([prompt], greedy, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == alone.outputs[0].token_ids
        assert out.prompt_token_ids == llm.get_tokenizer().encode(prompt)
        assert out.outputs[0].text == llm.get_tokenizer().decode(out.outputs[0].token_ids)
        assert out.finished and out.outputs[0].finish_reason in ("length", "stop")


def test_prompt_token_ids_input(llm: LLM) -> None:
    ids = llm.get_tokenizer().encode("The capital of France is")
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    by_ids = llm.generate({"prompt_token_ids": ids}, greedy, use_tqdm=False)[0]
    by_text = llm.generate("The capital of France is", greedy, use_tqdm=False)[0]
    assert by_ids.prompt is None
    assert by_ids.outputs[0].token_ids == by_text.outputs[0].token_ids


def test_seeded_sampling_is_reproducible_and_n_completions_differ(llm: LLM) -> None:
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=16, n=3)
    first = llm.generate(PROMPTS[:2], params, use_tqdm=False)
    second = llm.generate(PROMPTS[1:2], params, use_tqdm=False)
    assert [c.token_ids for c in first[1].outputs] == [c.token_ids for c in second[0].outputs]
    assert [c.index for c in first[0].outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in first[0].outputs}) > 1


def test_logprobs_present_when_asked(llm: LLM) -> None:
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=5, logprobs=3), use_tqdm=False)
    completion = out[0].outputs[0]
    assert completion.logprobs is not None and len(completion.logprobs) == len(completion.token_ids)
    total = 0.0
    for token_id, position in zip(completion.token_ids, completion.logprobs, strict=True):
        assert token_id in position and position[token_id].rank == 1  # greedy picks the most likely
        assert 3 <= len(position) <= 4
        assert all(lp.logprob <= 0.0 for lp in position.values())
        total += position[token_id].logprob
    assert completion.cumulative_logprob == pytest.approx(total)
    plain = llm.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=5), use_tqdm=False)
    assert plain[0].outputs[0].logprobs is None


def test_stop_string_ends_text(llm: LLM) -> None:
    free = llm.generate("One, two, three,", SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)
    text = free[0].outputs[0].text
    assert "," in text
    stopped = llm.generate(
        "One, two, three,", SamplingParams(temperature=0.0, max_tokens=16, stop=[","]), use_tqdm=False
    )
    completion = stopped[0].outputs[0]
    assert completion.text == text.split(",")[0]
    assert completion.finish_reason == "stop" and completion.stop_reason == ","


def test_chat_answers_capital_of_france(llm: LLM) -> None:
    out = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(temperature=0.0, max_tokens=32),
        use_tqdm=False,
    )
    assert "Paris" in out[0].outputs[0].text


def test_invalid_input_raises_value_error_naming_the_problem(llm: LLM) -> None:
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1.0)
    with pytest.raises(ValueError, match="empty"):
        llm.generate({"prompt_token_ids": []}, use_tqdm=False)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate({"prompt_token_ids": [1] * 100_000}, use_tqdm=False)
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate(PROMPTS, [SamplingParams()], use_tqdm=False)
