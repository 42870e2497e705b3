"""The scheduler's invariants hold after every step under random workloads: arrivals, prefix sharing,
chunked prefill, stop ids, min_tokens, preemption (small pools), both policies, and aborts between
steps and while a step runs.

Checked each step: the plan (running requests first and in order, within the budget, each for at most
its uncomputed tokens, new blocks only for requests that outgrew theirs), the KV cache (every block
counted once: free, or referenced by exactly the requests that hold it; each request's blocks hold
its scheduled tokens; `num_slots` is its blocks' size) and the requests (status, progress, outputs).
"""

from __future__ import annotations

import random
from collections import Counter

import pytest

from voltllm.config import SchedulerConfig
from voltllm.core.kv_cache_manager import KVCacheManager
from voltllm.core.request import Request, RequestStatus
from voltllm.core.sched_output import ModelRunnerOutput, SchedulerOutput
from voltllm.core.scheduler import Scheduler
from voltllm.protocol import EngineSamplingParams

VOCAB = 12  # small, so that sampled tokens hit stop ids and prompts share prefixes
BLOCK_SIZE = 4


def make(num_blocks: int, budget: int, policy: str) -> Scheduler:
    config = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=6, policy=policy)
    kv = KVCacheManager(num_blocks, block_size=BLOCK_SIZE)
    return Scheduler(config, kv, max_model_len=num_blocks * BLOCK_SIZE)


def fake_runner(s: Scheduler, plan: SchedulerOutput) -> ModelRunnerOutput:
    """Samples for every request whose scheduled tokens reach its end (a token that depends only on
    the request and its length)."""
    out = ModelRunnerOutput()
    for rid, n in plan.num_scheduled_tokens.items():
        r = s.requests.get(rid)
        samples = r is not None and r.num_computed_tokens + n == r.num_tokens
        out.sampled_token_ids.append(
            random.Random(f"{rid}:{r.num_tokens}").randrange(VOCAB) if samples else None
        )
    return out


def new_request(rng: random.Random, i: int) -> Request:
    prefix = [1, 2, 3, 4, 5, 6, 7, 8][: rng.choice([0, 4, 8])]  # shared full blocks
    prompt = prefix + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 14))]
    params = EngineSamplingParams(
        max_tokens=rng.randint(1, 24),
        min_tokens=rng.choice([0, 0, 3]),
        stop_token_ids=rng.choice([[], [], [5]]),
        ignore_eos=rng.random() < 0.5,
    )
    return Request(
        f"r{i}", prompt, params, eos_token_ids=(0,), arrival_time=float(i), priority=rng.randint(0, 2)
    )


def check_plan(s: Scheduler, plan: SchedulerOutput, running_before: list[Request], budget: int) -> None:
    scheduled = plan.num_scheduled_tokens
    assert sum(scheduled.values()) == plan.total_num_scheduled_tokens <= budget
    assert all(n >= 1 for n in scheduled.values())
    new_ids = [n.request_id for n in plan.scheduled_new_reqs]
    running_ids = [rid for rid in scheduled if rid not in new_ids]
    # Running requests first, in running order (preempted ones dropped), then the admitted ones.
    assert list(scheduled) == running_ids + new_ids
    assert running_ids == [r.request_id for r in running_before if r.request_id in scheduled]
    assert [r.request_id for r in s.running] == running_ids + new_ids + [
        r.request_id for r in s.running if r.request_id not in scheduled
    ]
    if new_ids:  # nothing is admitted while a running request waits for budget or was preempted
        assert len(running_ids) == len([r for r in running_before if r.status is RequestStatus.RUNNING])
    for rid, n in scheduled.items():
        r = s.requests[rid]
        assert r.status is RequestStatus.RUNNING
        assert r.num_computed_tokens + n <= r.num_tokens
        assert r.num_computed_tokens + n <= s.kv.num_slots[rid] == BLOCK_SIZE * len(s.kv.req_to_blocks[rid])
    cached = {c.request_id: c for c in plan.scheduled_cached_reqs}
    assert set(cached) <= set(running_ids) and len(cached) == len(plan.scheduled_cached_reqs)
    for rid, c in cached.items():
        assert c.num_computed_tokens == s.requests[rid].num_computed_tokens
        assert list(c.new_block_ids) == s.kv.get_block_ids(rid)[-len(c.new_block_ids) :]


