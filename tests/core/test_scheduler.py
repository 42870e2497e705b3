"""Scheduler policy without a model: a fake runner samples token 7 whenever a request may sample."""

from __future__ import annotations

from voltllm.config import SchedulerConfig
from voltllm.core.kv_cache_manager import KVCacheManager
from voltllm.core.request import Request, RequestStatus
from voltllm.core.sched_output import ModelRunnerOutput, SchedulerOutput
from voltllm.core.scheduler import Scheduler
from voltllm.protocol import EngineSamplingParams

TOKEN = 7


def make(
    num_blocks=64, block_size=4, budget=32, max_seqs=16, policy="fcfs", max_model_len=None, chunked=True
):
    cfg = SchedulerConfig(
        max_num_batched_tokens=budget, max_num_seqs=max_seqs, policy=policy, enable_chunked_prefill=chunked
    )
    return Scheduler(cfg, KVCacheManager(num_blocks, block_size), max_model_len or num_blocks * block_size)


def add(s: Scheduler, rid: str, n: int, max_tokens=4, priority=0, first_token=1, **sp) -> Request:
    r = Request(
        rid,
        list(range(first_token, first_token + n)),
        EngineSamplingParams(max_tokens=max_tokens, ignore_eos=True, **sp),
        eos_token_ids=(0,),
        priority=priority,
    )
    s.add_request(r)
    return r


def fake_run(s: Scheduler, plan: SchedulerOutput):
    out = ModelRunnerOutput()
    for rid, n in plan.num_scheduled_tokens.items():
        r = s.requests[rid]
        out.sampled_token_ids.append(TOKEN if r.num_computed_tokens + n == r.num_tokens else None)
    return s.update_from_output(plan, out)


def step(s: Scheduler):
    plan = s.schedule()
    return plan, fake_run(s, plan)


def test_budget_chunking_and_mixing_prefill_with_decode():
    s = make(budget=10)
    add(s, "a", 6)
    plan, outs = step(s)
    assert dict(plan.num_scheduled_tokens) == {"a": 6} and [o.new_token_ids for o in outs] == [[TOKEN]]
    add(s, "b", 20, first_token=30)
    plan, outs = step(s)
    # a's decode first, then as much of b's prompt as the budget allows: a chunk, no sample for b
    assert list(plan.num_scheduled_tokens.items()) == [("a", 1), ("b", 9)]
    assert [o.request_id for o in outs] == ["a"]
    assert plan.scheduled_new_reqs[0].request_id == "b"
    assert plan.scheduled_cached_reqs == ()  # a's 8th token stays inside its 2nd block: no diff for it
    plan, outs = step(s)
    assert dict(plan.num_scheduled_tokens) == {"a": 1, "b": 9}
    plan, outs = step(s)
    assert dict(plan.num_scheduled_tokens) == {"a": 1, "b": 2}
    assert {o.request_id for o in outs} == {"a", "b"}
    assert s.requests.get("a") is None  # max_tokens=4 reached: finished and freed
    assert s.requests["b"].num_computed_tokens == 20 and s.requests["b"].num_tokens == 21


def test_no_chunking_waits_for_budget():
    s = make(budget=8, chunked=False)
    add(s, "a", 10)
    plan = s.schedule()
    assert plan.is_empty


def test_max_num_seqs():
    s = make(max_seqs=2)
    for i in range(4):
        add(s, f"r{i}", 3, first_token=10 * i + 1)
    plan, _ = step(s)
    assert list(plan.num_scheduled_tokens) == ["r0", "r1"]


def test_finish_reasons_max_tokens_stop_ids_and_model_len():
    s = make(max_model_len=12)
    add(s, "len", 5, max_tokens=3)
    add(s, "stop", 5, max_tokens=9, stop_token_ids=[TOKEN], first_token=20)
    add(s, "model_len", 10, max_tokens=50, first_token=40)
    finished = {}
    for _ in range(5):
        for o in step(s)[1]:
            if o.finish_reason:
                finished[o.request_id] = (o.finish_reason, o.stop_reason)
    assert finished["stop"][:2] == ("stop", TOKEN)
    assert finished["len"][0] == "length" and finished["model_len"][0] == "length"
    assert not s.has_unfinished_requests()


