"""Asynchronous scheduling on the CPU toy model: every output stream equals the synchronous engine's.

The CPU runs the asynchronous path for real (step N+1 planned and launched before step N's ids are
read, the next inputs filled from the device-side ids, outputs one step behind); only the overlap
itself needs a GPU. Each test runs the same requests through an engine with `async_scheduling` off and
on and compares the streams output by output, so a token gained, lost or moved between steps fails.
"""

from __future__ import annotations

import random

import pytest
import torch
from toy_model import VOCAB, EagerReplayGraphs, ToyLoaded, ToyModel

from voltllm.config import CacheConfig, EngineConfig, SchedulerConfig
from voltllm.engine.core import EngineCore
from voltllm.engine.llm_engine import LLMEngine
from voltllm.protocol import EngineCoreOutput, EngineCoreRequest, EngineSamplingParams
from voltllm.worker.cuda_graphs import graph_batch_sizes

MODEL = ToyModel()


def engine(async_scheduling: bool, num_blocks: int = 256, budget: int = 16, max_seqs: int = 8) -> LLMEngine:
    config = EngineConfig(
        cache=CacheConfig(block_size=4, num_kv_blocks=num_blocks),
        scheduler=SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs),
        device="cpu",
        async_scheduling=async_scheduling,
    )
    core = EngineCore(config, ToyLoaded(MODEL, max_model_len=96), torch.device("cpu"))
    assert core.async_scheduling is async_scheduling
    return LLMEngine(config, core)


Stream = list[tuple[list[int], str | None, int | None]]


def streams(eng: LLMEngine, requests: list[EngineCoreRequest]) -> dict[str, Stream]:
    """Every output of every request, in order: (new tokens, finish reason, stop reason)."""
    for request in requests:
        eng.add_request(request)
    got: dict[str, Stream] = {r.request_id: [] for r in requests}
    while eng.has_unfinished_requests():
        for out in eng.step():
            got[out.request_id].append((out.new_token_ids, out.finish_reason, out.stop_reason))
    return got


def workload(rng_seed: int, count: int, **params) -> list[EngineCoreRequest]:
    """Prompts of 1-40 tokens (several chunks at a budget of 16), outputs of 1-30 tokens."""
    rng = random.Random(rng_seed)
    requests = []
    for i in range(count):
        prompt = [rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 40))]
        sp = EngineSamplingParams(max_tokens=rng.randint(1, 30), **params)
        requests.append(EngineCoreRequest(f"r{i}", prompt, sp, 0.0))
    return requests


def assert_pool_whole(eng: LLMEngine, num_blocks: int) -> None:
    """Every KV block went back exactly once: all free, none still referenced."""
    kv = eng.core.scheduler.kv
    assert kv.num_free_blocks == num_blocks
    assert all(block.ref_cnt == 0 for block in kv.pool.blocks)


@pytest.mark.parametrize("num_blocks", [256, 24], ids=["roomy", "preempting"])
def test_greedy_streams_equal_with_async_on_and_off(num_blocks: int) -> None:
    requests = workload(0, 14, temperature=0.0, ignore_eos=True)
    sync_engine = engine(False, num_blocks)
    expected = streams(sync_engine, requests)
    async_engine = engine(True, num_blocks)
    assert streams(async_engine, requests) == expected
    for r in requests:  # the length limit holds: no token past max_tokens
        assert sum(len(t) for t, _, _ in expected[r.request_id]) == r.sampling_params.max_tokens
    if num_blocks == 24:
        assert async_engine.core.scheduler.num_preemptions > 0, "the KV cache was meant to run out"
    assert_pool_whole(async_engine, num_blocks)
    sync_stats, async_stats = sync_engine.get_stats(), async_engine.get_stats()
    assert async_stats.num_generation_tokens == sync_stats.num_generation_tokens


