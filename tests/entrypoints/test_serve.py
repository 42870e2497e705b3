"""`voltllm serve` end to end on the CPU: the real engine process, the Rust front end, the default model,
driven by the official `openai` client and by raw HTTP for malformed requests."""

from __future__ import annotations

import json
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from voltllm_cli import serving, start_server

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    with serving("--num-kv-blocks", "1024") as (_, base):
        yield base


@pytest.fixture(scope="module")
def client(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=300)


QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def test_models_lists_the_default_model(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_chat_non_streaming_answers_with_usage(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=32)
    choice = resp.choices[0]
    assert "Paris" in choice.message.content
    assert choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length")
    assert resp.usage.completion_tokens > 0
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens


def test_chat_streaming_equals_non_streaming(client: openai.OpenAI) -> None:
    full = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=32)
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=QUESTION,
            temperature=0,
            max_tokens=32,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_completions_prompt_forms(client: openai.OpenAI) -> None:
    prompt = "The capital of France is"
    one = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=8)
    many = client.completions.create(model=MODEL, prompt=[prompt, "1, 2, 3,"], temperature=0, max_tokens=8)
    assert [c.index for c in many.choices] == [0, 1]
    assert many.choices[0].text == one.choices[0].text
    ids = httpx.post(f"{client.base_url}".replace("/v1/", "") + "/tokenize", json={"prompt": prompt}).json()
    by_ids = client.completions.create(model=MODEL, prompt=ids["tokens"], temperature=0, max_tokens=8)
    assert by_ids.choices[0].text == one.choices[0].text
    echoed = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=8, echo=True)
    assert echoed.choices[0].text == prompt + one.choices[0].text


def test_logprobs(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(
        model=MODEL, messages=QUESTION, temperature=0, max_tokens=6, logprobs=True, top_logprobs=3
    )
    content = resp.choices[0].logprobs.content
    assert len(content) == resp.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-4)  # greedy = top-1


def test_seed_reproducibility(client: openai.OpenAI) -> None:
    def sample(seed: int) -> str:
        resp = client.completions.create(
            model=MODEL, prompt="Once upon a time", temperature=1.0, max_tokens=16, seed=seed
        )
        return resp.choices[0].text

    assert sample(7) == sample(7)
    assert len({sample(7), sample(8), sample(9)}) > 1


def test_n_choices(client: openai.OpenAI) -> None:
    resp = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, n=3, seed=1)
    assert sorted(c.index for c in resp.choices) == [0, 1, 2]


def running_requests(server: str) -> float:
    text = httpx.get(f"{server}/metrics").text
    match = re.search(r"^vllm:num_requests_running(?:\{[^}]*\})? (\S+)$", text, re.MULTILINE)
    assert match, "vllm:num_requests_running missing from /metrics"
    return float(match.group(1))