def test_min_tokens_delays_stop_token():
    s = make()
    r = add(s, "a", 4, max_tokens=10, min_tokens=2, stop_token_ids=[TOKEN])
    reasons = [o.finish_reason for _ in range(3) for o in step(s)[1]]
    assert reasons == [None, None, "stop"] and r.num_output_tokens == 3


def test_eos_respected_unless_ignore_eos():
    s = make()
    r = Request("e", [1, 2, 3], EngineSamplingParams(max_tokens=5), eos_token_ids=(TOKEN,))
    s.add_request(r)
    (out,) = step(s)[1]
    assert out.finish_reason == "stop" and out.stop_reason == TOKEN


def test_preemption_by_recompute_and_pool_restored():
    s = make(num_blocks=6, block_size=4, budget=64)
    a = add(s, "a", 8, max_tokens=12)  # 2 blocks, grows to 20 tokens = 5 blocks
    b = add(s, "b", 8, max_tokens=12, first_token=50)
    step(s)
    assert s.kv.num_free_blocks == 2
    for _ in range(8):  # together they outgrow 6 blocks: the newest is preempted
        step(s)
    assert s.num_preemptions >= 1 and b.num_preemptions >= 1 and a.num_preemptions == 0
    while s.has_unfinished_requests():
        step(s)
    assert a.num_output_tokens == 12 and b.num_output_tokens == 12
    assert s.kv.num_free_blocks == 6


def test_preempted_request_tells_runner_to_drop_state_and_resumes_in_full():
    s = make(num_blocks=5, block_size=4, budget=64)
    add(s, "a", 8, max_tokens=12)
    b = add(s, "b", 8, max_tokens=12, first_token=50)
    preempted_plan = None
    for _ in range(10):
        plan, _ = step(s)
        if "b" in plan.finished_req_ids:
            preempted_plan = plan
            break
    assert preempted_plan is not None and b.status in (RequestStatus.PREEMPTED, RequestStatus.RUNNING)
    while s.has_unfinished_requests():
        plan, _ = step(s)
        resumed = [n for n in plan.scheduled_new_reqs if n.request_id == "b"]
        if resumed:
            assert list(resumed[0].token_ids) == b.all_token_ids[: len(resumed[0].token_ids)]
            assert len(resumed[0].token_ids) > 8  # prompt + tokens generated before preemption
            break
    else:
        raise AssertionError("b was never resumed")


def test_priority_policy_admits_and_preempts_by_priority():
    s = make(policy="priority", max_seqs=1)
    add(s, "low", 3, priority=5)
    add(s, "high", 3, priority=-1, first_token=20)
    plan, _ = step(s)
    assert list(plan.num_scheduled_tokens) == ["high"]

    s = make(policy="priority", num_blocks=5, block_size=4, budget=64)
    low = add(s, "low", 8, max_tokens=12, priority=9)
    high = add(s, "high", 8, max_tokens=12, priority=0, first_token=50)
    while s.has_unfinished_requests():
        step(s)
    assert low.num_preemptions >= 1 and high.num_preemptions == 0


def test_abort_returns_pool_to_initial_free_count():
    s = make(num_blocks=20, budget=16)
    add(s, "a", 30)
    add(s, "b", 5, first_token=40)
    step(s)
    step(s)
    assert s.kv.num_free_blocks < 20
    aborted = s.abort_requests(["a", "b", "unknown"])
    assert [r.request_id for r in aborted] == ["a", "b"]
    assert all(r.status is RequestStatus.FINISHED_ABORTED for r in aborted)
    assert s.kv.num_free_blocks == 20 and not s.running and not len(s.waiting)
    plan = s.schedule()
    assert plan.finished_req_ids == {"a", "b"} and plan.is_empty


def test_abort_waiting_request():
    s = make(max_seqs=1)
    add(s, "a", 3)
    add(s, "b", 3, first_token=30)
    step(s)
    s.abort_requests(["b"])
    assert len(s.waiting) == 0 and "b" not in s.requests


