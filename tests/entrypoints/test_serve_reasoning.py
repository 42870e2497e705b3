"""`--reasoning-parser` end to end on the default model.

SmolLM2 writes no `</think>`; under `deepseek_r1` (whose template opens the block in the prompt) an
output without the closing tag is all reasoning. So every generated character must arrive in
`reasoning_content`, none in `content`, streamed or not, on chat and on the Responses API.
"""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest
from voltllm_cli import serving

MODEL = "SmolLM2-135M-Instruct"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def client() -> Iterator[openai.OpenAI]:
    with serving("--num-kv-blocks", "512", "--reasoning-parser", "deepseek_r1") as (_, base):
        yield openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=300)


def test_chat_reasoning_content_streamed_and_not(client: openai.OpenAI) -> None:
    args = dict(model=MODEL, messages=QUESTION, temperature=0, max_tokens=24)
    message = client.chat.completions.create(**args).choices[0].message
    reasoning = message.model_extra["reasoning_content"]
    assert reasoning and "</think>" not in reasoning
    assert message.content == ""
    streamed_reasoning, streamed_content = "", ""
    for chunk in client.chat.completions.create(**args, stream=True):
        for choice in chunk.choices:
            streamed_reasoning += (choice.delta.model_extra or {}).get("reasoning_content") or ""
            streamed_content += choice.delta.content or ""
    assert (streamed_reasoning, streamed_content) == (reasoning, "")


def test_responses_reasoning_item(client: openai.OpenAI) -> None:
    resp = client.responses.create(model=MODEL, input=QUESTION, temperature=0, max_output_tokens=24)
    assert [item.type for item in resp.output] == ["reasoning"]
    assert resp.output[0].content[0].text
    assert resp.output_text == ""
