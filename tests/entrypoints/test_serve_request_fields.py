"""Every request field is read or refused (issues 20 and 22): what the official openai client (with
`extra_body`), LangChain's ChatOpenAI, the OpenAI Agents SDK's chat-completions model and lm-eval's
`local-completions` send is accepted; a field the server does not implement is a 400 naming it;
vLLM's `guided_decoding_backend` and `guided_whitespace_pattern` are honoured. Runs `voltllm serve`
on a tiny random Llama, so what is checked is the server, not the model's answers."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator

import httpx
import jsonschema
import openai
import pytest
from voltllm_cli import serving, tiny_llama

pytestmark = pytest.mark.slow

MODEL = "tiny"
HI = [{"role": "user", "content": "Hi"}]
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["ok", "n"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    model = tiny_llama(tmp_path_factory.mktemp("fields_model"))
    args = ("--served-model-name", MODEL, "--max-model-len", "256", "--num-kv-blocks", "256")
    with serving(str(model), *args) as (_, base):
        yield base


@pytest.fixture(scope="module")
def client(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)


def test_the_openai_client_with_every_field_it_and_vllm_define_that_the_server_reads(client) -> None:
    chat = client.chat.completions.create(
        model=MODEL,
        messages=HI,
        max_completion_tokens=4,
        temperature=0.7,
        top_p=0.9,
        n=2,
        stop=["\n\n"],
        seed=5,
        presence_penalty=0.1,
        frequency_penalty=0.1,
        logit_bias={"42": -1},
        logprobs=True,
        top_logprobs=2,
        user="end-user-7",
        safety_identifier="hash-7",
        prompt_cache_key="conversation-1",
        store=False,
        service_tier="auto",
        extra_body={
            "top_k": 20, "min_p": 0.01, "repetition_penalty": 1.05, "min_tokens": 1, "stop_token_ids": [2],
            "ignore_eos": True, "skip_special_tokens": True, "include_stop_str_in_output": False,
            "priority": 0, "add_generation_prompt": True, "chat_template_kwargs": {"enable_thinking": False},
            "use_beam_search": False, "best_of": 1, "length_penalty": 1.0, "add_special_tokens": False,
        },
    )  # fmt: skip
    assert len(chat.choices) == 2 and chat.choices[0].logprobs is not None
    stream = client.chat.completions.create(
        model=MODEL, messages=HI, max_tokens=3, stream=True,
        stream_options={"include_usage": True, "include_obfuscation": False},
    )  # fmt: skip
    chunks = list(stream)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 3
    text = client.completions.create(
        model=MODEL, prompt="Hi", max_tokens=3, echo=True, logprobs=1, suffix=None, best_of=1, user="u"
    )
    assert text.choices[0].text.startswith("Hi")


def test_lm_eval_local_completions_payloads_are_accepted(server: str) -> None:
    """The two bodies lm-eval's `local-completions` builds (`_create_payload`)."""
    loglikelihood = {"model": MODEL, "prompt": ["A B", "A C"], "temperature": 0, "max_tokens": 1,
                     "logprobs": 1, "seed": 1234, "echo": True}  # fmt: skip
    generate = {"prompt": ["Q: 1+1?"], "model": MODEL, "max_tokens": 4, "temperature": 0, "stop": ["\n"],
                "seed": 1234, "top_p": 1.0}  # fmt: skip
    for body in (loglikelihood, generate):
        r = httpx.post(f"{server}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text


def test_langchain_chat_openai_default_payloads_are_accepted(server: str) -> None:
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=MODEL, base_url=f"{server}/v1", api_key="unused", max_tokens=3, temperature=0.5)
    assert isinstance(llm.invoke("Hi").content, str)
    streamed = list(ChatOpenAI(model=MODEL, base_url=f"{server}/v1", api_key="unused", max_tokens=3,
                               stream_usage=True).stream("Hi"))  # fmt: skip
    assert streamed


