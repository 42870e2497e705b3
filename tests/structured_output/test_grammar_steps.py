"""The engine advances grammars one step late (in the next step's mask thread): outputs, finish reasons
and preemption are exactly those of accepting every token at once. The oracle is the toy model's dense
greedy decode under a fresh llguidance matcher; the scheduler's handling of an ended grammar is also
checked without a model, for a request that the step did not run."""

from __future__ import annotations

import sys
from pathlib import Path

import llguidance
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "worker"))
from toy_model import VOCAB, ToyLoaded, ToyModel  # noqa: E402

from voltllm.config import CacheConfig, EngineConfig, SchedulerConfig  # noqa: E402
from voltllm.core.kv_cache_manager import KVCacheManager  # noqa: E402
from voltllm.core.request import Request, RequestStatus  # noqa: E402
from voltllm.core.sched_output import ModelRunnerOutput  # noqa: E402
from voltllm.core.scheduler import Scheduler  # noqa: E402
from voltllm.engine.core import EngineCore  # noqa: E402
from voltllm.engine.llm_engine import LLMEngine  # noqa: E402
from voltllm.protocol import (  # noqa: E402
    EngineCoreRequest,
    EngineSamplingParams,
    StructuredOutput,
)
from voltllm.structured_output import EndedGrammar, Grammar  # noqa: E402
from voltllm.structured_output.compiler import llguidance_grammar  # noqa: E402

EOS = 0
MODEL = ToyModel()


def toy_tokenizer() -> llguidance.LLTokenizer:
    """Token 0 is EOS; token i (1..96) is the single byte 31 + i (printable ASCII and DEL)."""
    tokens = [b"<eos>"] + [bytes([31 + i]) for i in range(1, VOCAB)]

    class Vocabulary:
        bos_token_id = None
        eos_token_id = EOS
        special_token_ids = [EOS]

        def __init__(self) -> None:
            self.tokens = tokens

        def __call__(self, text: bytes) -> list[int]:
            return [b - 31 for b in text]

    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(Vocabulary()), n_vocab=VOCAB)


TOKENIZER = toy_tokenizer()


def oracle(prompt: list[int], constraint: StructuredOutput, max_tokens: int) -> tuple[list[int], str]:
    """Dense greedy decode that accepts each token into the matcher at once (the behaviour to keep)."""
    matcher = llguidance.LLMatcher(TOKENIZER, llguidance_grammar(constraint), log_level=0)
    tokens, out = list(prompt), []
    while True:
        allowed = torch.tensor(list(matcher.compute_logit_bias()), dtype=torch.bool)
        logits = MODEL.dense_logits(tokens)[-1].masked_fill(~allowed, float("-inf"))
        token = int(logits.argmax())
        tokens.append(token)
        out.append(token)
        if token == EOS:
            return out, "stop"
        if len(out) == max_tokens:
            return out, "length"
        assert matcher.consume_token(token)
        if matcher.is_stopped():
            return out, "stop"


def toy_engine(num_blocks: int) -> LLMEngine:
    config = EngineConfig(
        cache=CacheConfig(block_size=4, num_kv_blocks=num_blocks, enable_prefix_caching=False),
        scheduler=SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=8),
        device="cpu",
    )
    core = EngineCore(config, ToyLoaded(MODEL, max_model_len=128), torch.device("cpu"))
    core.structured_output._tokenizer = TOKENIZER
    return LLMEngine(config, core)


CASES = [
    (StructuredOutput(kind="regex", spec=r"[a-z]{2,6}[0-9]"), 40),
    (StructuredOutput(kind="regex", spec=r"(yes|no|maybe)!"), 40),
    (StructuredOutput(kind="regex", spec=r"abc"), 3),  # the grammar ends with the last allowed token
    (StructuredOutput(kind="regex", spec=r"[0-9]+"), 9),  # never ends before max_tokens (or EOS)
    (StructuredOutput(kind="choice", spec='["alpha", "beta", "gamma delta"]'), 40),
    (
        StructuredOutput(
            kind="json",
            spec='{"type": "object", "properties": {"k": {"type": "integer"}},'
            ' "required": ["k"], "additionalProperties": false}',
        ),
        40,
    ),
]


@pytest.mark.parametrize("num_blocks", [256, 14], ids=["roomy", "preempting"])
def test_outputs_equal_accepting_each_token_at_once(num_blocks: int) -> None:
    engine = toy_engine(num_blocks)
    requests, expected = [], {}
    for i, (constraint, max_tokens) in enumerate(CASES * 2):
        prompt = [(5 * i + 3 * j) % (VOCAB - 1) + 1 for j in range(6 + i)]
        params = EngineSamplingParams(temperature=0.0, max_tokens=max_tokens, structured_output=constraint)
        requests.append(EngineCoreRequest(f"c{i}", prompt, params, 0.0))
        expected[f"c{i}"] = oracle(prompt, constraint, max_tokens)
    # Unconstrained requests in the same batch keep their plain greedy tokens.
    for i in range(3):
        prompt = [(7 * i + j) % (VOCAB - 1) + 1 for j in range(10)]
        params = EngineSamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
        requests.append(EngineCoreRequest(f"u{i}", prompt, params, 0.0))
        expected[f"u{i}"] = (MODEL.greedy(prompt, 20), "length")
    before = engine.core.scheduler.num_preemptions
    got = engine.generate_token_ids(requests)
    assert {rid: (out.new_token_ids, out.finish_reason) for rid, out in got.items()} == expected
    assert all(got[r].stop_reason is None for r in expected if expected[r][0][-1] != EOS)
    if num_blocks == 14:
        assert engine.core.scheduler.num_preemptions > before, "the KV cache was meant to run out"
    assert engine.core.scheduler.kv.num_free_blocks == num_blocks


