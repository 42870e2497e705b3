"""Token masks and grammars on the default model's tokenizer, without a model: the device-side mask
matches llguidance's own bitmask bit for bit, on any subset of rows, and the compiler names bad specs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from voltllm.protocol import StructuredOutput
from voltllm.structured_output import StructuredOutputCompiler, TokenMasks, TokensToAccept, accept_tokens
from voltllm.structured_output.masks import MaskedRows

VOCAB = 49152
EOS = 2
# The default model's tokenizer.json (SmolLM2), as the fixtures keep it: no GGUF import needed.
TOKENIZER_JSON = Path(__file__).resolve().parents[1] / "fixtures/smollm2/tokenizer.json"


@pytest.fixture(scope="module")
def compiler() -> StructuredOutputCompiler:
    return StructuredOutputCompiler(TOKENIZER_JSON, VOCAB, (EOS,))


def allowed_ids(compiler: StructuredOutputCompiler, grammar) -> set[int]:
    """The allowed next tokens as llguidance computes them on its own (one byte per token)."""
    bias = grammar.matcher.compute_logit_bias()
    return {i for i, b in enumerate(bias) if b}


def test_masks_match_llguidance_on_a_subset_of_rows(compiler) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    a = compiler.compile(StructuredOutput(kind="json", spec=json.dumps(schema)))
    b = compiler.compile(StructuredOutput(kind="choice", spec='["yes", "no"]'))
    tokens = compiler.tokenizer.tokenize_str('{"n":')
    assert all(accept_tokens([a] * 1, [t])[0] for t in tokens)
    masks = TokenMasks(max_rows=8, vocab_size=VOCAB, device=torch.device("cpu"))
    logits = torch.randn(4, VOCAB)
    original = logits.clone()
    masks.apply(masks.start(MaskedRows([(1, "a", a), (3, "b", b)])), logits)
    for row, grammar in ((1, a), (3, b)):
        kept = set(torch.nonzero(torch.isfinite(logits[row])).flatten().tolist())
        assert kept == allowed_ids(compiler, grammar) and kept
        assert torch.equal(logits[row][list(kept)], original[row][list(kept)])
    assert torch.equal(logits[[0, 2]], original[[0, 2]])  # unconstrained rows untouched


def _run_steps(compiler: StructuredOutputCompiler, device: torch.device) -> None:
    """Three steps of two constrained requests through one TokenMasks: rows that are not the leading
    ones, then leading rows, then one request alone; each step accepts the last step's masked argmax
    in the mask thread, and every kept token set must be llguidance's own for the advanced state (a
    grammar that ended allows only EOS)."""
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    a = compiler.compile(StructuredOutput(kind="json", spec=json.dumps(schema)))
    b = compiler.compile(StructuredOutput(kind="choice", spec='["yes", "no", "maybe"]'))
    masks = TokenMasks(max_rows=8, vocab_size=VOCAB, device=device)
    gen = torch.Generator().manual_seed(0)
    to_accept = None
    for step_rows in ([(1, "a", a), (3, "b", b)], [(0, "a", a), (1, "b", b)], [(2, "b", b)]):
        logits = torch.randn(4, VOCAB, generator=gen).to(device)
        original = logits.clone()
        pending = masks.start(MaskedRows(step_rows), to_accept)
        masks.apply(pending, logits)
        ended = {e.request_id for e in pending.ended()}
        accepted = zip(to_accept.request_ids, to_accept.grammars, strict=True) if to_accept else ()
        assert ended == {request_id for request_id, grammar in accepted if grammar.is_terminated}
        logits, original = logits.cpu(), original.cpu()
        for row, _, grammar in step_rows:
            kept = set(torch.nonzero(torch.isfinite(logits[row])).flatten().tolist())
            assert kept == allowed_ids(compiler, grammar) and kept
            assert torch.equal(logits[row][list(kept)], original[row][list(kept)])
        untouched = [r for r in range(4) if r not in pending.rows]
        assert torch.equal(logits[untouched], original[untouched])
        sampled = logits[pending.rows].argmax(dim=-1).numpy()
        to_accept = TokensToAccept(pending.masked.request_ids, pending.masked.grammars, sampled.tolist())


def test_consecutive_steps_mask_what_llguidance_allows(compiler) -> None:
    _run_steps(compiler, torch.device("cpu"))


@pytest.mark.gpu
def test_consecutive_steps_mask_what_llguidance_allows_on_the_gpu(compiler) -> None:
    """The masks go up on the upload stream as soon as they are filled; the apply waits for them."""
    _run_steps(compiler, torch.device("cuda"))


def test_a_grammar_that_ends_is_terminated(compiler) -> None:
    g = compiler.compile(StructuredOutput(kind="regex", spec=r"ab\d"))
    tok = compiler.tokenizer
    for t in tok.tokenize_str("ab"):
        assert g.accept(t) and not g.is_terminated
    assert g.accept(tok.tokenize_str("7")[0]) and g.is_terminated
    assert allowed_ids(compiler, g) == {EOS}


def test_gbnf_is_converted_and_lark_is_read(compiler) -> None:
    gbnf = compiler.compile(StructuredOutput(kind="grammar", spec='root ::= "yes" | "no"'))
    lark = compiler.compile(StructuredOutput(kind="grammar", spec='start: "yes" | "no"'))
    assert allowed_ids(compiler, gbnf) == allowed_ids(compiler, lark)


@pytest.mark.parametrize(
    ("kind", "spec", "message"),
    [
        ("json", "{not json", "not JSON"),
        ("json", '{"type": "frobnicate"}', "frobnicate"),
        ("json", "[1, 2]", "JSON Schema is an object"),
        ("regex", "a(b", "unclosed group"),
        ("choice", "[]", "non-empty array"),
        ("choice", '"yes"', "non-empty array"),
        ("grammar", "start: undefined_rule", "undefined_rule"),
        ("grammar", "root ::= (", "invalid grammar"),
    ],
)
def test_a_spec_that_does_not_compile_names_the_problem(compiler, kind, spec, message) -> None:
    with pytest.raises(ValueError, match="structured_output") as e:
        compiler.compile(StructuredOutput(kind=kind, spec=spec))
    assert message in str(e.value)


def test_a_grammar_does_not_cross_processes(compiler) -> None:
    """Tensor-parallel ranks get the plan pickled; they sample nothing and get no matcher."""
    import pickle

    from voltllm.core.sched_output import NewRequestData
    from voltllm.protocol import EngineSamplingParams

    grammar = compiler.compile(StructuredOutput(kind="regex", spec="a+"))
    new = NewRequestData("r", (1, 2), 2, EngineSamplingParams(), (0,), 0, grammar=grammar)
    assert pickle.loads(pickle.dumps(new)).grammar is None


def test_the_tensor_parallel_step_command_carries_no_grammar(compiler) -> None:
    from types import MappingProxyType

    from voltllm.core.sched_output import NewRequestData, SchedulerOutput
    from voltllm.protocol import EngineSamplingParams
    from voltllm.worker.tensor_parallel import _STEP_DECODER, encode_step

    grammar = compiler.compile(StructuredOutput(kind="regex", spec="a+"))
    new = NewRequestData("r", (1, 2), 2, EngineSamplingParams(), (0,), 0, grammar=grammar)
    plan = SchedulerOutput((new,), (), MappingProxyType({"r": 2}), 2)
    decoded = _STEP_DECODER.decode(encode_step(plan, None))
    assert decoded.plan.scheduled_new_reqs[0].grammar is None
    assert decoded.plan.scheduled_new_reqs[0].request_id == "r"


def _accepts(compiler: StructuredOutputCompiler, constraint: StructuredOutput, text: str) -> bool:
    """Whether the compiled constraint lets `text` through, token by token, to an accepting end."""
    grammar = compiler.compile(constraint)
    tokens = compiler.tokenizer.tokenize_str(text)
    return all(grammar.accept(t) for t in tokens) and grammar.matcher.is_accepting()


def test_a_whitespace_pattern_is_what_json_may_have_between_tokens(compiler) -> None:
    schema = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})
    compact, spaced, newline = '{"a":1}', '{ "a": 1 }', '{\n"a":1}'
    plain = StructuredOutput(kind="json", spec=schema)
    assert _accepts(compiler, plain, compact)
    assert not _accepts(compiler, plain, spaced)
    one_space = StructuredOutput(kind="json", spec=schema, whitespace_pattern="[ ]?")
    assert _accepts(compiler, one_space, compact) and _accepts(compiler, one_space, spaced)
    assert not _accepts(compiler, one_space, newline)
    any_object = StructuredOutput(kind="json_object", whitespace_pattern="[\n ]*")
    assert _accepts(compiler, any_object, newline) and _accepts(compiler, any_object, spaced)


@pytest.mark.parametrize(
    ("constraint", "message"),
    [
        (StructuredOutput(kind="json", spec='{"type": "object"}', whitespace_pattern="("), "unclosed group"),
        (
            StructuredOutput(kind="regex", spec="a+", whitespace_pattern=" "),
            "applies to json and json_object",
        ),
    ],
)
def test_a_bad_whitespace_pattern_is_named(compiler, constraint: StructuredOutput, message: str) -> None:
    with pytest.raises(ValueError, match="structured_output") as e:
        compiler.compile(constraint)
    assert message in str(e.value)


def test_the_offline_params_carry_a_whitespace_pattern_on_json_only() -> None:
    from voltllm.sampling_params import StructuredOutputsParams

    wire = StructuredOutputsParams(json={"type": "object"}, whitespace_pattern="[ ]?").to_wire()
    assert wire.kind == "json" and wire.whitespace_pattern == "[ ]?"
    any_object = StructuredOutputsParams(json_object=True, whitespace_pattern="\n?").to_wire()
    assert any_object.whitespace_pattern == "\n?"
    with pytest.raises(ValueError, match="whitespace_pattern applies to json"):
        StructuredOutputsParams(regex="a+", whitespace_pattern=" ")
