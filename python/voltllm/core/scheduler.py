"""Continuous-batching scheduler: decides, each step, which tokens of which requests to compute.

Policy, in order:
1. Running requests first, in admission order. Each asks for all its uncomputed tokens (one for a
   decode, the rest of its prompt for a chunked prefill), capped by what is left of the step's token
   budget. When the KV cache has no room, the scheduler preempts by recompute: the least important
   running request not yet scheduled this step (the newest under FCFS, the lowest priority under the
   priority policy) loses its blocks and goes back to the front of the waiting queue.
2. Then, if nothing was preempted and fewer than `max_num_seqs` run, waiting requests in queue order
   (arrival, or (priority, arrival)), each starting after its longest prefix-cache hit, until the
   budget, the sequence limit or the KV cache runs out. A prompt longer than the remaining budget is
   split into chunks over several steps.
Prefills and decodes therefore share one batch, and a long prompt never stalls running decodes.
"""

from __future__ import annotations

import bisect
import itertools
import time
from collections import deque
from collections.abc import Sequence
from types import MappingProxyType

from voltllm.config import SchedulerConfig
from voltllm.core.block_pool import KVCacheBlock
from voltllm.core.kv_cache_manager import KVCacheManager
from voltllm.core.request import Request, RequestStatus
from voltllm.core.sched_output import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from voltllm.protocol import EngineCoreOutput, SchedulerStats

_RUNNING = RequestStatus.RUNNING
_NO_IDS: frozenset[str] = frozenset()


class WaitingQueue:
    """Requests not running, in the order they should be admitted."""

    def __init__(self, policy: str) -> None:
        self.policy = policy
        self._fcfs: deque[Request] = deque()
        self._sorted: list[tuple[tuple[int, float, int], Request]] = []

    def __len__(self) -> int:
        return len(self._fcfs) if self.policy == "fcfs" else len(self._sorted)

    def add(self, request: Request) -> None:
        if self.policy == "fcfs":
            self._fcfs.append(request)
        else:
            bisect.insort(self._sorted, (self._key(request), request), key=lambda e: e[0])

    def add_preempted(self, request: Request) -> None:
        """A preempted request was admitted before everything still waiting: it goes back first.
        Under the priority policy its (priority, arrival) key already puts it in its place."""
        if self.policy == "fcfs":
            self._fcfs.appendleft(request)
        else:
            self.add(request)

    def peek(self) -> Request:
        return self._fcfs[0] if self.policy == "fcfs" else self._sorted[0][1]

    def pop(self) -> Request:
        return self._fcfs.popleft() if self.policy == "fcfs" else self._sorted.pop(0)[1]

    def remove(self, request: Request) -> None:
        if self.policy == "fcfs":
            self._fcfs.remove(request)
        else:
            self._sorted = [e for e in self._sorted if e[1] is not request]

    @staticmethod
    def _key(request: Request) -> tuple[int, float, int]:
        return (request.priority, request.arrival_time, request.arrival_seq)


