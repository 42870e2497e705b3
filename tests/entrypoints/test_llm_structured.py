"""Structured outputs and prompt logprobs through the offline API on the embedded default model (CPU):
constraints hold at temperature 0 and 1 in mixed batches, through chunked prefill and preemption; a
spec that does not compile fails its request alone; prompt logprobs equal transformers' own."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from voltllm import LLM, SamplingParams
from voltllm.sampling_params import StructuredOutputsParams

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 1, "maximum": 99},
        "member": {"type": "boolean"},
    },
    "required": ["name", "age", "member"],
    "additionalProperties": False,
}
PROMPT = "Describe a person as a JSON object:"


@pytest.fixture(scope="module")
def llm() -> LLM:
    # A small token budget (chunked prefill) and a small KV cache (192 tokens: preemption with 7 requests).
    return LLM(num_kv_blocks=12, max_num_batched_tokens=24, enable_prefix_caching=True, seed=0, device="cpu")


def constrained(temperature: float, max_tokens: int = 48, **kind) -> SamplingParams:
    return SamplingParams(
        temperature=temperature,
        max_tokens=max_tokens,
        seed=7,
        structured_outputs=StructuredOutputsParams(**kind),
    )


def test_json_schema_holds_in_a_mixed_batch_with_preemption(llm: LLM) -> None:
    params = [constrained(t, json=PERSON) for t in (0.0, 1.0, 1.0, 1.0, 1.0)]
    params += [SamplingParams(temperature=1.0, max_tokens=60, ignore_eos=True)] * 2  # unconstrained
    before = llm.engine.core.scheduler.num_preemptions
    outs = llm.generate([PROMPT] * 7, params, use_tqdm=False)
    assert llm.engine.core.scheduler.num_preemptions > before, "the KV cache was meant to run out"
    for out in outs[:5]:
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", completion
        jsonschema.validate(json.loads(completion.text), PERSON)
    assert [len(o.outputs[0].token_ids) for o in outs[5:]] == [60, 60]


def test_choice_regex_grammar_and_json_object_hold(llm: LLM) -> None:
    prompts = ["Is the sky blue? Answer:", "A phone number:", "Say yes or no:", "Some JSON:"]
    params = [
        constrained(1.0, choice=["yes", "no", "maybe"]),
        constrained(1.0, regex=r"[0-9]{3}-[0-9]{4}"),
        constrained(1.0, grammar='root ::= "yes" | "no"'),  # GBNF, converted to Lark by the engine
        constrained(1.0, max_tokens=64, json_object=True),
    ]
    for _ in range(2):
        choice, regex, grammar, obj = (o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False))
        assert choice.text in ("yes", "no", "maybe") and choice.finish_reason == "stop"
        assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", regex.text) and regex.finish_reason == "stop"
        assert grammar.text in ("yes", "no")
        if obj.finish_reason == "stop":
            assert isinstance(json.loads(obj.text), dict)
        else:
            assert obj.text.startswith("{")


def test_a_spec_that_does_not_compile_fails_its_request(llm: LLM) -> None:
    with pytest.raises(RuntimeError, match="structured_output: invalid json"):
        llm.generate(PROMPT, constrained(0.0, json='{"type": "frobnicate"}'), use_tqdm=False)
    ok = llm.generate(PROMPT, constrained(0.0, choice=["a", "b"]), use_tqdm=False)[0]
    assert ok.outputs[0].text in ("a", "b")


def test_structured_outputs_params_takes_exactly_one_constraint() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(json=PERSON, regex="a")
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="structured_outputs must be"):
        SamplingParams(structured_outputs={"json": PERSON})


@pytest.fixture(scope="module")
def hf_model(llm: LLM):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(llm.engine.model_dir, dtype=torch.float32).eval()


def test_prompt_logprobs_equal_transformers_through_chunks_and_cache_hits(llm: LLM, hf_model) -> None:
    text = "The quick brown fox jumps over the lazy dog. " * 4  # ~40 tokens: two prefill chunks
    ids = llm.get_tokenizer().encode(text)
    with torch.no_grad():
        reference = hf_model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=2)
    for attempt in range(2):  # the second run's prompt is in the prefix cache: no position may be lost
        out = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0]
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids), attempt
        for pos in range(1, len(ids)):
            entry = out.prompt_logprobs[pos]
            expected = reference[pos - 1]
            assert entry[ids[pos]].logprob == pytest.approx(expected[ids[pos]].item(), abs=1e-3)
            assert entry[ids[pos]].rank == int((expected > expected[ids[pos]]).sum()) + 1
            top = expected.topk(2).indices.tolist()
            assert set(top) <= set(entry), pos
    assert out.outputs[0].token_ids  # and it still generated
