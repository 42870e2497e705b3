"""Tool calling and the Responses API against `voltllm serve` on the default model.

The server runs with `--enable-auto-tool-choice --tool-call-parser hermes`, so `tool_choice="auto"`
is parsed too (this model writes no calls of its own: its answers stay content).
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest
from voltllm_cli import serving

MODEL = "SmolLM2-135M-Instruct"

WEATHER_PARAMS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "minLength": 1, "maxLength": 24},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit", "days"],
    "additionalProperties": False,
}
ADD_PARAMS = {
    "type": "object",
    "properties": {
        "a": {"type": "integer", "minimum": -100, "maximum": 100},
        "b": {"type": "integer", "minimum": -100, "maximum": 100},
        "exact": {"type": "boolean"},
    },
    "required": ["a", "b", "exact"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather forecast", "parameters": WEATHER_PARAMS},
    },
    {
        "type": "function",
        "function": {"name": "add", "description": "Add two integers", "parameters": ADD_PARAMS},
    },
]
SCHEMAS = {"get_weather": WEATHER_PARAMS, "add": ADD_PARAMS}
QUESTION = [{"role": "user", "content": "What will the weather be in Paris for the next 3 days?"}]


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    with serving("--num-kv-blocks", "1024", "--enable-auto-tool-choice", "--tool-call-parser", "hermes") as (
        _,
        base,
    ):
        yield base


@pytest.fixture(scope="module")
def client(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=300)


def test_auto_tool_choice_without_a_call_is_content(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Say hello."}],
        tools=TOOLS,
        temperature=0,
        max_tokens=24,
    )
    choice = resp.choices[0]
    assert choice.message.content
    assert "<tool_call>" not in choice.message.content
    assert choice.finish_reason in ("stop", "length")


def test_tool_results_render_and_continue(client: openai.OpenAI, server: str) -> None:
    conversation = [
        *QUESTION,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "arguments": '{"city": "Paris", "unit": "celsius", "days": 3}',
                    },
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"forecast": "sunny, 21 C"}'},
    ]
    resp = client.chat.completions.create(model=MODEL, messages=conversation, tools=TOOLS, tool_choice="none",
                                          temperature=0, max_tokens=16)  # fmt: skip
    assert resp.choices[0].message.content
    assert resp.choices[0].message.tool_calls is None
    # The tool result is in the prompt the template rendered.
    ids = httpx.post(f"{server}/tokenize", json={"messages": conversation}).json()["tokens"]
    text = httpx.post(f"{server}/detokenize", json={"tokens": ids}).json()["prompt"]
    assert '{"forecast": "sunny, 21 C"}' in text


def test_bad_tool_requests_are_400s_naming_the_field(client: openai.OpenAI, server: str) -> None:
    cases = [
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}],
                "tool_choice": "required",
            },
            "tools[0].function.parameters",
        ),  # fmt: skip
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [{"type": "code_interpreter"}]}, "tools[0]"),
    ]
    for extra, param in cases:
        body = {"model": MODEL, "messages": QUESTION, "max_tokens": 4, **extra}
        r = httpx.post(f"{server}/v1/chat/completions", json=body)
        assert r.status_code == 400, (extra, r.text)
        assert r.json()["error"]["param"] == param
        assert r.json()["error"]["type"] == "BadRequestError"
    # Still serving.
    assert (
        client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=2)
        .choices[0]
        .message.content
    )


def test_model_by_id(client: openai.OpenAI) -> None:
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-9")


def test_responses_text_and_streaming_agree(client: openai.OpenAI) -> None:
    args = dict(model=MODEL, input="What is the capital of France?", instructions="Answer in one word.",
                temperature=0, max_output_tokens=16)  # fmt: skip
    full = client.responses.create(**args)
    assert full.status in ("completed", "incomplete")
    assert full.output_text
    assert full.usage.output_tokens > 0
    events = list(client.responses.create(**args, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == full.output_text == events[-1].response.output_text


def test_responses_refuses_what_it_cannot_honour(server: str) -> None:
    for body, param in [
        ({"input": "hi", "previous_response_id": "resp_123"}, "previous_response_id"),
        ({"input": [{"type": "web_search_call"}]}, "input[0]"),
        (
            {"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": 3}}}},
            "text.format.schema",
        ),  # fmt: skip
    ]:
        r = httpx.post(f"{server}/v1/responses", json={"model": MODEL, **body})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param
    r = httpx.post(f"{server}/v1/responses", json={"model": MODEL, "input": "hi", "frobnicate": True})
    assert r.status_code == 400 and "frobnicate" in r.json()["error"]["message"]