def test_an_agents_sdk_agent_over_chat_completions_is_accepted(server: str) -> None:
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, set_tracing_disabled

    set_tracing_disabled(True)
    model = OpenAIChatCompletionsModel(
        model=MODEL, openai_client=openai.AsyncOpenAI(base_url=f"{server}/v1", api_key="unused")
    )
    agent = Agent(
        name="echo", instructions="Answer briefly.", model=model,
        model_settings=ModelSettings(max_tokens=4, temperature=0.3, top_p=0.9),
    )  # fmt: skip
    result = asyncio.run(Runner.run(agent, "Hi", max_turns=1))
    assert isinstance(result.final_output, str)


BACKEND, WHITESPACE = "guided_decoding_backend", "guided_whitespace_pattern"


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"extra_body": {"temprature": 0.5}}, "temprature"),
        ({"reasoning_effort": "low"}, "reasoning_effort"),
        ({"store": True}, "store"),
        ({"extra_body": {"best_of": 2}}, "best_of"),
        ({"extra_body": {"use_beam_search": True}}, "use_beam_search"),
        ({"extra_body": {"truncate_prompt_tokens": 8}}, "truncate_prompt_tokens"),
        ({"extra_body": {"guided_decoding_backend": "xgrammar", "guided_json": SCHEMA}}, BACKEND),
        ({"extra_body": {"guided_decoding_backend": "outlines"}}, BACKEND),
        ({"extra_body": {"guided_whitespace_pattern": " "}}, WHITESPACE),
        ({"extra_body": {"guided_regex": "a+", "guided_whitespace_pattern": " "}}, WHITESPACE),
        (
            {"stream_options": {"include_obfuscation": True}, "stream": True},
            "stream_options.include_obfuscation",
        ),
    ],
)
def test_a_field_not_implemented_is_a_400_naming_it(client, kwargs: dict, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=HI, max_tokens=2, **kwargs)
    error = e.value.body
    assert error["param"] == param, error
    assert param.rsplit(".", 1)[-1] in error["message"], error


@pytest.mark.parametrize("backend", ["auto", "guidance", "llguidance"])
def test_a_whitespace_pattern_is_the_only_whitespace_in_json_output(client, backend: str) -> None:
    for seed in range(2):
        chat = client.chat.completions.create(
            model=MODEL, messages=HI, max_tokens=60, temperature=1.0, seed=seed,
            extra_body={"guided_json": SCHEMA, BACKEND: backend, WHITESPACE: "[ ]?"},
        )  # fmt: skip
        text = chat.choices[0].message.content
        assert chat.choices[0].finish_reason == "stop", text
        jsonschema.validate(json.loads(text), SCHEMA)
        outside_strings = re.sub(r'"[^"]*"', '""', text)
        assert "\n" not in outside_strings and "  " not in outside_strings, text


def test_structured_outputs_whitespace_pattern_and_a_bad_pattern(client) -> None:
    chat = client.chat.completions.create(
        model=MODEL, messages=HI, max_tokens=60, temperature=1.0, seed=1,
        extra_body={"structured_outputs": {"json": SCHEMA, "whitespace_pattern": "\n?"}},
    )  # fmt: skip
    text = chat.choices[0].message.content
    jsonschema.validate(json.loads(text), SCHEMA)
    assert " " not in re.sub(r'"[^"]*"', '""', text), text
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=MODEL, messages=HI, max_tokens=4,
            extra_body={"guided_json": SCHEMA, "guided_whitespace_pattern": "("},
        )  # fmt: skip
    assert "whitespace" in str(e.value).lower() or "regex" in str(e.value).lower(), e.value


def test_tokenize_refuses_unknown_fields(server: str) -> None:
    r = httpx.post(f"{server}/tokenize", json={"prompt": "Hi", "return_token_strs": True})
    assert r.status_code == 400 and "return_token_strs" in r.json()["error"]["message"], r.text


def test_the_described_request_schema_lists_the_refused_fields(server: str) -> None:
    schema = httpx.get(f"{server}/openapi.json").json()["components"]["schemas"]["ChatRequest"]
    assert schema["additionalProperties"] is False
    assert schema["properties"]["use_beam_search"]["enum"] == [None, False]
    assert "guided_whitespace_pattern" in schema["properties"]