def test_client_disconnect_aborts_in_the_engine(server: str) -> None:
    body = {
        "model": MODEL,
        "prompt": "Count forever: 1, 2, 3,",
        "max_tokens": 2000,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", f"{server}/v1/completions", json=body, timeout=60) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        got = [line for _, line in zip(range(6), lines, strict=False)]
        assert any(line.startswith("data:") for line in got)
        deadline = time.monotonic() + 10
        while running_requests(server) < 1:
            assert time.monotonic() < deadline, "the request never showed as running"
            time.sleep(0.1)
    deadline = time.monotonic() + 10
    while running_requests(server) > 0:
        assert time.monotonic() < deadline, "the engine kept running the abandoned request"
        time.sleep(0.1)


BAD_REQUESTS = [
    ("/v1/chat/completions", {"model": MODEL}),  # no messages
    ("/v1/chat/completions", {"model": MODEL, "messages": "hi"}),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}),
    ("/v1/chat/completions", {"model": "no-such-model", "messages": QUESTION}),
    ("/v1/chat/completions", {"model": MODEL, "messages": QUESTION, "temperature": -1}),
    ("/v1/chat/completions", {"model": MODEL, "messages": QUESTION, "temperature": "hot"}),
    ("/v1/chat/completions", {"model": MODEL, "messages": QUESTION, "top_p": 0}),
    ("/v1/chat/completions", {"model": MODEL, "messages": QUESTION, "top_p": 1.5}),
    ("/v1/chat/completions", {"model": MODEL, "messages": QUESTION, "max_tokens": 0}),
    ("/v1/chat/completions", {"model": MODEL, "messages": QUESTION, "max_tokens": -5}),
    ("/v1/chat/completions", {"model": MODEL, "messages": QUESTION, "n": 0}),
    ("/v1/chat/completions", {"model": MODEL, "messages": QUESTION, "presence_penalty": 3}),
    ("/v1/chat/completions", {"model": MODEL, "messages": QUESTION, "frequency_penalty": -3}),
    ("/v1/chat/completions", {"model": MODEL, "messages": QUESTION, "repetition_penalty": 0}),
    ("/v1/chat/completions", {"model": MODEL, "messages": QUESTION, "top_logprobs": 50, "logprobs": True}),
    ("/v1/chat/completions", {"model": MODEL, "messages": QUESTION, "logit_bias": {"abc": 1}}),
    ("/v1/chat/completions", {"model": MODEL, "messages": QUESTION, "logit_bias": {"1": 500}}),
    ("/v1/chat/completions", {"model": MODEL, "messages": QUESTION, "stop_token_ids": [10_000_000]}),
    ("/v1/chat/completions", {"model": MODEL, "messages": QUESTION, "min_tokens": 10, "max_tokens": 5}),
    ("/v1/chat/completions", {"model": MODEL, "messages": QUESTION, "max_tokens": 10_000_000}),
    ("/v1/completions", {"model": MODEL}),  # no prompt
    ("/v1/completions", {"model": MODEL, "prompt": ""}),
    ("/v1/completions", {"model": MODEL, "prompt": [10_000_000]}),
    ("/v1/completions", {"model": MODEL, "prompt": "word " * 20_000}),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "logprobs": 50}),
    ("/v1/completions", {"model": MODEL, "prompt": {"nested": True}}),
]


@pytest.mark.parametrize(("route", "body"), BAD_REQUESTS)
def test_malformed_requests_get_openai_style_4xx(server: str, route: str, body: dict) -> None:
    resp = httpx.post(f"{server}{route}", json=body, timeout=60)
    assert 400 <= resp.status_code < 500, (resp.status_code, resp.text)
    error = resp.json()["error"]
    assert error["message"] and isinstance(error["type"], str)


def test_unparseable_bodies_get_4xx(server: str) -> None:
    for payload, ctype in [(b"{not json", "application/json"), (b"\xff\xfe", "application/json")]:
        resp = httpx.post(f"{server}/v1/chat/completions", content=payload, headers={"content-type": ctype})
        assert 400 <= resp.status_code < 500
        assert "error" in json.loads(resp.text)


def test_server_still_serves_after_bad_requests(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=8)
    assert resp.choices[0].message.content


def test_greedy_output_identical_to_offline_llm(client: openai.OpenAI) -> None:
    from voltllm import LLM, SamplingParams

    prompts = ["The capital of France is", "def add(a, b):"]
    http = [
        client.completions.create(model=MODEL, prompt=p, temperature=0, max_tokens=24).choices[0].text
        for p in prompts
    ]
    chat_http = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=24)
    llm = LLM(num_kv_blocks=256)
    offline = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    assert [o.outputs[0].text for o in offline] == http
    chat_offline = llm.chat(QUESTION, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    assert chat_offline[0].outputs[0].text == chat_http.choices[0].message.content


def test_sigterm_stops_the_server_and_its_engine() -> None:
    proc, _ = start_server("--num-kv-blocks", "64")
    try:
        children = subprocess.run(
            ["pgrep", "-P", str(proc.pid)], capture_output=True, text=True
        ).stdout.split()
        assert children, "no engine process under voltllm serve"
        proc.terminate()
        assert proc.wait(timeout=30) == 0
        time.sleep(1)
        for pid in children:
            assert (
                not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]
            )
    finally:
        if proc.poll() is None:
            proc.kill()