class Scheduler:
    """Owns the request set and the KV cache manager; produces one `SchedulerOutput` per step."""

    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager, max_model_len: int):
        capacity = kv_cache_manager.num_blocks * kv_cache_manager.block_size
        if max_model_len > capacity:
            # A request alone in the engine must always fit, or preemption could livelock.
            raise ValueError(
                f"max_model_len {max_model_len} exceeds the KV cache capacity of {capacity} tokens"
            )
        self.config = config
        self.kv = kv_cache_manager
        self.max_model_len = max_model_len
        self.requests: dict[str, Request] = {}
        self.waiting = WaitingQueue(config.policy)
        self.running: list[Request] = []
        self._finished_req_ids: set[str] = set()  # for the next plan: the runner drops their state
        self.num_preemptions = 0
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self._preempted_this_step = False
        # Every running request's id mapped to 1, in running order: the plan of a step of decodes only,
        # copied rather than rebuilt each step.
        self._decode_tokens: dict[str, int] = {}
        # Left by update_from_output for the next schedule() when its step computed every running
        # request: the running requests that need a look of their own (a prefill in progress, a decode
        # whose next token needs the KV cache manager), in running order. None: look at all of them.
        self._to_check: list[Request] | None = None
        self._to_check_extra = 0  # the tokens they need beyond one each
        # The last plan if it scheduled every running request, and those requests in its order.
        self._last_plan: SchedulerOutput | None = None
        self._last_plan_reqs: list[Request] = []
        self._num_released = 0  # requests finished or aborted so far
        self._num_released_at_plan = 0  # ... when the last plan was made

    # ----- request set -------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        assert request.request_id not in self.requests, "EngineCore rejects duplicate ids"
        request.max_num_tokens = min(request.max_num_tokens, self.max_model_len)
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def abort_requests(self, request_ids: list[str]) -> list[Request]:
        """Finish live requests as aborted; unknown or already finished ids are ignored."""
        aborted = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is not None:
                self._finish(request, RequestStatus.FINISHED_ABORTED)
                aborted.append(request)
        return aborted

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def has_work(self) -> bool:
        """Something to schedule, or finished ids the runner has not yet been told about."""
        return bool(self.requests) or bool(self._finished_req_ids)

    # ----- one step ----------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """The next step's plan: running requests first (in order, preempting when the KV cache is
        full), then waiting ones, within the token budget."""
        max_tokens = self.config.max_num_batched_tokens
        new_reqs: list[NewRequestData] = []
        cached_reqs: list[CachedRequestData] = []
        self._preempted_this_step = False
        to_check, self._to_check = self._to_check, None
        planned = None if to_check is None else self._schedule_after_full_step(to_check, cached_reqs)
        if planned is None:
            num_scheduled: dict[str, int] = {}
            budget = self._schedule_running(max_tokens, num_scheduled, cached_reqs, 0)
        else:
            num_scheduled, budget = planned
        complete = len(num_scheduled) == len(self.running)  # no running request left out
        # After a preemption the cache is full: admitting new work would only thrash it.
        while (
            not self._preempted_this_step
            and self.waiting
            and budget > 0
            and len(self.running) < self.config.max_num_seqs
        ):
            request = self.waiting.peek()
            hit_blocks, num_hit = self.kv.get_computed_blocks(request)
            num_new = request.num_tokens - num_hit
            if not self.config.enable_chunked_prefill and num_new > budget:
                break
            num_new = min(num_new, budget)
            if self.kv.allocate_slots(request, num_new, hit_blocks) is None:
                break
            self.waiting.pop()
            self.kv.record_prefix_query(request.num_tokens, num_hit)
            self._admit(request, num_hit)
            new_reqs.append(self._new_request_data(request))
            num_scheduled[request.request_id] = num_new
            budget -= num_new

        finished_ids = frozenset(self._finished_req_ids) if self._finished_req_ids else _NO_IDS
        self._finished_req_ids = set()
        plan = SchedulerOutput(
            tuple(new_reqs),
            tuple(cached_reqs),
            MappingProxyType(num_scheduled),
            max_tokens - budget,  # every scheduled token came out of the budget
            finished_ids,
        )
        # A complete plan lists `running` in order: update_from_output takes the requests from here.
        self._last_plan = plan if complete else None
        self._last_plan_reqs = self.running.copy() if complete else []
        self._num_released_at_plan = self._num_released
        return plan

    def _schedule_after_full_step(
        self, to_check: list[Request], cached_reqs: list[CachedRequestData]
    ) -> tuple[dict[str, int], int] | None:
        """The running requests' part of the plan when the last step computed every running request.

        Then every running request but those in `to_check` is a decode of one token that stays inside
        its KV blocks: the plan is `_decode_tokens` with `to_check`'s entries filled in, and only those
        requests are looked at. Returns (num_scheduled, budget left), or None when the budget may not
        cover every running request (the general loop caps them in order). Produces exactly the plan
        of `_schedule_running`, which takes over from a request whose blocks do not fit."""
        num_scheduled = self._decode_tokens.copy()
        budget = self.config.max_num_batched_tokens
        # An upper bound (requests aborted since are still in it): within the budget, nobody is capped.
        if len(num_scheduled) + self._to_check_extra > budget:
            return None
        extra = 0
        quiet_until = self.kv.quiet_until
        for request in to_check:
            if request.status is not _RUNNING:
                continue  # aborted since
            request_id, num_computed = request.request_id, request.num_computed_tokens
            num_new = len(request.all_token_ids) - num_computed
            if num_new != 1:
                num_scheduled[request_id] = num_new
                extra += num_new - 1
            if num_computed + num_new <= quiet_until.get(request_id, -1):
                continue
            new_blocks = self._allocate(request, num_new)
            if new_blocks is None:
                # Preemption: the general loop goes on from this request with the plan so far.
                index = self.running.index(request)
                before = dict(itertools.islice(num_scheduled.items(), index))
                budget = self._schedule_running(budget - sum(before.values()), before, cached_reqs, index)
                return before, budget
            if len(new_blocks) == 1:  # a decode at a block boundary
                cached_reqs.append(CachedRequestData(request_id, (new_blocks[0].block_id,), num_computed))
            elif new_blocks:
                cached_reqs.append(self._cached_request_data(request_id, new_blocks, num_computed))
        return num_scheduled, budget - len(num_scheduled) - extra

    def _schedule_running(
        self, budget: int, num_scheduled: dict[str, int], cached_reqs: list[CachedRequestData], start: int
    ) -> int:
        """Schedule running requests from index `start` in order until the budget runs out; returns
        what is left of it. Calls into the KV cache manager only for a request whose tokens leave its
        quiet range (`kv.quiet_until`), and lists a request in `cached_reqs` only when it got blocks."""
        running, quiet_until = self.running, self.kv.quiet_until
        i = start
        while i < len(running) and budget > 0:
            request = running[i]
            request_id, num_computed = request.request_id, request.num_computed_tokens
            num_new = min(len(request.all_token_ids) - num_computed, budget)
            if num_computed + num_new > quiet_until.get(request_id, -1):
                new_blocks = self._allocate(request, num_new)
                if new_blocks is None:
                    new_blocks = self._preempt_until_fits(request, num_new, first_victim_index=i)
                    if new_blocks is None:
                        continue  # the request itself was preempted: running[i] is now the next one
                if new_blocks:
                    cached_reqs.append(self._cached_request_data(request_id, new_blocks, num_computed))
            num_scheduled[request_id] = num_new
            budget -= num_new
            i += 1
        return budget

    def update_from_output(
        self, plan: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Advance each scheduled request by its computed tokens, append sampled tokens, apply stop
        conditions and free finished requests. Returns one output per request that sampled."""
        sampled, logprobs = runner_output.sampled_token_ids, runner_output.logprobs
        scheduled = plan.num_scheduled_tokens
        full_step = plan is self._last_plan
        ids = list(scheduled)
        # Usually every scheduled request sampled, in plan order; else look each one up.
        tokens = sampled.values() if list(sampled) == ids else [sampled.get(rid) for rid in ids]
        if full_step and self._num_released == self._num_released_at_plan:
            pairs = zip(self._last_plan_reqs, tokens, strict=True)
        else:  # some scheduled request may be gone (aborted between schedule() and now)
            requests = self.requests
            pairs = [
                (r, t)
                for r, t in zip([requests.get(rid) for rid in ids], tokens, strict=True)
                if r is not None and r.status is _RUNNING
            ]
        outputs: list[EngineCoreOutput] = []
        to_check: list[Request] = []  # for the next schedule(), in running order
        to_check_extra = 0  # tokens they need beyond one each
        finished: list[tuple[Request, RequestStatus]] = []
        append, output = outputs.append, EngineCoreOutput
        # The hot loop, once per request per step: a decode appends its token and builds its output;
        # one test (a stop id sampled, or `check_len` reached) sends the rest to `_update_closely`.
        for request, token_id in pairs:
            if token_id is None:  # a prefill chunk that did not reach the end of the prompt
                num_tokens = scheduled[request.request_id]
                self._count_prompt_tokens(request, num_tokens)
                request.num_computed_tokens += num_tokens
                to_check.append(request)
                to_check_extra += len(request.all_token_ids) - request.num_computed_tokens - 1
                continue
            all_tokens = request.all_token_ids
            all_tokens.append(token_id)
            num_tokens_now = len(all_tokens)
            if token_id in request.stop_token_ids or num_tokens_now >= request.check_len:
                if (
                    token_id in request.stop_token_ids
                    or num_tokens_now >= request.max_num_tokens
                    or not request.check_len
                ):
                    num_tokens = scheduled[request.request_id]
                    append(self._update_closely(request, num_tokens, token_id, finished, to_check))
                    continue
                to_check.append(request)  # only a KV block boundary: the next schedule() allocates
            # A decode that sampled before (check_len != 0): it computed every token but the new one.
            request.num_computed_tokens = num_tokens_now - 1
            append(
                output(
                    request.request_id,
                    [token_id],
                    None,
                    None,
                    None,
                    None,
                    request.num_cached_tokens,
                    request.queued_ts,
                    request.scheduled_ts,
                    request.first_token_ts,
                )
            )
        if logprobs:
            for out in outputs:
                logprob = logprobs.get(out.request_id)
                if logprob is not None:
                    out.new_logprobs = [logprob]
        self.num_generation_tokens += len(outputs)
        if finished:
            self._finish_running(finished)
        self._to_check = to_check if full_step else None
        self._to_check_extra = to_check_extra
        return outputs

    def _update_closely(
        self,
        request: Request,
        num_tokens: int,
        token_id: int,
        finished: list[tuple[Request, RequestStatus]],
        to_check: list[Request],
    ) -> EngineCoreOutput:
        """The rest of `update_from_output` for a request that sampled `token_id` (already appended)
        and may stop, sampled for the first time since admission, or has reached a KV block boundary."""
        self._count_prompt_tokens(request, num_tokens)
        request.num_computed_tokens += num_tokens
        if request.first_token_ts is None:
            request.first_token_ts = time.time()
        num_tokens_now = len(request.all_token_ids)
        finish_status = None
        if token_id in request.stop_token_ids or num_tokens_now >= request.max_num_tokens:
            finish_status = self._check_stop(request, token_id)
        if finish_status is not None:
            finished.append((request, finish_status))
            reason = finish_status.finish_reason.value
        else:
            reason = None
            request.check_len = check_len = self._check_len(request)
            if num_tokens_now >= check_len:
                to_check.append(request)  # its next token needs the KV cache manager
        return EngineCoreOutput(
            request.request_id,
            [token_id],
            None,
            reason,
            request.stop_reason,
            None,
            request.num_cached_tokens,
            request.queued_ts,
            request.scheduled_ts,
            request.first_token_ts,
        )

    def _count_prompt_tokens(self, request: Request, num_tokens: int) -> None:
        start, num_prompt = request.num_computed_tokens, request.num_prompt_tokens
        if start < num_prompt:
            self.num_prompt_tokens += min(num_prompt, start + num_tokens) - start

    def make_output(
        self, request: Request, new_token_ids: list[int], new_logprobs: list | None = None
    ) -> EngineCoreOutput:
        reason = request.status.finish_reason
        return EngineCoreOutput(
            request_id=request.request_id,
            new_token_ids=new_token_ids,
            new_logprobs=new_logprobs,
            finish_reason=reason.value if reason is not None else None,
            stop_reason=request.stop_reason,
            num_cached_tokens=request.num_cached_tokens,
            queued_ts=request.queued_ts,
            scheduled_ts=request.scheduled_ts,
            first_token_ts=request.first_token_ts,
        )

    def get_stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_cache_usage=self.kv.usage,
            prefix_cache_queries=self.kv.prefix_cache_queries,
            prefix_cache_hits=self.kv.prefix_cache_hits,
            num_preemptions=self.num_preemptions,
            num_prompt_tokens=self.num_prompt_tokens,
            num_generation_tokens=self.num_generation_tokens,
        )

    # ----- helpers -----------------------------------------------------------------------------

    def _preempt_until_fits(self, request: Request, num_new: int, first_victim_index: int):
        """Preempt others (never one already scheduled this step) until `num_new` more tokens of a
        running request fit. Returns the new blocks, or None when the request itself had to be
        preempted."""
        while True:
            victim = self._pick_victim(first_victim_index)
            self._preempt(victim)
            if victim is request:
                return None
            if (new_blocks := self._allocate(request, num_new)) is not None:
                return new_blocks

    def _pick_victim(self, first_index: int) -> Request:
        candidates = self.running[first_index:]
        if self.config.policy == "priority":
            return max(candidates, key=lambda r: (r.priority, r.arrival_time, r.arrival_seq))
        return candidates[-1]

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        del self._decode_tokens[request.request_id]
        self.kv.free(request)
        request.transition(RequestStatus.PREEMPTED)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._preempted_this_step = True
        self._finished_req_ids.add(request.request_id)
        self.waiting.add_preempted(request)

    def _admit(self, request: Request, num_computed: int) -> None:
        if request.status is RequestStatus.WAITING:
            request.num_cached_tokens = num_computed
            request.scheduled_ts = time.time()
        request.num_computed_tokens = num_computed
        request.check_len = 0  # its first sample gets a close look (first token time, prompt tokens)
        request.transition(RequestStatus.RUNNING)
        self.running.append(request)
        self._decode_tokens[request.request_id] = 1

    def _new_request_data(self, request: Request) -> NewRequestData:
        return NewRequestData(
            request_id=request.request_id,
            token_ids=tuple(request.all_token_ids),
            num_prompt_tokens=request.num_prompt_tokens,
            sampling_params=request.sampling_params,
            block_ids=tuple(self.kv.get_block_ids(request.request_id)),
            num_computed_tokens=request.num_computed_tokens,
        )

    def _allocate(self, request: Request, num_new: int) -> Sequence[KVCacheBlock] | None:
        """`kv.allocate_slots` for a running request, keeping its `check_len` in step with the blocks
        (except while it is 0: the request has not sampled since admission)."""
        new_blocks = self.kv.allocate_slots(request, num_new)
        if new_blocks is not None and request.check_len:
            # as _check_len (inlined: a few dozen calls per step at a large decode batch)
            kv_len = self.kv.quiet_until[request.request_id] + 1
            request.check_len = min(request.max_num_tokens, kv_len)
        return new_blocks

    @staticmethod
    def _cached_request_data(
        request_id: str, new_blocks: Sequence[KVCacheBlock], num_computed: int
    ) -> CachedRequestData:
        return CachedRequestData(request_id, tuple([b.block_id for b in new_blocks]), num_computed)

    def _check_len(self, request: Request) -> int:
        """The token count at which update_from_output must look again: a length limit, or the count
        after which the next token leaves the request's quiet range in the KV cache manager."""
        kv_len = self.kv.quiet_until.get(request.request_id, -1) + 1
        return min(request.max_num_tokens, kv_len)

    def _check_stop(self, request: Request, token_id: int) -> RequestStatus | None:
        params = request.sampling_params
        num_output = len(request.all_token_ids) - request.num_prompt_tokens
        # The sampler masks stop tokens until min_tokens others exist; check the same bound here.
        if token_id in request.stop_token_ids and num_output > params.min_tokens:
            request.stop_reason = token_id
            return RequestStatus.FINISHED_STOPPED
        if num_output >= params.max_tokens or len(request.all_token_ids) >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH_CAPPED
        return None

    def _finish(self, request: Request, status: RequestStatus) -> None:
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            self.waiting.remove(request)
        self._release(request, status)

    def _finish_running(self, finished: list[tuple[Request, RequestStatus]]) -> None:
        """Finish running requests: a few are removed one by one (a C-level search each), many with
        one pass over `running` (one removal each is quadratic when a whole batch ends at once)."""
        for request, status in finished:
            self._release(request, status)
        if len(finished) <= 4:
            for request, _ in finished:
                self.running.remove(request)
        else:
            self.running = [r for r in self.running if r.status is _RUNNING]

    def _release(self, request: Request, status: RequestStatus) -> None:
        if request.status is _RUNNING:
            del self._decode_tokens[request.request_id]
        self._num_released += 1
        request.transition(status)
        self.kv.free(request)
        del self.requests[request.request_id]
        self._finished_req_ids.add(request.request_id)
