"""EngineCore request handling on the toy model: validation errors, aborts, utilities, READY."""

from __future__ import annotations

import resource
import time
from types import SimpleNamespace

import pytest
import torch
from toy_model import VOCAB, ToyLoaded, ToyModel

from voltllm.config import CacheConfig, EngineConfig, SchedulerConfig
from voltllm.engine.core import EngineCore
from voltllm.protocol import EngineCoreRequest, EngineSamplingParams
from voltllm.sampling_params import SamplingParams


@pytest.fixture
def core() -> EngineCore:
    config = EngineConfig(
        cache=CacheConfig(block_size=4, num_kv_blocks=64),
        scheduler=SchedulerConfig(max_num_batched_tokens=32),
        device="cpu",
    )
    return EngineCore(config, ToyLoaded(ToyModel(), max_model_len=64), torch.device("cpu"))


def request(rid: str, prompt=(5, 6, 7), **sp) -> EngineCoreRequest:
    sp.setdefault("max_tokens", 3)
    return EngineCoreRequest(rid, list(prompt), EngineSamplingParams(**sp), 0.0)


def run(core: EngineCore) -> dict[str, list]:
    outs: dict[str, list] = {}
    while core.has_unfinished_requests():
        for o in core.step().outputs:
            outs.setdefault(o.request_id, []).append(o)
    return outs


@pytest.mark.parametrize(
    ("req", "message"),
    [
        (request("empty", prompt=()), "empty"),
        (request("long", prompt=[1] * 64), "max_model_len"),
        (request("vocab", prompt=[1, VOCAB]), "vocabulary"),
        (request("temp", temperature=-1.0), "temperature"),
        (request("top_p", top_p=0.0), "top_p"),
        (request("min_tokens", min_tokens=9, max_tokens=3), "min_tokens"),
        (request("stop_ids", stop_token_ids=[VOCAB + 5]), "stop_token_ids"),
        (request("bias", logit_bias={3: 500.0}), "logit_bias"),
        (request("logprobs", logprobs=21), "logprobs"),
        (request("max_tokens", max_tokens=0), "max_tokens"),
    ],
)
def test_invalid_request_fails_alone(core, req, message):
    core.add_request(request("good"))
    core.add_request(req)
    outs = run(core)
    [bad] = outs[req.request_id]
    assert bad.finish_reason == "error" and message in bad.error and bad.new_token_ids == []
    good = outs["good"]
    assert sum(len(o.new_token_ids) for o in good) == 3 and good[-1].finish_reason in ("length", "stop")


def test_duplicate_id_is_rejected_while_live(core):
    core.add_request(request("a", max_tokens=5))
    core.add_request(request("a"))
    first = core.step().outputs
    assert [o.finish_reason for o in first if o.request_id == "a" and o.error] == ["error"]
    assert "duplicate" in next(o.error for o in first if o.error)
    outs = run(core)
    assert sum(len(o.new_token_ids) for o in outs["a"]) + 1 == 5  # the live one was not disturbed
    core.add_request(request("a"))  # finished: the id may be reused
    assert run(core)["a"][-1].finish_reason in ("length", "stop")


def test_abort_running_and_unknown(core):
    core.add_request(request("a", max_tokens=50, ignore_eos=True))
    core.add_request(request("b", prompt=[9, 9, 9, 9, 9], max_tokens=50, ignore_eos=True))
    core.step()
    core.step()
    core.abort_requests(["a", "nope"])
    outs = core.step().outputs
    aborted = [o for o in outs if o.request_id == "a"]
    assert len(aborted) == 1 and aborted[0].finish_reason == "abort"
    core.abort_requests(["b"])
    run(core)
    assert core.scheduler.kv.num_free_blocks == 64
    assert core.runner.requests == {}  # the runner dropped their state too


def test_utilities_and_ready(core):
    assert core.call_utility("ping", []) == "pong"
    assert core.call_utility("get_stats", [])["num_running"] == 0
    assert core.call_utility("reset_prefix_cache", []) is True
    with pytest.raises(ValueError, match="unknown utility"):
        core.call_utility("format_disk", [])
    ready = core.ready_message()
    assert (ready.vocab_size, ready.num_kv_blocks, ready.block_size, ready.max_model_len) == (
        VOCAB,
        64,
        4,
        64,
    )
    assert ready.dtype == "float64"


def test_user_sampling_params_validate_and_convert():
    sp = SamplingParams(temperature=1, stop="x", logit_bias={"5": 1})
    wire = sp.to_wire()
    assert isinstance(wire.temperature, float) and wire.logit_bias == {5: 1.0} and sp.stop == ["x"]
    for bad, field in [
        ({"n": 0}, "n"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"seed": 2**64}, "seed"),
        ({"presence_penalty": float("nan")}, "presence_penalty"),
        ({"stop": [""]}, "stop"),
    ]:
        with pytest.raises(ValueError, match=field):
            SamplingParams(**bad)


class _Runner:
    """Delegates to the real runner; reports a fixed split when `timings` is given, else none."""

    def __init__(self, runner, timings: SimpleNamespace | None) -> None:
        self._runner, self._timings = runner, timings

    def execute_model(self, plan):
        out = self._runner.execute_model(plan)
        if self._timings is not None:
            self.last_timings = self._timings
        return out


def test_step_timings_cover_the_step(core):
    core.runner = _Runner(core.runner, None)
    core.add_request(request("a", max_tokens=4))
    core.add_request(request("b", prompt=[1, 2, 3, 4, 5, 6], max_tokens=4))
    glue_within_bound = []
    for _ in range(4):
        preemptions = _involuntary_switches()
        start = time.perf_counter()
        core.step()
        wall = time.perf_counter() - start
        undisturbed = _involuntary_switches() == preemptions
        t = core.last_step_timings
        parts = (t.schedule_s, t.execute_s, t.update_s, t.outputs_s)
        assert min(parts) >= 0 and t.execute_s > 0
        assert sum(parts) <= t.total_s <= wall
        # Only glue between the parts: a few microseconds of code, unless the loaded machine took the
        # core away in it (milliseconds), which a step the scheduler never preempted rules out.
        glue_within_bound.append(t.total_s - sum(parts) <= max(0.25 * t.total_s, 2e-3))
        assert glue_within_bound[-1] or not undisturbed, t
        # A runner that reports no split leaves it at 0: the whole step is host time.
        assert (t.prepare_s, t.forward_s, t.sync_s, t.post_s) == (0, 0, 0, 0) and t.host_s == t.total_s
    assert any(glue_within_bound), "every step spent more than its bound outside the timed parts"
    while core.scheduler.has_work():  # the runner is told about finished requests
        core.step()
    idle = core.step()
    assert idle.outputs == [] and core.last_step_timings.execute_s == 0


def _involuntary_switches() -> int:
    """How many times the scheduler has preempted this thread (Linux counts them per thread)."""
    return resource.getrusage(resource.RUSAGE_THREAD).ru_nivcsw


def test_step_timings_take_the_runner_split(core):
    split = SimpleNamespace(prepare_s=1e-4, forward_s=2e-4, sync_s=3e-4, post_s=4e-4)
    core.runner = _Runner(core.runner, split)
    core.add_request(request("a"))
    core.step()
    t = core.last_step_timings
    assert (t.prepare_s, t.forward_s, t.sync_s, t.post_s) == (1e-4, 2e-4, 3e-4, 4e-4)
    assert t.host_s == pytest.approx(t.total_s - 3e-4)
