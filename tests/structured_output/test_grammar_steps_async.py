"""Structured outputs under asynchronous scheduling: a step with grammars runs ahead like any other.

The mask thread accepts the running step's tokens once they reach the host, fills this step's masks,
then queues the apply and the draw itself, while the main thread plans and stages the next step; the
main thread waits for that draw to be queued only before the next forward reads its ids. On the CPU
the same threads and waits run (the "device" work is done when queued), so every output stream here
must equal the synchronous engine's output by output, for every constraint kind beside unconstrained
rows, with preemption, aborts, sampling options and graph steps. Each run is bounded in time: a wait
that never ends fails the test instead of hanging it.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable

import pytest
import torch
from test_grammar_steps import CASES, MODEL, TOKENIZER, oracle
from toy_model import VOCAB, EagerReplayGraphs, ToyLoaded

from voltllm.config import CacheConfig, EngineConfig, SchedulerConfig
from voltllm.engine.core import EngineCore
from voltllm.engine.llm_engine import LLMEngine
from voltllm.protocol import EngineCoreRequest, EngineSamplingParams, StructuredOutput
from voltllm.worker.cuda_graphs import graph_batch_sizes

# Seconds one engine run may take (the toy steps in milliseconds): past it the run counts as hung.
RUN_LIMIT_S = 120

# What tool_choice="required" sends the engine (rust/server/src/tools/request.rs `required_schema`).
TOOL_CALL_SCHEMA = {
    "type": "array",
    "minItems": 1,
    "maxItems": 1,
    "items": {
        "anyOf": [
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "enum": ["get_weather"]},
                    "arguments": {
                        "type": "object",
                        "properties": {"city": {"type": "string", "maxLength": 5}},
                        "required": ["city"],
                        "additionalProperties": False,
                    },
                },
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        ]
    },
}
KINDS = [
    *CASES,  # regex (ending, bounded, unbounded), choice, JSON schema
    (StructuredOutput(kind="json", spec=json.dumps(TOOL_CALL_SCHEMA)), 70),
    (StructuredOutput(kind="json_object"), 12),
    (StructuredOutput(kind="grammar", spec='start: "(" ITEM ("," ITEM)? ")"\nITEM: /[a-c]{1,3}/'), 20),
    (StructuredOutput(kind="grammar", spec='root ::= "id-" [0-9] [0-9]? ";"'), 20),  # GBNF
]

Stream = list[tuple[list[int], str | None, int | None]]


def toy_engine(async_scheduling: bool, num_blocks: int = 256, graphs: bool = False) -> LLMEngine:
    """The toy model's engine with constrained steps ahead under `async_scheduling`."""
    config = EngineConfig(
        cache=CacheConfig(block_size=4, num_kv_blocks=num_blocks, enable_prefix_caching=False),
        scheduler=SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=8),
        device="cpu",
        async_scheduling=async_scheduling,
    )
    core = EngineCore(config, ToyLoaded(MODEL, max_model_len=128), torch.device("cpu"))
    core.structured_output._tokenizer = TOKENIZER
    if graphs:
        sizes = graph_batch_sizes(8)
        core.runner.capture_cuda_graphs(EagerReplayGraphs(MODEL, sizes, VOCAB, torch.device("cpu")))
    return LLMEngine(config, core)


def mixed_requests(num_copies: int = 1, **params) -> list[EngineCoreRequest]:
    """Every constraint kind `num_copies` times, and three unconstrained requests between them."""
    requests = []
    for i, (constraint, max_tokens) in enumerate(KINDS * num_copies):
        prompt = [(5 * i + 3 * j) % (VOCAB - 1) + 1 for j in range(6 + i % 7)]
        sp = EngineSamplingParams(max_tokens=max_tokens, structured_output=constraint, **params)
        requests.append(EngineCoreRequest(f"c{i}", prompt, sp, 0.0))
        if i % 3 == 1:
            prompt = [(7 * i + j) % (VOCAB - 1) + 1 for j in range(10)]
            sp = EngineSamplingParams(max_tokens=20, ignore_eos=True, **params)
            requests.append(EngineCoreRequest(f"u{i}", prompt, sp, 0.0))
    return requests


