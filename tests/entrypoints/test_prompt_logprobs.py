"""Prompt logprobs over HTTP on the embedded default model: `/v1/completions` with `echo` and
`logprobs` returns the prompt's entries (the first `null`) then the generated ones in OpenAI's legacy
shape; `max_tokens: 0` with `echo` scores a prompt without generating; vLLM's `prompt_logprobs` extra
on both routes. Values equal transformers' own log-softmax on the same model folder."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest
import torch
from voltllm_cli import serving

from voltllm.loader.default_model import default_model_dir

TEXT = "The quick brown fox jumps over the lazy dog"

MODEL = "SmolLM2-135M-Instruct"  # the embedded default model's served name


@pytest.fixture(scope="module")
def base() -> Iterator[str]:
    # A small token budget: the prompt below is computed in several chunks.
    with serving("--num-kv-blocks", "128", "--max-num-batched-tokens", "8") as (_, url):
        yield url


@pytest.fixture(scope="module")
def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def reference() -> tuple[list[int], torch.Tensor]:
    """The prompt's ids (as the server tokenizes them) and transformers' log-softmax per position."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = default_model_dir()
    ids = AutoTokenizer.from_pretrained(model_dir)(TEXT)["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return ids, model(torch.tensor([ids])).logits[0].log_softmax(-1)


def test_echo_with_logprobs_gives_the_prompt_then_the_generated_tokens(client, reference) -> None:
    ids, logsoftmax = reference
    out = client.completions.create(
        model=MODEL, prompt=ids, max_tokens=2, temperature=0.0, logprobs=2, echo=True
    )
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(ids) + 2 == len(lp.token_logprobs) == len(lp.top_logprobs)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for pos in range(1, len(ids)):
        assert lp.token_logprobs[pos] == pytest.approx(logsoftmax[pos - 1, ids[pos]].item(), abs=1e-3)
        assert len(lp.top_logprobs[pos]) == 2
        assert max(lp.top_logprobs[pos].values()) == pytest.approx(logsoftmax[pos - 1].max().item(), abs=1e-3)
    # The generated tokens follow, greedy: the first is the argmax after the whole prompt.
    assert lp.token_logprobs[len(ids)] == pytest.approx(logsoftmax[-1].max().item(), abs=1e-3)
    assert lp.text_offset == sorted(lp.text_offset)
    assert out.choices[0].text.startswith(TEXT)


def test_max_tokens_zero_with_echo_scores_without_generating(client, reference) -> None:
    ids, logsoftmax = reference
    out = client.completions.create(
        model=MODEL, prompt=[TEXT, TEXT], max_tokens=0, temperature=0.0, logprobs=0, echo=True
    )
    assert out.usage.completion_tokens == 0
    for choice in out.choices:
        assert choice.text == TEXT and choice.finish_reason == "length"
        assert len(choice.logprobs.token_logprobs) == len(ids)
        total = sum(choice.logprobs.token_logprobs[1:])
        expected = sum(logsoftmax[p - 1, ids[p]].item() for p in range(1, len(ids)))
        assert total == pytest.approx(expected, abs=1e-3)


def test_max_tokens_zero_without_echo_is_a_400(base) -> None:
    r = httpx.post(f"{base}/v1/completions", json={"prompt": TEXT, "max_tokens": 0}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def test_vllm_prompt_logprobs_on_both_routes(base, reference) -> None:
    ids, logsoftmax = reference
    body = {"prompt": ids, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 1}
    choice = httpx.post(f"{base}/v1/completions", json=body, timeout=60).json()["choices"][0]
    entries = choice["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(ids)
    for pos in range(1, len(ids)):
        own = entries[pos][str(ids[pos])]
        assert own["logprob"] == pytest.approx(logsoftmax[pos - 1, ids[pos]].item(), abs=1e-3)
        assert own["rank"] == int((logsoftmax[pos - 1] > logsoftmax[pos - 1, ids[pos]]).sum()) + 1
        best = str(int(logsoftmax[pos - 1].argmax()))
        assert entries[pos][best]["rank"] == 1
    messages = [{"role": "user", "content": "Hello"}]
    body = {"messages": messages, "max_tokens": 1, "prompt_logprobs": 0}
    chat = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=60).json()
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) > 3
    assert all(len(e) == 1 for e in chat["prompt_logprobs"][1:])
    streamed = httpx.post(f"{base}/v1/chat/completions", json={**body, "stream": True}, timeout=60)
    assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "prompt_logprobs"
