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

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            new_blocks = self._allocate_or_preempt(request, num_new, first_victim_index=i)
            if new_blocks is None:
                continue  # the request itself was preempted: running[i] is now the next one
            cached_reqs.append(
                CachedRequestData(
                    request.request_id, tuple(b.block_id for b in new_blocks), request.num_computed_tokens
                )
            )
            num_scheduled[request.request_id] = num_new
            budget -= num_new
            i += 1
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

    def update_from_output(
        self, plan: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Advance each scheduled request by its computed tokens, append sampled tokens, apply stop
        conditions and free finished requests. Returns one output per request that sampled."""
        outputs = []
        now = time.time()
        for request_id, num_tokens in plan.num_scheduled_tokens.items():
            request = self.requests.get(request_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue  # aborted between schedule() and now
            start = request.num_computed_tokens
            self.num_prompt_tokens += max(0, min(request.num_prompt_tokens, start + num_tokens) - start)
            request.num_computed_tokens = start + num_tokens
            token_id = runner_output.sampled_token_ids.get(request_id)
            if token_id is None:
                continue  # a prefill chunk that did not reach the end of the prompt
            if request.first_token_ts is None:
                request.first_token_ts = now
            request.append_output_token(token_id)
            self.num_generation_tokens += 1
            finish_status = self._check_stop(request, token_id)
            if finish_status is not None:
                self._finish(request, finish_status)
            logprob = runner_output.logprobs.get(request_id)
            outputs.append(self.make_output(request, [token_id], [logprob] if logprob is not None else None))
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

    def _allocate_or_preempt(self, request: Request, num_new: int, first_victim_index: int):
        """Allocate room for `num_new` tokens of a running request, preempting others (never one
        already scheduled this step) until it fits. Returns the new blocks, or None when the request
        itself had to be preempted."""
        while (new_blocks := self.kv.allocate_slots(request, num_new)) is None:
            victim = self._pick_victim(first_victim_index)
            self._preempt(victim)
            if victim is request:
                return None
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
        # The sampler masks stop tokens until min_tokens others exist; check the same bound here.
        if token_id in request.stop_token_ids and request.num_output_tokens > params.min_tokens:
            request.stop_reason = token_id
            return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= params.max_tokens or request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH_CAPPED
        return None

    def _finish(self, request: Request, status: RequestStatus) -> None:
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            self.waiting.remove(request)
        request.transition(status)
        self.kv.free(request)
        del self.requests[request.request_id]
        self._finished_req_ids.add(request.request_id)