def within_limit(run: Callable[[], object]) -> object:
    """`run()` in a thread of its own; fails the test if it has not returned within RUN_LIMIT_S."""
    result: list[object] = []
    error: list[BaseException] = []

    def target() -> None:
        try:
            result.append(run())
        except BaseException as e:  # re-raised on the test's thread
            error.append(e)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(RUN_LIMIT_S)
    assert not thread.is_alive(), f"the engine did not finish within {RUN_LIMIT_S} s: a wait hung"
    if error:
        raise error[0]
    return result[0]


def streams(
    eng: LLMEngine, requests: list[EngineCoreRequest], abort_after: dict[str, int] | None = None
) -> dict[str, Stream]:
    """Every output of every request in order (new tokens, finish reason, stop reason); a request
    named in `abort_after` is aborted once that many of its tokens have been delivered."""
    abort_after = dict(abort_after or {})

    def run() -> dict[str, Stream]:
        for request in requests:
            eng.add_request(request)
        got: dict[str, Stream] = {r.request_id: [] for r in requests}
        while eng.has_unfinished_requests():
            for out in eng.step():
                got[out.request_id].append((out.new_token_ids, out.finish_reason, out.stop_reason))
            for request_id, after in list(abort_after.items()):
                if sum(len(t) for t, _, _ in got[request_id]) >= after:
                    eng.abort_requests([request_id])
                    del abort_after[request_id]
        return got

    return within_limit(run)


def record_steps(eng: LLMEngine) -> list[tuple[bool, bool]]:
    """Per step the runner launches from now on: (left running, a constrained request in the batch)."""
    runner = eng.core.runner
    enqueue = runner.enqueue
    steps: list[tuple[bool, bool]] = []

    def recording_enqueue(plan):
        handle = enqueue(plan)
        steps.append((handle.is_running, runner._num_constrained > 0))
        return handle

    runner.enqueue = recording_enqueue
    return steps


def tokens_of(stream: Stream) -> list[int]:
    return [t for out, _, _ in stream for t in out]


def assert_pool_whole(eng: LLMEngine, num_blocks: int) -> None:
    kv = eng.core.scheduler.kv
    assert kv.num_free_blocks == num_blocks
    assert all(block.ref_cnt == 0 for block in kv.pool.blocks)


@pytest.mark.parametrize("num_blocks", [256, 20], ids=["roomy", "preempting"])
def test_constrained_steps_run_ahead_and_equal_the_synchronous_engine(num_blocks: int) -> None:
    requests = mixed_requests(2, temperature=0.0)
    expected = streams(toy_engine(False, num_blocks), requests)
    for r in requests:  # the synchronous engine is exact: each constrained output is the oracle's
        constraint = r.sampling_params.structured_output
        if constraint is not None:
            tokens, reason = oracle(list(r.prompt_token_ids), constraint, r.sampling_params.max_tokens)
            assert (tokens_of(expected[r.request_id]), expected[r.request_id][-1][1]) == (tokens, reason)
    eng = toy_engine(True, num_blocks)
    steps = record_steps(eng)
    assert streams(eng, requests) == expected
    assert sum(running and constrained for running, constrained in steps) > 10, "grammar steps ran ahead"
    if num_blocks == 20:
        assert eng.core.scheduler.num_preemptions > 0, "the KV cache was meant to run out mid-grammar"
    assert_pool_whole(eng, num_blocks)
    assert eng.core.get_stats().num_generation_tokens == sum(len(tokens_of(s)) for s in expected.values())


@pytest.mark.parametrize(
    "params",
    [
        {"temperature": 0.9, "seed": 7},
        {"temperature": 0.8, "top_k": 6, "top_p": 0.9, "seed": 3},
        {"temperature": 0.0, "logprobs": 1},
        {"temperature": 0.0, "repetition_penalty": 1.2, "presence_penalty": 0.3},
        {"temperature": 0.0, "min_tokens": 2, "logit_bias": {40: 2.0}},
    ],
    ids=["seeded", "seeded-filters", "logprobs", "penalties", "min-tokens-bias"],
)
def test_sampling_options_under_grammars_equal_with_async_on_and_off(params: dict) -> None:
    """Seeded draws in the mask thread read their settings from a copy of the step's upload (the next
    step's staging rewrites it meanwhile); logprobs and penalties keep a step synchronous."""
    requests = mixed_requests(**params)
    expected = streams(toy_engine(False), requests)
    assert streams(toy_engine(True), requests) == expected


