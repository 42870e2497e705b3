"""The scheduler's shortcuts change nothing: a scheduler that looks at every running request every step
(its state after each update discarded) makes the same plans, outputs and KV cache decisions, step by
step, under random arrivals, prefix sharing, chunked prefill, stop ids, preemption and aborts."""

from __future__ import annotations

import random

import pytest

from voltllm.config import SchedulerConfig
from voltllm.core.kv_cache_manager import KVCacheManager
from voltllm.core.request import Request
from voltllm.core.sched_output import ModelRunnerOutput, SchedulerOutput
from voltllm.core.scheduler import Scheduler
from voltllm.protocol import EngineSamplingParams

VOCAB = 12  # small, so that sampled tokens hit stop ids and prompts share prefixes


class FullScanScheduler(Scheduler):
    """Forgets, after every update, what the last step tells about the running requests."""

    def update_from_output(self, plan, runner_output):
        outputs = super().update_from_output(plan, runner_output)
        self._to_check = None
        return outputs


def make(cls, num_blocks: int, budget: int, policy: str) -> Scheduler:
    config = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=6, policy=policy)
    return cls(config, KVCacheManager(num_blocks, block_size=4), max_model_len=num_blocks * 4)


def fake_runner(s: Scheduler, plan: SchedulerOutput) -> ModelRunnerOutput:
    """Samples for every request whose scheduled tokens reach its end; the token depends only on the
    request and its length, so both schedulers see the same tokens."""
    out = ModelRunnerOutput()
    for rid, n in plan.num_scheduled_tokens.items():
        r = s.requests.get(rid)
        if r is not None and r.num_computed_tokens + n == r.num_tokens:
            out.sampled_token_ids[rid] = random.Random(f"{rid}:{r.num_tokens}").randrange(VOCAB)
    return out


def plan_view(plan: SchedulerOutput) -> tuple:
    new = [(n.request_id, n.token_ids, n.block_ids, n.num_computed_tokens) for n in plan.scheduled_new_reqs]
    cached = [(c.request_id, c.new_block_ids, c.num_computed_tokens) for c in plan.scheduled_cached_reqs]
    return (
        new,
        cached,
        list(plan.num_scheduled_tokens.items()),
        plan.total_num_scheduled_tokens,
        sorted(plan.finished_req_ids),
    )


def outputs_view(outputs) -> list[tuple]:
    """Everything but the timestamps (the two schedulers run at different times)."""
    return [
        (o.request_id, o.new_token_ids, o.new_logprobs, o.finish_reason, o.stop_reason, o.num_cached_tokens)
        for o in outputs
    ]


def kv_view(s: Scheduler) -> tuple:
    blocks = {rid: [(b.block_id, b.block_hash) for b in bl] for rid, bl in s.kv.req_to_blocks.items()}
    return blocks, s.kv.num_free_blocks, s.get_stats()


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


@pytest.mark.parametrize("seed", range(16))
def test_shortcuts_match_a_full_scan_every_step(seed):
    rng = random.Random(seed)
    num_blocks = rng.choice([12, 20, 64])  # small pools preempt
    budget = rng.choice([3, 6, 16, 64])  # small budgets chunk prompts and cut the running list
    policy = rng.choice(["fcfs", "priority"])
    fast, full = (
        make(Scheduler, num_blocks, budget, policy),
        make(FullScanScheduler, num_blocks, budget, policy),
    )
    next_id, steps_with_shortcut = 0, 0
    for _ in range(160):
        for _ in range(rng.choice([0, 0, 0, 1, 2])):
            r = new_request(rng, next_id)
            next_id += 1
            for s in (fast, full):
                s.add_request(
                    Request(
                        r.request_id, r.prompt_token_ids, r.sampling_params, (0,), r.arrival_time, r.priority
                    )
                )
        if rng.random() < 0.1 and fast.requests:
            victims = rng.sample(sorted(fast.requests), k=1)
            assert [x.request_id for x in fast.abort_requests(victims)] == [
                x.request_id for x in full.abort_requests(victims)
            ]
        steps_with_shortcut += fast._to_check is not None
        plan_fast, plan_full = fast.schedule(), full.schedule()
        assert plan_view(plan_fast) == plan_view(plan_full)
        if rng.random() < 0.05 and fast.requests:  # aborted while its step runs
            victims = rng.sample(sorted(fast.requests), k=1)
            fast.abort_requests(victims)
            full.abort_requests(victims)
        out_fast = fast.update_from_output(plan_fast, fake_runner(fast, plan_fast))
        out_full = full.update_from_output(plan_full, fake_runner(full, plan_full))
        assert outputs_view(out_fast) == outputs_view(out_full)
        assert kv_view(fast) == kv_view(full)
        for rid, r in fast.requests.items():
            other = full.requests[rid]
            assert (r.status, r.num_computed_tokens, r.all_token_ids) == (
                other.status,
                other.num_computed_tokens,
                other.all_token_ids,
            )
    assert steps_with_shortcut > 40  # the shortcut was actually exercised
