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
import time
from collections import deque

from voltllm.config import SchedulerConfig
from voltllm.core.kv_cache_manager import KVCacheManager
from voltllm.core.request import Request, RequestStatus
from voltllm.core.sched_output import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from voltllm.engine.protocol import EngineCoreOutput, SchedulerStats


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

    # ----- request set -------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        assert request.request_id not in self.requests, "EngineCore rejects duplicate ids"
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
        budget = self.config.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        new_reqs: list[NewRequestData] = []
        cached_reqs: list[CachedRequestData] = []
        self._preempted_this_step = False

        budget = self._schedule_running(budget, num_scheduled, cached_reqs)
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

        plan = SchedulerOutput.make(new_reqs, cached_reqs, num_scheduled, self._finished_req_ids)
        self._finished_req_ids = set()
        return plan

    def _schedule_running(
        self, budget: int, num_scheduled: dict[str, int], cached_reqs: list[CachedRequestData]
    ) -> int:
        """Schedule running requests in order until the budget runs out; returns what is left of it.

        The hot loop at large decode batches: per request a few attribute reads, and no call into the
        KV cache manager while the request's tokens stay inside its blocks (`kv.quiet_until`)."""
        running, quiet_until, empty = self.running, self.kv.quiet_until, ()
        i = 0
        while i < len(running) and budget > 0:
            request = running[i]
            request_id, num_computed = request.request_id, request.num_computed_tokens
            num_new = len(request.all_token_ids) - num_computed
            if num_new > budget:
                num_new = budget
            if num_computed + num_new <= quiet_until.get(request_id, -1):
                new_block_ids = empty
            else:
                new_blocks = self.kv.allocate_slots(request, num_new)
                if new_blocks is None:
                    new_blocks = self._preempt_until_fits(request, num_new, first_victim_index=i)
                    if new_blocks is None:
                        continue  # the request itself was preempted: running[i] is now the next one
                new_block_ids = tuple([b.block_id for b in new_blocks])
            cached_reqs.append(CachedRequestData(request_id, new_block_ids, num_computed))
            num_scheduled[request_id] = num_new
            budget -= num_new
            i += 1
        return budget

    def update_from_output(
        self, plan: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Advance each scheduled request by its computed tokens, append sampled tokens, apply stop
        conditions and free finished requests. Returns one output per request that sampled."""
        # Runs once per request per step: locals instead of attribute chains, and the stop checks
        # behind one cheap test that no stop condition can hold.
        outputs = []
        now = time.time()
        sampled, logprobs = runner_output.sampled_token_ids, runner_output.logprobs
        requests, running_status, max_model_len = self.requests, RequestStatus.RUNNING, self.max_model_len
        finished: list[tuple[Request, RequestStatus]] = []
        for request_id, num_tokens in plan.num_scheduled_tokens.items():
            request = requests.get(request_id)
            if request is None or request.status is not running_status:
                continue  # aborted between schedule() and now
            start = request.num_computed_tokens
            num_prompt = len(request.prompt_token_ids)
            if start < num_prompt:
                self.num_prompt_tokens += min(num_prompt, start + num_tokens) - start
            request.num_computed_tokens = start + num_tokens
            token_id = sampled.get(request_id)
            if token_id is None:
                continue  # a prefill chunk that did not reach the end of the prompt
            if request.first_token_ts is None:
                request.first_token_ts = now
            request.output_token_ids.append(token_id)
            all_tokens = request.all_token_ids
            all_tokens.append(token_id)
            reason = None
            if (
                token_id in request.stop_token_ids
                or len(all_tokens) >= request.max_num_tokens
                or len(all_tokens) >= max_model_len
            ):
                finish_status = self._check_stop(request, token_id)
                if finish_status is not None:
                    finished.append((request, finish_status))
                    reason = finish_status.finish_reason.value
            logprob = logprobs.get(request_id) if logprobs else None
            outputs.append(
                EngineCoreOutput(
                    request_id,
                    [token_id],
                    [logprob] if logprob is not None else None,
                    reason,
                    request.stop_reason,
                    None,
                    request.num_cached_tokens,
                    request.queued_ts,
                    request.scheduled_ts,
                    request.first_token_ts,
                )
            )
        self.num_generation_tokens += len(outputs)
        if finished:
            self._finish_running(finished)
        return outputs

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
            if (new_blocks := self.kv.allocate_slots(request, num_new)) is not None:
                return new_blocks

    def _pick_victim(self, first_index: int) -> Request:
        candidates = self.running[first_index:]
        if self.config.policy == "priority":
            return max(candidates, key=lambda r: (r.priority, r.arrival_time, r.arrival_seq))
        return candidates[-1]

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
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
        request.transition(RequestStatus.RUNNING)
        self.running.append(request)

    def _new_request_data(self, request: Request) -> NewRequestData:
        return NewRequestData(
            request_id=request.request_id,
            token_ids=tuple(request.all_token_ids),
            num_prompt_tokens=request.num_prompt_tokens,
            sampling_params=request.sampling_params,
            block_ids=tuple(self.kv.get_block_ids(request.request_id)),
            num_computed_tokens=request.num_computed_tokens,
        )

    def _check_stop(self, request: Request, token_id: int) -> RequestStatus | None:
        params = request.sampling_params
        num_output = len(request.output_token_ids)
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
        """Finish several running requests with one pass over `running` (not one removal each, which
        is quadratic when a whole batch ends in the same step)."""
        for request, status in finished:
            self._release(request, status)
        self.running = [r for r in self.running if r.status is RequestStatus.RUNNING]

    def _release(self, request: Request, status: RequestStatus) -> None:
        request.transition(status)
        self.kv.free(request)
        del self.requests[request.request_id]
        self._finished_req_ids.add(request.request_id)