def test_graph_steps_with_grammars_run_ahead_exactly() -> None:
    """Decode steps replayed from (stand-in) graphs: the mask thread starts after the replay and
    masks the graph's logits; the next replay reads the ids it drew."""
    requests = mixed_requests(temperature=0.0)
    expected = streams(toy_engine(False), requests)
    eng = toy_engine(True, graphs=True)
    replays: list[int] = []
    replay = eng.core.runner.graphs.replay
    eng.core.runner.graphs.replay = lambda size: replays.append(size) or replay(size)
    steps = record_steps(eng)
    assert streams(eng, requests) == expected
    assert replays and any(running and constrained for running, constrained in steps)


def test_aborts_mid_grammar_deliver_nothing_after_them() -> None:
    requests = mixed_requests(temperature=0.0)
    victims = {"c0": 2, "c5": 4, "c7": 1, "u1": 3}  # constrained and unconstrained, mid-output
    expected = streams(toy_engine(False), requests, victims)
    for request_id in victims:
        assert expected[request_id][-1] == ([], "abort", None)
    eng = toy_engine(True)
    assert streams(eng, requests, victims) == expected
    assert_pool_whole(eng, 256)


def test_stop_tokens_under_grammars_end_streams_at_the_same_token() -> None:
    """A stop id the grammar allows: the asynchronous engine has launched the next step already."""
    digits = StructuredOutput(kind="regex", spec=r"[0-9]{1,30}")
    seven = ord("7") - 31  # the toy's token i is the byte 31 + i
    requests = [
        EngineCoreRequest(
            f"s{i}",
            [i + 1, 2 * i + 3, 5],
            EngineSamplingParams(
                temperature=0.0, max_tokens=30, stop_token_ids=[seven], structured_output=digits
            ),
            0.0,
        )
        for i in range(6)
    ]
    expected = streams(toy_engine(False), requests)
    assert any(s[-1][1:] == ("stop", seven) for s in expected.values()), "a stop id was meant to end one"
    assert streams(toy_engine(True), requests) == expected


def test_a_failing_mask_fill_raises_instead_of_hanging() -> None:
    eng = toy_engine(True)
    for r in mixed_requests(temperature=0.0)[:4]:
        eng.add_request(r)
    calls = [0]
    fill = eng.core.runner.masks._fill

    def failing_fill(matchers) -> None:
        calls[0] += 1
        if calls[0] == 5:
            raise RuntimeError("mask fill failed")
        fill(matchers)

    eng.core.runner.masks._fill = failing_fill

    def run() -> None:
        while eng.has_unfinished_requests():
            eng.step()

    with pytest.raises(RuntimeError, match="mask fill failed"):
        within_limit(run)


def test_a_failing_eager_forward_releases_the_mask_thread() -> None:
    """The mask thread of an eager step waits for its logits: a forward that raises hands it the
    error instead, so the thread is free again."""
    eng = toy_engine(True)
    for r in mixed_requests(temperature=0.0)[:4]:
        eng.add_request(r)
    runner = eng.core.runner
    for _ in range(4):
        within_limit(eng.step)
    model = runner.model

    class Failing:
        def __getattr__(self, name: str):
            return getattr(model, name)

        def __call__(self, *args):
            raise RuntimeError("forward failed")

    runner.model = Failing()
    with pytest.raises(RuntimeError, match="forward failed"):
        within_limit(eng.step)
    assert runner.masks._thread.submit(lambda: "free").result(timeout=RUN_LIMIT_S) == "free"


def test_requests_arriving_while_constrained_steps_run_ahead() -> None:
    """Constrained and unconstrained arrivals between steps join a batch whose last tokens are still on
    their way (their grammars accept them in the next step's mask thread)."""
    requests = mixed_requests(temperature=0.0)
    first, later = requests[::2], requests[1::2]
    arrivals = {3: later[:2], 4: later[2:5], 9: later[5:]}

    def run(eng: LLMEngine) -> dict[str, tuple[list[int], str | None]]:
        def drive() -> dict[str, tuple[list[int], str | None]]:
            for r in first:
                eng.add_request(r)
            pending, got, steps = dict(arrivals), {}, 0
            while eng.has_unfinished_requests() or pending:
                steps += 1
                for r in pending.pop(steps, []):
                    eng.add_request(r)
                for out in eng.step():
                    tokens, _ = got.get(out.request_id, ([], None))
                    got[out.request_id] = (tokens + out.new_token_ids, out.finish_reason)
            return got

        return within_limit(drive)

    expected = run(toy_engine(False))
    assert len(expected) == len(requests)
    assert run(toy_engine(True)) == expected