def test_stop_token_ids_and_eos_end_streams_at_the_same_token() -> None:
    """Stops that only the sampled id reveals: the asynchronous engine has already launched the
    request's next step when it learns of them, and must drop that token."""
    plain = workload(1, 10, temperature=0.0, ignore_eos=True)
    reference = streams(engine(False), plain)
    requests = []
    for r in plain:
        tokens = [t for out, _, _ in reference[r.request_id] for t in out]
        # Stop on the token generated halfway (or at once), and on EOS (id 0) too.
        stop = [tokens[len(tokens) // 2]]
        sp = EngineSamplingParams(
            temperature=0.0, max_tokens=r.sampling_params.max_tokens, stop_token_ids=stop
        )
        requests.append(EngineCoreRequest(r.request_id, r.prompt_token_ids, sp, 0.0))
    expected = streams(engine(False), requests)
    assert any(out[-1][1] == "stop" and len(out) > 1 for out in expected.values())
    async_engine = engine(True)
    assert streams(async_engine, requests) == expected
    assert_pool_whole(async_engine, 256)


def test_steady_decode_reaching_max_tokens_computes_nothing_past_it() -> None:
    """Same-length requests decode in lockstep on the steady fast path; its length limit stops the
    plan before a request whose last token is on its way would get another."""
    requests = [
        EngineCoreRequest(
            f"s{i}", [i + 1, i + 2], EngineSamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True), 0.0
        )
        for i in range(6)
    ]
    expected = streams(engine(False), requests)
    async_engine = engine(True)
    computed = []
    original_enqueue = async_engine.core.runner.enqueue

    def enqueue(plan):
        computed.append(dict(plan.num_scheduled_tokens))
        return original_enqueue(plan)

    async_engine.core.runner.enqueue = enqueue
    assert streams(async_engine, requests) == expected
    # 2 prompt tokens + 9 outputs: positions 0..9 need computing (the 9th output is never an input).
    for r in requests:
        assert sum(step.get(r.request_id, 0) for step in computed) == 10


def test_max_model_len_is_never_exceeded() -> None:
    rng = random.Random(3)
    requests = [
        EngineCoreRequest(
            f"m{i}",
            [rng.randrange(1, VOCAB) for _ in range(90 - i)],
            EngineSamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True),
            0.0,
        )
        for i in range(4)
    ]
    expected = streams(engine(False, budget=128), requests)
    assert streams(engine(True, budget=128), requests) == expected
    for i in range(4):  # max_model_len 96: 96 - (90 - i) tokens each
        assert sum(len(t) for t, _, _ in expected[f"m{i}"]) == 6 + i


@pytest.mark.parametrize(
    "params",
    [
        {"temperature": 0.8, "seed": 11},
        {"temperature": 0.7, "top_k": 5, "top_p": 0.9, "seed": 5},
        {"temperature": 0.0, "logprobs": 2},
        {"temperature": 0.0, "repetition_penalty": 1.3, "frequency_penalty": 0.4},
        {"temperature": 0.0, "min_tokens": 4, "logit_bias": {7: 3.0}},
    ],
    ids=["seeded", "seeded-filters", "logprobs", "penalties", "min-tokens-bias"],
)
def test_sampling_options_equal_with_async_on_and_off(params: dict) -> None:
    """Seeded draws count the tokens on their way; logprobs and penalties make the step finish at
    once (their inputs or outputs are host ids) and still give the same tokens."""
    requests = workload(2, 10, **params)
    expected = streams(engine(False), requests)
    assert streams(engine(True), requests) == expected


def test_seeded_tokens_do_not_depend_on_the_batch_under_async() -> None:
    params = EngineSamplingParams(temperature=1.0, seed=42, max_tokens=12, ignore_eos=True)
    alone = streams(engine(True), [EngineCoreRequest("x", [3, 4, 5], params, 0.0)])["x"]
    crowd = workload(4, 7, temperature=0.9, ignore_eos=True)
    together = streams(engine(True), [*crowd, EngineCoreRequest("x", [3, 4, 5], params, 0.0)])["x"]
    assert [t for out, _, _ in together for t in out] == [t for out, _, _ in alone for t in out]