def test_prefix_hits_counted_and_skip_computation():
    s = make(block_size=4, budget=64)
    add(s, "a", 17, max_tokens=1)
    step(s)
    b = add(s, "b", 17, max_tokens=1)  # same prompt
    plan, _ = step(s)
    assert plan.num_scheduled_tokens["b"] == 1  # 16 cached tokens, only the last is computed
    assert b.num_cached_tokens == 16
    stats = s.get_stats()
    assert stats.prefix_cache_queries == 34 and stats.prefix_cache_hits == 16


def test_decode_plans_carry_new_blocks_only_at_block_boundaries():
    s = make(block_size=4, budget=64)
    add(s, "a", 5, max_tokens=14)
    plan, _ = step(s)
    seen_blocks = list(plan.scheduled_new_reqs[0].block_ids)
    while s.has_unfinished_requests():
        computed = s.requests["a"].num_computed_tokens
        plan, _ = step(s)
        assert plan.num_scheduled_tokens == {"a": 1}
        # This step computes token `computed`; it needs a block (and a diff) when that token starts one.
        if computed % 4 == 0:
            [cached] = plan.scheduled_cached_reqs
            assert cached.request_id == "a" and cached.num_computed_tokens == computed
            assert len(cached.new_block_ids) == 1
            seen_blocks += cached.new_block_ids
        else:
            assert plan.scheduled_cached_reqs == ()
        if "a" in s.requests:
            assert seen_blocks == s.kv.get_block_ids("a")
    assert len(seen_blocks) == -(-(5 + 14 - 1) // 4)  # the last sampled token is never computed


def test_whole_batch_finishing_in_one_step():
    s = make(num_blocks=128, budget=256, max_seqs=64)
    for i in range(40):
        add(s, f"r{i}", 3, max_tokens=4, first_token=5 * i + 1)
    outs = []
    while s.has_unfinished_requests():
        outs = step(s)[1]
    assert len(outs) == 40 and all(o.finish_reason == "length" for o in outs)
    assert not s.running and not s.requests and s.kv.num_free_blocks == 128
    assert s.schedule().finished_req_ids == {f"r{i}" for i in range(40)}
    assert s.get_stats().num_generation_tokens == 160


def test_request_aborted_while_its_step_runs_gets_no_output():
    s = make()
    a, b = add(s, "a", 5, max_tokens=10), add(s, "b", 5, max_tokens=10, first_token=20)
    step(s)
    plan = s.schedule()
    runner_output = ModelRunnerOutput([TOKEN] * len(plan.num_scheduled_tokens))
    s.abort_requests(["a"])
    outs = s.update_from_output(plan, runner_output)
    assert [o.request_id for o in outs] == ["b"]
    assert a.num_tokens == 6 and b.num_tokens == 7  # a's token of the aborted step is dropped
    assert s.running == [b]
    plan, outs = step(s)
    assert list(plan.num_scheduled_tokens.items()) == [("b", 1)] and [o.request_id for o in outs] == ["b"]


def test_decode_steps_call_the_kv_cache_manager_only_at_block_boundaries():
    """The scheduler's per-step work at a large decode batch: one allocation per request that starts
    a new block, none for the others (and no CachedRequestData for them)."""
    s = make(num_blocks=512, block_size=4, budget=256, max_seqs=32)
    for i in range(32):
        add(s, f"r{i}", 3 + i % 4, max_tokens=40, first_token=10 * i + 1)
    step(s)
    calls = []
    allocate = s.kv.allocate_slots
    s.kv.allocate_slots = lambda r, *a: calls.append(r.request_id) or allocate(r, *a)
    for _ in range(12):
        starting_a_block = {r.request_id for r in s.running if r.num_computed_tokens % 4 == 0}
        calls.clear()
        plan, outs = step(s)
        assert len(outs) == 32
        assert set(calls) == starting_a_block and len(calls) == len(starting_a_block)
        assert {c.request_id for c in plan.scheduled_cached_reqs} == starting_a_block