def check_kv(s: Scheduler) -> None:
    refs = Counter(b.block_id for blocks in s.kv.req_to_blocks.values() for b in blocks)
    pool = s.kv.pool
    assert all(pool.blocks[i].ref_cnt == n for i, n in refs.items())
    assert s.kv.num_free_blocks + len(refs) == s.kv.num_blocks
    assert set(s.kv.req_to_blocks) == {r.request_id for r in s.running}
    for r in s.running:
        blocks = s.kv.req_to_blocks[r.request_id]
        assert s.kv.num_slots[r.request_id] == BLOCK_SIZE * len(blocks) >= r.num_computed_tokens


def check_requests(s: Scheduler) -> None:
    assert set(s.requests) == {r.request_id for r in s.running} | {
        r.request_id
        for r in s.requests.values()
        if r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
    }
    assert len(s.running) + len(s.waiting) == len(s.requests)
    for r in s.running:
        assert r.status is RequestStatus.RUNNING and 0 <= r.num_computed_tokens <= r.num_tokens
        assert r.num_output_tokens <= r.sampling_params.max_tokens


@pytest.mark.parametrize("seed", range(24))
def test_invariants_hold_every_step(seed):
    rng = random.Random(seed)
    num_blocks = rng.choice([12, 20, 64])  # small pools preempt
    budget = rng.choice([3, 6, 16, 64])  # small budgets chunk prompts and cut the running list
    s = make(num_blocks, budget, rng.choice(["fcfs", "priority"]))
    next_id, finished = 0, 0
    for _ in range(160):
        for _ in range(rng.choice([0, 0, 0, 1, 2])):
            s.add_request(new_request(rng, next_id))
            next_id += 1
        if rng.random() < 0.1 and s.requests:
            s.abort_requests(rng.sample(sorted(s.requests), k=1))
        running_before = list(s.running)
        plan = s.schedule()
        check_plan(s, plan, running_before, budget)
        check_kv(s)
        aborted = set()
        if rng.random() < 0.05 and s.requests:  # aborted while its step runs: no output for it
            aborted = {r.request_id for r in s.abort_requests(rng.sample(sorted(s.requests), k=1))}
        runner_output = fake_runner(s, plan)
        samplers = {
            rid
            for rid, t in zip(plan.num_scheduled_tokens, runner_output.sampled_token_ids, strict=True)
            if t is not None
        }
        outputs = s.update_from_output(plan, runner_output)
        assert [o.request_id for o in outputs] == [
            rid for rid in plan.num_scheduled_tokens if rid in samplers - aborted
        ]
        for o in outputs:
            assert len(o.new_token_ids) == 1
            assert (o.finish_reason is None) == (o.request_id in s.requests)
        finished += sum(o.finish_reason is not None for o in outputs)
        check_kv(s)
        check_requests(s)
    assert finished > 5 and next_id > 20  # the workload did something
    if num_blocks == 12:
        assert s.num_preemptions > 0  # the smallest pool always runs dry


def _run_workload(seed: int, steady_decode: bool) -> tuple[list[tuple], int]:
    """Plans and outputs of a workload with quiet stretches (arrivals in bursts, long generations),
    where the steady-decode fast path applies; and how many plans it made."""
    rng = random.Random(seed)
    s = make(num_blocks=rng.choice([20, 64]), budget=rng.choice([6, 16, 64]), policy="fcfs")
    s.enable_steady_decode = steady_decode
    fast = 0
    plain_steady = s._schedule_steady_decode

    def counted(steady):
        nonlocal fast
        fast += 1
        return plain_steady(steady)

    s._schedule_steady_decode = counted
    trace, next_id = [], 0
    for step in range(200):
        if step % 50 < 3:  # a burst of arrivals, then quiet
            for _ in range(rng.choice([1, 2])):
                s.add_request(new_request(rng, next_id))
                next_id += 1
        if rng.random() < 0.03 and s.requests:
            s.abort_requests(rng.sample(sorted(s.requests), k=1))
        plan = s.schedule()
        outputs = s.update_from_output(plan, fake_runner(s, plan))
        trace.append(
            (
                [n.request_id for n in plan.scheduled_new_reqs],
                [(c.request_id, c.new_block_ids, c.num_computed_tokens) for c in plan.scheduled_cached_reqs],
                dict(plan.num_scheduled_tokens),
                plan.total_num_scheduled_tokens,
                sorted(plan.finished_req_ids),
                [(o.request_id, o.new_token_ids, o.finish_reason) for o in outputs],
            )
        )
    return trace, fast


@pytest.mark.parametrize("seed", range(12))
def test_steady_decode_fast_path_plans_what_the_plain_path_plans(seed):
    fast_trace, fast_plans = _run_workload(seed, steady_decode=True)
    plain_trace, plain_fast_plans = _run_workload(seed, steady_decode=False)
    assert plain_fast_plans == 0
    assert fast_plans > 0  # the fast path really ran
    assert fast_trace == plain_trace