def test_abort_mid_stream_delivers_nothing_after_it() -> None:
    requests = workload(5, 6, temperature=0.0, ignore_eos=True)
    requests = [
        EngineCoreRequest(
            r.request_id,
            r.prompt_token_ids,
            EngineSamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
            0.0,
        )
        for r in requests
    ]
    expected = streams(engine(False), requests)
    eng = engine(True)
    for r in requests:
        eng.add_request(r)
    got: dict[str, list[EngineCoreOutput]] = {r.request_id: [] for r in requests}
    aborted_after: int | None = None
    while eng.has_unfinished_requests():
        for out in eng.step():
            got[out.request_id].append(out)
        delivered = sum(len(o.new_token_ids) for o in got["r2"])
        if aborted_after is None and delivered >= 5:
            eng.abort_requests(["r2"])  # its next token is already being computed
            aborted_after = len(got["r2"])
    assert aborted_after is not None
    after = got["r2"][aborted_after:]
    assert [(o.new_token_ids, o.finish_reason) for o in after] == [([], "abort")]
    before = [t for o in got["r2"][:aborted_after] for t in o.new_token_ids]
    full = [t for out, _, _ in expected["r2"] for t in out]
    assert before == full[: len(before)]
    for r in requests:  # the others are untouched
        if r.request_id != "r2":
            assert [(o.new_token_ids, o.finish_reason, o.stop_reason) for o in got[r.request_id]] == expected[
                r.request_id
            ]
    assert_pool_whole(eng, 256)


def test_requests_arriving_while_a_step_runs() -> None:
    """Arrivals between steps join a batch whose ids are still on the device (the next inputs of the
    running requests are filled there, the new ones from the host)."""
    first, later = (
        workload(6, 5, temperature=0.0, ignore_eos=True),
        workload(7, 5, temperature=0.0, ignore_eos=True),
    )
    later = [
        EngineCoreRequest("late-" + r.request_id, r.prompt_token_ids, r.sampling_params, 0.0) for r in later
    ]

    def run(eng: LLMEngine) -> dict[str, list[int]]:
        for r in first:
            eng.add_request(r)
        arrivals = {3: later[:2], 4: later[2:3], 9: later[3:]}
        got: dict[str, list[int]] = {}
        steps = 0
        while eng.has_unfinished_requests() or arrivals:
            steps += 1
            for r in arrivals.pop(steps, []):
                eng.add_request(r)
            for out in eng.step():
                got.setdefault(out.request_id, []).extend(out.new_token_ids)
        return got

    expected = {
        r.request_id: MODEL.greedy(r.prompt_token_ids, r.sampling_params.max_tokens) for r in first + later
    }
    assert run(engine(True)) == expected


def test_async_scheduling_defaults_off_on_the_cpu() -> None:
    config = EngineConfig(cache=CacheConfig(block_size=4, num_kv_blocks=64), device="cpu")
    core = EngineCore(config, ToyLoaded(MODEL, max_model_len=64), torch.device("cpu"))
    assert core.async_scheduling is False


def test_async_scheduling_with_tensor_parallelism_is_refused() -> None:
    with pytest.raises(ValueError, match="async_scheduling"):
        EngineConfig(tensor_parallel_size=2, async_scheduling=True)


@pytest.mark.parametrize(
    ("flags", "value"), [([], None), (["--async-scheduling"], True), (["--no-async-scheduling"], False)]
)
def test_async_scheduling_flags_reach_the_engine_and_survive_to_argv(
    flags: list[str], value: bool | None
) -> None:
    from voltllm.engine.args import engine_config_from_args, to_argv
    from voltllm.entrypoints.cli import build_parser

    args = build_parser().parse_args(["serve", *flags])
    assert engine_config_from_args(args).async_scheduling is value
    again = build_parser().parse_args(["serve", *to_argv(args, None)])
    assert again.async_scheduling is value


def test_graph_steps_read_the_ids_left_on_the_device() -> None:
    """The graph path (padded buckets, inputs in the persistent buffers) with the ids of the running
    step written there on the device: the greedy tokens are the dense model's."""
    requests = workload(8, 9, temperature=0.0, ignore_eos=True)
    eng = engine(True)
    runner = eng.core.runner
    runner.capture_cuda_graphs(EagerReplayGraphs(MODEL, graph_batch_sizes(8), VOCAB, torch.device("cpu")))
    replays: list[int] = []
    replay = runner.graphs.replay
    runner.graphs.replay = lambda size: replays.append(size) or replay(size)
    got = streams(eng, requests)
    assert len(set(replays)) >= 3, f"decode steps should replay several buckets, got {sorted(set(replays))}"
    for r in requests:
        tokens = [t for out, _, _ in got[r.request_id] for t in out]
        assert tokens == MODEL.greedy(r.prompt_token_ids, r.sampling_params.max_tokens)
