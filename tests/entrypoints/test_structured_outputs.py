"""Structured outputs over HTTP, through the official openai client, on the embedded default model.

Every spelling (`response_format` json_schema / json_object, vLLM's `structured_outputs`, the older
`guided_*`) is enforced by the engine's grammar on both routes, streamed or not, at temperature 0 and
1; a spec that does not compile, or two constraints at once, is a 400 with an OpenAI-style body (also
for a stream, before any byte of it), and the server keeps serving.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import httpx
import jsonschema
import openai
import pytest
from voltllm_cli import serving

SCHEMAS = {
    "nested": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {"id": {"type": "integer"}, "name": {"type": "string", "maxLength": 8}},
                "required": ["id", "name"],
                "additionalProperties": False,
            },
            "active": {"type": "boolean"},
        },
        "required": ["user", "active"],
        "additionalProperties": False,
    },
    "enum_and_range": {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "level": {"type": "integer", "minimum": 1, "maximum": 5},
        },
        "required": ["color", "level"],
        "additionalProperties": False,
    },
    "bounded_array": {
        "type": "object",
        "properties": {
            "tags": {
                "type": "array",
                "items": {"type": "string", "maxLength": 6},
                "minItems": 1,
                "maxItems": 3,
            }
        },
        "required": ["tags"],
        "additionalProperties": False,
    },
}

MODEL = "SmolLM2-135M-Instruct"  # the embedded default model's served name


@pytest.fixture(scope="module")
def base() -> Iterator[str]:
    with serving("--num-kv-blocks", "256") as (_, url):
        yield url


@pytest.fixture(scope="module")
def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)


def chat(client: openai.OpenAI, content: str, **kwargs) -> openai.types.chat.ChatCompletion:
    kwargs.setdefault("max_tokens", 80)
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": content}], seed=3, **kwargs
    )


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_json_schema_outputs_parse_and_validate(client, name, temperature) -> None:
    schema = SCHEMAS[name]
    response_format = {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}
    out = chat(
        client,
        f"Give me a {name} JSON object.",
        temperature=temperature,
        n=2,
        response_format=response_format,
    )
    for choice in out.choices:
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), schema)


def test_json_object_gives_an_object(client) -> None:
    out = chat(
        client,
        "Reply with a JSON object.",
        temperature=1.0,
        max_tokens=100,
        response_format={"type": "json_object"},
    )
    choice = out.choices[0]
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(choice.message.content), dict)
    else:  # cut at max_tokens: still the start of an object
        assert choice.message.content.startswith("{")


def test_choice_and_regex_hold_on_both_routes_streamed_or_not(client) -> None:
    for _ in range(3):
        out = chat(
            client,
            "Pick a color.",
            temperature=1.0,
            extra_body={"structured_outputs": {"choice": ["red", "blue"]}},
        )
        assert out.choices[0].message.content in ("red", "blue")
        text = (
            client.completions.create(
                model=MODEL,
                prompt="Date:",
                max_tokens=20,
                temperature=1.0,
                extra_body={"guided_regex": r"20[0-9]{2}-[01][0-9]"},
            )
            .choices[0]
            .text
        )
        assert re.fullmatch(r"20[0-9]{2}-[01][0-9]", text), text
    stream = client.completions.create(
        model=MODEL,
        prompt="Answer:",
        max_tokens=10,
        temperature=1.0,
        stream=True,
        extra_body={"guided_choice": ["alpha", "beta"]},
    )
    assert "".join(c.choices[0].text for c in stream if c.choices) in ("alpha", "beta")
    stream = chat(
        client,
        "Yes or no?",
        temperature=1.0,
        stream=True,
        extra_body={"guided_grammar": 'root ::= "yes" | "no"'},
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) in ("yes", "no")


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "frobnicate"}},
                }
            },
            "frobnicate",
        ),
        ({"structured_outputs": {"grammar": "start: undefined_rule"}}, "undefined_rule"),
        ({"guided_regex": "a(b"}, "unclosed group"),
        ({"guided_json": "{not json"}, "not JSON"),
        (
            {"response_format": {"type": "json_object"}, "guided_regex": "a"},
            "only one structured-output constraint",
        ),
        ({"structured_outputs": {"structural_tag": "x"}}, "structural_tag"),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
def test_bad_constraints_are_a_400_and_the_server_keeps_serving(base, client, extra, needle, stream) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 5,
        "stream": stream,
        **extra,
    }
    r = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.headers["content-type"].startswith("application/json")
    error = r.json()["error"]
    assert needle in error["message"] and error["type"] == "BadRequestError"
    assert chat(client, "hi", max_tokens=3).choices[0].message.content is not None
