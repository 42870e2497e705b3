"""Tool calling, the Responses API and agent clients against `voltllm serve` on the default model.

Forced tool calls (`tool_choice="required"` or a named function) are shaped by the engine's grammar,
so even a 135M model's calls parse and validate against their schemas, at any temperature. The server
runs with `--enable-auto-tool-choice --tool-call-parser hermes`, so `tool_choice="auto"` is parsed too
(this model writes no calls of its own: its answers stay content).
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import jsonschema
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


def check_calls(tool_calls: list, names: set[str]) -> None:
    """Every call names one of `names`, has a `call_` id, and its arguments validate."""
    assert tool_calls, "no tool calls"
    for call in tool_calls:
        assert call.id.startswith("call_")
        assert call.type == "function"
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_required_tool_choice_gives_valid_calls(client: openai.OpenAI, temperature: float) -> None:
    for seed in range(3):
        resp = client.chat.completions.create(
            model=MODEL, messages=QUESTION, tools=TOOLS, tool_choice="required", temperature=temperature,
            seed=seed, max_tokens=200, parallel_tool_calls=False,
        )  # fmt: skip
        choice = resp.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content is None
        assert len(choice.message.tool_calls) == 1  # parallel_tool_calls=False: at most one
        check_calls(choice.message.tool_calls, {"get_weather", "add"})


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_named_tool_choice_calls_that_function(client: openai.OpenAI, temperature: float) -> None:
    for seed in range(3):
        resp = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "What is 2 plus 3?"}], tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "add"}}, temperature=temperature, seed=seed,
            max_tokens=200,
        )  # fmt: skip
        choice = resp.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert [c.function.name for c in choice.message.tool_calls] == ["add"]
        check_calls(choice.message.tool_calls, {"add"})


def reassemble_stream(chunks: list) -> tuple[str, list[dict], str | None]:
    """Content, tool calls (as dicts, ids included) and the finish reason of a streamed chat completion."""
    content, calls, finish = "", {}, None
    for chunk in chunks:
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            for tc in delta.tool_calls or []:
                call = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
                if tc.id:
                    assert call["id"] is None, "a call's id is sent once"
                    call["id"] = tc.id
                if tc.function and tc.function.name:
                    call["name"] += tc.function.name
                if tc.function and tc.function.arguments:
                    call["arguments"] += tc.function.arguments
            finish = choice.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize(
    "tool_choice",
    ["required", {"type": "function", "function": {"name": "get_weather"}}],
    ids=["required", "named"],
)
def test_streamed_tool_call_reassembles_to_the_non_streamed_one(client: openai.OpenAI, tool_choice) -> None:
    args = dict(
        model=MODEL, messages=QUESTION, tools=TOOLS, tool_choice=tool_choice, temperature=0, max_tokens=200
    )
    full = client.chat.completions.create(**args).choices[0]
    content, calls, finish = reassemble_stream(list(client.chat.completions.create(**args, stream=True)))
    assert finish == full.finish_reason == "tool_calls"
    assert content == ""
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (c.function.name, c.function.arguments) for c in full.message.tool_calls
    ]
    assert all(c["id"].startswith("call_") for c in calls)


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


def test_responses_forced_function_call_and_its_output(client: openai.OpenAI) -> None:
    tools = [
        {"type": "function", "name": t["function"]["name"], "parameters": t["function"]["parameters"]}
        for t in TOOLS
    ]
    resp = client.responses.create(model=MODEL, input=QUESTION, tools=tools, tool_choice="required",
                                   temperature=1, max_output_tokens=200)  # fmt: skip
    calls = [item for item in resp.output if item.type == "function_call"]
    assert calls, resp.output
    for call in calls:
        assert call.call_id.startswith("call_")
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    # Streamed: the argument deltas add up to the arguments the done event and the response report.
    stream = list(client.responses.create(model=MODEL, input=QUESTION, tools=tools, temperature=0,
                                          tool_choice={"type": "function", "name": "get_weather"},
                                          max_output_tokens=200, stream=True))  # fmt: skip
    deltas = "".join(e.delta for e in stream if e.type == "response.function_call_arguments.delta")
    done = [e for e in stream if e.type == "response.function_call_arguments.done"]
    assert done and done[0].arguments == deltas
    final = stream[-1].response.output[-1]
    assert (final.type, final.name, final.arguments) == ("function_call", "get_weather", deltas)
    # The call and its result go back in as input items.
    follow = client.responses.create(
        model=MODEL, tools=tools, tool_choice="none", temperature=0, max_output_tokens=16,
        input=[*QUESTION, {"type": "function_call", "call_id": final.call_id, "name": final.name,
                           "arguments": final.arguments},
               {"type": "function_call_output", "call_id": final.call_id, "output": "sunny"}],
    )  # fmt: skip
    assert follow.output_text


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


def test_langchain_bind_tools_and_structured_output(server: str) -> None:
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    class Forecast(BaseModel):
        """A weather forecast request."""

        city: str = Field(max_length=24)
        days: int = Field(ge=1, le=7)
        metric: bool

    llm = ChatOpenAI(model=MODEL, base_url=f"{server}/v1", api_key="unused", temperature=0, max_tokens=200)
    structured = llm.with_structured_output(Forecast, method="function_calling").invoke(
        "Weather in Oslo for 2 days?"
    )
    assert isinstance(structured, Forecast)
    message = llm.bind_tools([Forecast], tool_choice="required").invoke("Weather in Oslo for 2 days?")
    assert message.tool_calls and message.tool_calls[0]["name"] == "Forecast"
    Forecast.model_validate(message.tool_calls[0]["args"])


def test_openai_agents_sdk_runs_a_tool_over_the_responses_api(server: str) -> None:
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)
    called: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        called.append(city)
        return f"It is sunny in {city}."

    agent = Agent(
        name="weather",
        instructions="Answer weather questions with the get_weather tool.",
        tools=[get_weather],
        # "required" for the first turn; the SDK resets it to "auto" after the call, and the answer follows.
        model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=64),
        model=OpenAIResponsesModel(
            model=MODEL, openai_client=openai.AsyncOpenAI(base_url=f"{server}/v1", api_key="unused")
        ),
    )
    result = Runner.run_sync(agent, "What is the weather in Paris?", max_turns=4)
    assert len(called) == 1
    assert isinstance(result.final_output, str) and result.final_output


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_responses_text_format_json_schema(client: openai.OpenAI, temperature: float) -> None:
    resp = client.responses.create(
        model=MODEL,
        input="Plan a weather lookup for Paris.",
        temperature=temperature,
        max_output_tokens=200,
        text={"format": {"type": "json_schema", "name": "lookup", "schema": WEATHER_PARAMS, "strict": True}},
    )
    assert resp.status == "completed"
    jsonschema.validate(json.loads(resp.output_text), WEATHER_PARAMS)