def scheduler_with(
    request_ids: list[str], num_blocks: int = 64, prompt_len: int = 4
) -> tuple[Scheduler, dict[str, Request]]:
    """A scheduler whose constrained requests (`prompt_len` prompt tokens, 4 a block) have sampled
    their first token."""
    config = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8)
    s = Scheduler(config, KVCacheManager(num_blocks, 4), num_blocks * 4)
    requests = {}
    for rid in request_ids:
        r = Request(rid, [1, 2, 3, 4][:prompt_len], EngineSamplingParams(max_tokens=10), eos_token_ids=(EOS,))
        r.grammar = Grammar(llguidance.LLMatcher(TOKENIZER, llguidance_grammar(CASES[0][0]), log_level=0))
        s.add_request(r)
        requests[rid] = r
    plan = s.schedule()
    s.update_from_output(plan, ModelRunnerOutput([70] * len(request_ids)))  # 'a' each
    return s, requests


def test_an_ended_grammar_finishes_its_request_without_this_steps_token() -> None:
    s, reqs = scheduler_with(["a", "b"])
    plan = s.schedule()
    ended = [EndedGrammar("a", reqs["a"].grammar, None), EndedGrammar("b", reqs["b"].grammar, "rejected 70")]
    outs = s.update_from_output(plan, ModelRunnerOutput([0, 0], ended_grammars=ended))
    by_id = {o.request_id: o for o in outs}
    assert by_id["a"].new_token_ids == [] and by_id["a"].finish_reason == "stop"
    assert by_id["a"].stop_reason is None and by_id["a"].error is None
    assert by_id["b"].new_token_ids == [] and by_id["b"].finish_reason == "error"
    assert by_id["b"].error == "rejected 70"
    assert reqs["a"].all_token_ids == [1, 2, 3, 4, 70] and reqs["a"].status is RequestStatus.FINISHED_STOPPED
    assert not s.running and not s.requests and s.kv.num_free_blocks == 64
    assert s.schedule().finished_req_ids == {"a", "b"}


def test_an_ended_grammar_of_a_request_the_step_did_not_run_finishes_it_too() -> None:
    s, reqs = scheduler_with(["a", "b"], num_blocks=2)
    plan = s.schedule()  # a's next token needs b's block: b is preempted, its last token not yet accepted
    assert list(plan.num_scheduled_tokens) == ["a"] and reqs["b"].status is RequestStatus.PREEMPTED
    ended = [EndedGrammar("b", reqs["b"].grammar, None)]
    outs = s.update_from_output(plan, ModelRunnerOutput([71], ended_grammars=ended))
    assert [(o.request_id, o.new_token_ids, o.finish_reason) for o in outs] == [
        ("a", [71], None),
        ("b", [], "stop"),
    ]
    assert len(s.waiting) == 0 and "b" not in s.requests


def test_a_request_preempted_after_its_grammar_ended_gets_no_token() -> None:
    """Asynchronous scheduling: the plan made while a step runs preempts b, then that step's output
    says b's grammar had ended before it: b's token of the step is dropped and b finishes."""
    s, reqs = scheduler_with(["a", "b"], num_blocks=3, prompt_len=3)
    running = s.schedule()  # both decode their 4th token, in their first block
    s.advance(running)
    plan = s.schedule()  # the 5th tokens need a block each: one is left, b is preempted
    assert list(plan.num_scheduled_tokens) == ["a"] and reqs["b"].status is RequestStatus.PREEMPTED
    ended = [EndedGrammar("b", reqs["b"].grammar, None)]
    outs = s.update_from_output(running, ModelRunnerOutput([71, 72], ended_grammars=ended))
    assert [(o.request_id, o.new_token_ids, o.finish_reason) for o in outs] == [
        ("a", [71], None),
        ("b", [], "stop"),
    ]
    assert reqs["b"].all_token_ids == [1, 2, 3, 70] and "b" not in s.requests and not s.waiting


def test_an_ended_grammar_of_a_finished_or_replaced_request_is_ignored() -> None:
    s, reqs = scheduler_with(["a"])
    stale = EndedGrammar("a", Grammar(reqs["a"].grammar.matcher.deep_copy()), None)  # another grammar
    plan = s.schedule()
    outs = s.update_from_output(plan, ModelRunnerOutput([71], ended_grammars=[stale]))
    assert [(o.new_token_ids, o.finish_reason) for o in outs] == [([71], None)]
    assert reqs["a"].status is RequestStatus.RUNNING
