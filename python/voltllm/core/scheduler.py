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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
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
from voltllm.protocol import EngineCoreOutput, FinishReason, SchedulerStats, TokenLogprobs
from voltllm.structured_output import EndedGrammar

_RUNNING = RequestStatus.RUNNING
_PREEMPTED = RequestStatus.PREEMPTED


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


@dataclass
class _SteadyDecode:
    """What the steady-decode fast path keeps: the last full plan's one-token-per-request schedule,
    how many fast steps followed it, and which running requests (with their index in `running`)
    outgrow their KV blocks at which fast step."""

    num_scheduled_tokens: Mapping[str, int]
    due: dict[int, list[tuple[int, Request]]]
    # The first fast step that would schedule a request whose last token is already on its way (its
    # tokens and placeholders reach its length limit): the plain path, which skips such a request,
    # takes over there. Only asynchronous scheduling gets that far: synchronously the request has
    # finished (and dropped this state) before.
    limit: int
    step: int = 0

    @classmethod
    def after(cls, plan: SchedulerOutput, running: list[Request], num_slots: dict[str, int]) -> _SteadyDecode:
        """The state after `plan` scheduled one decode token for each of `running`. A request with c
        computed tokens and s slots computes token c + j at fast step j, which needs a block once
        c + j + 1 > s: first at step s - c. One with n tokens and placeholders (before `plan`'s) and
        length limit m may be scheduled at fast step j while n + j < m."""
        due: dict[int, list[tuple[int, Request]]] = {}
        limit = 1 << 62
        for index, request in enumerate(running):
            step = num_slots[request.request_id] - request.num_computed_tokens
            due.setdefault(step, []).append((index, request))
            left = request.max_num_tokens - len(request.all_token_ids) - request.num_output_placeholders
            if left < limit:
                limit = left
        return cls(plan.num_scheduled_tokens, due, limit)


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
        self.running: list[Request] = []  # in admission order
        self._finished_req_ids: set[str] = set()  # for the next plan: the runner drops their state
        # The steady-decode fast path (`_schedule_steady_decode`); off only to test it against the
        # plain path.
        self.enable_steady_decode = True
        self._steady: _SteadyDecode | None = None
        # The plan `advance` counted last, which `update_from_output` then does not count again.
        self._advanced_plan: SchedulerOutput | None = None
        self.num_preemptions = 0
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0

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
        steady = self._steady
        if steady is not None and not self.waiting:
            plan = self._schedule_steady_decode(steady)
            if plan is not None:
                return plan
        self._steady = None
        max_tokens = self.config.max_num_batched_tokens
        cached_reqs: list[CachedRequestData] = []
        new_reqs: list[NewRequestData] = []
        num_scheduled: dict[str, int] = {}
        num_preemptions = self.num_preemptions
        budget = self._schedule_running(max_tokens, num_scheduled, cached_reqs)
        if self.num_preemptions == num_preemptions:  # after one the cache is full: new work would thrash it
            budget = self._schedule_waiting(budget, num_scheduled, new_reqs)
        finished_ids = frozenset(self._finished_req_ids)
        self._finished_req_ids = set()
        plan = SchedulerOutput(
            scheduled_new_reqs=tuple(new_reqs),
            scheduled_cached_reqs=tuple(cached_reqs),
            num_scheduled_tokens=MappingProxyType(num_scheduled),
            total_num_scheduled_tokens=max_tokens - budget,  # every scheduled token came out of it
            finished_req_ids=finished_ids,
        )
        # Every running request got exactly one token and the budget was not used up (so none was cut
        # short): until something changes, the next plans are this one plus new blocks.
        one_each = len(num_scheduled) == len(self.running) == plan.total_num_scheduled_tokens
        if self.enable_steady_decode and self.running and not new_reqs and one_each and budget > 0:
            self._steady = _SteadyDecode.after(plan, self.running, self.kv.num_slots)
        return plan

    def _schedule_steady_decode(self, steady: _SteadyDecode) -> SchedulerOutput | None:
        """The fast path, for the steps after a plan of one decode token per running request while
        nothing changes (no arrival, finish, abort or preemption): the plain path would schedule the
        same tokens and give new blocks to exactly the requests reaching a block boundary, so the
        plan reuses the last `num_scheduled_tokens` and visits only those requests. None when the
        pool cannot hold their blocks (the plain path then preempts).
        `tests/core/test_scheduler_invariants.py` checks both paths give the same plans."""
        steady.step += 1
        if steady.step >= steady.limit:
            return None
        due = steady.due.pop(steady.step, [])
        if len(due) > self.kv.num_free_blocks:
            return None
        cached_reqs = []
        block_size = self.kv.block_size
        for index, request in sorted(due, key=lambda entry: entry[0]):  # in running order
            new_blocks = self.kv.allocate_slots(request, 1)
            assert new_blocks, "one token past a full block takes one block"
            cached_reqs.append(self._cached_request_data(request, new_blocks, request.num_computed_tokens))
            steady.due.setdefault(steady.step + block_size, []).append((index, request))
        finished_ids = frozenset(self._finished_req_ids)
        self._finished_req_ids = set()
        return SchedulerOutput(
            scheduled_new_reqs=(),
            scheduled_cached_reqs=tuple(cached_reqs),
            num_scheduled_tokens=steady.num_scheduled_tokens,
            total_num_scheduled_tokens=len(steady.num_scheduled_tokens),
            finished_req_ids=finished_ids,
        )

    def _schedule_running(
        self, budget: int, num_scheduled: dict[str, int], cached_reqs: list[CachedRequestData]
    ) -> int:
        """The running requests' part of the plan: each, in order, for all its uncomputed tokens (one
        for a decode) capped by what is left of the budget, until the budget runs out. Returns the
        budget left.

        A request gets KV blocks (and an entry in `cached_reqs`) only when its tokens outgrow the
        slots its blocks hold: a decode once every `block_size` steps. When the pool is empty, later
        running requests are preempted for it (never one scheduled before it this step), or it is
        preempted itself."""
        num_slots = self.kv.num_slots
        for request in self.running.copy():  # preemption removes requests from `running`
            if request.status is not _RUNNING:
                continue  # preempted for a request before it
            request_id, num_computed = request.request_id, request.num_computed_tokens
            num_tokens = len(request.all_token_ids) + request.num_output_placeholders
            if num_tokens >= request.max_num_tokens:
                continue  # its last token is on its way (asynchronous scheduling): it ends with it
            num_new = num_tokens - num_computed
            if num_new > budget:
                num_new = budget
            if num_computed + num_new > num_slots[request_id]:
                # Everything before it in `running` is scheduled: the victims come after it.
                new_blocks = self._allocate_or_preempt(request, num_new, first_victim=len(num_scheduled))
                if new_blocks is None:
                    continue  # it was preempted itself
                cached_reqs.append(self._cached_request_data(request, new_blocks, num_computed))
            num_scheduled[request_id] = num_new
            budget -= num_new
            if budget == 0:
                break
        return budget

    def _schedule_waiting(
        self, budget: int, num_scheduled: dict[str, int], new_reqs: list[NewRequestData]
    ) -> int:
        """Admit waiting requests in queue order while the budget, the sequence limit and the KV cache
        last; each starts after its longest prefix-cache hit. Returns the budget left."""
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting.peek()
            hit_blocks, num_hit = self._prefix_hit(request)
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
        return budget

    def advance(self, plan: SchedulerOutput) -> None:
        """Count `plan`'s tokens as computed, before its sampled ids are known: each scheduled request
        advances by its scheduled tokens, and one that reaches its last known token (it samples) gets
        a placeholder for the token on its way. Asynchronous scheduling calls this before it plans the
        next step while `plan` still runs; `update_from_output` calls it for a plan nobody advanced."""
        self._advanced_plan = plan
        for request, num_tokens in zip(
            self._plan_requests(plan), plan.num_scheduled_tokens.values(), strict=True
        ):
            if request is None or request.status is not _RUNNING:
                continue  # finished or aborted since the plan was made
            num_computed = request.num_computed_tokens
            if num_computed < request.num_prompt_tokens:  # the step computes prompt tokens
                self._count_prompt_tokens(request, num_tokens)
            num_computed += num_tokens
            request.num_computed_tokens = num_computed
            if num_computed == len(request.all_token_ids) + request.num_output_placeholders:
                request.num_output_placeholders += 1

    def update_from_output(
        self, plan: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Advance each scheduled request by its computed tokens (`advance`, unless done already),
        append sampled tokens in place of their placeholders, apply stop conditions and free finished
        requests. Returns one output per request that sampled."""
        if plan is not self._advanced_plan:
            self.advance(plan)
        self._advanced_plan = None
        sampled = runner_output.sampled_token_ids
        logprobs = runner_output.logprobs or [None] * len(sampled)
        outputs: list[EngineCoreOutput] = []
        finished: list[Request] = []
        # Grammars that ended with the previous step's tokens, by request id (usually none).
        ended_grammars = runner_output.ended_grammars
        ended = {e.request_id: e for e in ended_grammars} if ended_grammars else None
        num_ended = 0  # outputs without a token
        for request, token_id, logprob in zip(self._plan_requests(plan), sampled, logprobs, strict=True):
            if request is None or request.status is not _RUNNING:
                # Finished or aborted since the plan was made (the id may be new again): its token is
                # dropped. Preempted by the plan made while this one ran: it keeps its token, unless
                # its grammar ended before it (`_finish_unscheduled_grammars` finishes it below).
                preempted = request is not None and request.status is _PREEMPTED
                if token_id is not None and preempted and not (ended and request.request_id in ended):
                    outputs.append(self._resolve_preempted(request, token_id, logprob))
                continue
            if ended and (end := ended.pop(request.request_id, None)) and end.grammar is request.grammar:
                # Its last token ended the grammar: this step's token (EOS, all the mask allowed) is not
                # part of the output.
                finished.append(request)
                outputs.append(self._finish_grammar(request, end))
                num_ended += 1
                continue
            if token_id is None:  # a prefill chunk short of the end of the prompt samples nothing
                continue
            tokens = request.all_token_ids
            tokens.append(token_id)
            request.num_output_placeholders -= 1
            if request.first_token_ts is None:
                request.first_token_ts = time.time()
            finish_reason = None
            if token_id in request.stop_token_ids or len(tokens) >= request.max_num_tokens:
                status = self._check_stop(request, token_id)
                if status is not None:
                    finish_reason = status.finish_reason
                    finished.append(request)
                    self._release(request, status)
            new_logprobs = None if logprob is None else [logprob]
            outputs.append(self.make_output(request, [token_id], finish_reason, new_logprobs))
            if runner_output.prompt_logprobs and not request.prompt_logprobs_sent:
                outputs[-1].prompt_logprobs = runner_output.prompt_logprobs.get(request.request_id)
                request.prompt_logprobs_sent = outputs[-1].prompt_logprobs is not None
        self.num_generation_tokens += len(outputs) - num_ended
        if finished:
            self._remove_from_running(finished)
        if ended:
            outputs += self._finish_unscheduled_grammars(ended)
        return outputs

    def _plan_requests(self, plan: SchedulerOutput) -> list[Request | None]:
        """The requests of `plan`, in its batch order (None for an id no longer live)."""
        steady = self._steady
        if steady is not None and plan.num_scheduled_tokens is steady.num_scheduled_tokens:
            # A steady-decode plan with nothing changed since: its requests are `running`, in order.
            return self.running
        return [self.requests.get(request_id) for request_id in plan.num_scheduled_tokens]

    def _resolve_preempted(
        self, request: Request, token_id: int, logprob: TokenLogprobs | None
    ) -> EngineCoreOutput:
        """The token of a request that the next plan preempted while this step ran (asynchronous
        scheduling): it is the request's like any other (it resumes with it), and may finish it, out
        of the waiting queue."""
        request.all_token_ids.append(token_id)
        request.num_output_placeholders -= 1
        if request.first_token_ts is None:
            request.first_token_ts = time.time()
        status = self._check_stop(request, token_id)
        if status is not None:
            self.waiting.remove(request)
            self._release(request, status)
        new_logprobs = None if logprob is None else [logprob]
        return self.make_output(request, [token_id], status and status.finish_reason, new_logprobs)

    def _finish_grammar(self, request: Request, end: EndedGrammar) -> EngineCoreOutput:
        """Finish a request whose grammar ended with its last token: "stop" with no stop token
        (`stop_reason` None), or "error" when the grammar rejected that token (only an engine bug can
        make the mask allow a token the grammar rejects). The output carries no new token."""
        status = RequestStatus.FINISHED_STOPPED if end.error is None else RequestStatus.FINISHED_ERROR
        self._release(request, status)
        output = self.make_output(request, [], status.finish_reason)
        output.error = end.error
        return output

    def _finish_unscheduled_grammars(self, ended: dict[str, EndedGrammar]) -> list[EngineCoreOutput]:
        """Finish the requests whose grammar ended but which this step did not run (preempted, or
        left out of the batch, since their token was sampled)."""
        outputs = []
        for request_id, end in ended.items():
            request = self.requests.get(request_id)
            if request is None or request.grammar is not end.grammar:
                continue  # finished since (its id may name a new request now)
            self._steady = None
            if request.status is _RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            outputs.append(self._finish_grammar(request, end))
        return outputs

    def _prefix_hit(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The prefix-cache hit a waiting request starts from. A request that wants its prompt's
        logprobs computes the whole prompt (cached blocks hold no logits), as vLLM does."""
        if request.sampling_params.prompt_logprobs is not None and not request.prompt_logprobs_sent:
            return [], 0
        return self.kv.get_computed_blocks(request)

    def make_output(
        self,
        request: Request,
        new_token_ids: list[int],
        finish_reason: FinishReason | None = None,
        new_logprobs: list[TokenLogprobs] | None = None,
    ) -> EngineCoreOutput:
        """The one place a request's `EngineCoreOutput` is built (for a sampled token, an abort)."""
        return EngineCoreOutput(
            request_id=request.request_id,
            new_token_ids=new_token_ids,
            new_logprobs=new_logprobs,
            finish_reason=None if finish_reason is None else finish_reason.value,
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

    def _allocate_or_preempt(
        self, request: Request, num_new: int, first_victim: int
    ) -> Sequence[KVCacheBlock] | None:
        """Blocks for `num_new` more tokens of a running request, preempting `running[first_victim:]`
        (the requests not scheduled yet this step) until they fit. Returns the new blocks, or None when
        the request itself had to be preempted."""
        while (new_blocks := self.kv.allocate_slots(request, num_new)) is None:
            victim = self._pick_victim(first_victim)
            self._preempt(victim)
            if victim is request:
                return None
        return new_blocks

    def _count_prompt_tokens(self, request: Request, num_tokens: int) -> None:
        start, num_prompt = request.num_computed_tokens, request.num_prompt_tokens
        self.num_prompt_tokens += min(num_prompt, start + num_tokens) - start

    @staticmethod
    def _cached_request_data(
        request: Request, new_blocks: Sequence[KVCacheBlock], num_computed: int
    ) -> CachedRequestData:
        return CachedRequestData(request.request_id, tuple([b.block_id for b in new_blocks]), num_computed)

    def _pick_victim(self, first_index: int) -> Request:
        candidates = self.running[first_index:]
        if self.config.policy == "priority":
            return max(candidates, key=lambda r: (r.priority, r.arrival_time, r.arrival_seq))
        return candidates[-1]

    def _preempt(self, request: Request) -> None:
        self._steady = None
        self.running.remove(request)
        self.kv.free(request)
        request.transition(RequestStatus.PREEMPTED)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
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
        # A request is (re)admitted only after every plan it was in was updated: all its ids are known.
        assert request.num_output_placeholders == 0, f"{request.request_id} is admitted with ids on their way"
        return NewRequestData(
            request_id=request.request_id,
            token_ids=tuple(request.all_token_ids),
            num_prompt_tokens=request.num_prompt_tokens,
            sampling_params=request.sampling_params,
            block_ids=tuple(self.kv.get_block_ids(request.request_id)),
            num_computed_tokens=request.num_computed_tokens,
            grammar=request.grammar,
            wants_prompt_logprobs=request.sampling_params.prompt_logprobs is not None
            and not request.prompt_logprobs_sent,
        )

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
        self._steady = None
        if request.status is _RUNNING:
            self.running.remove(request)
        elif request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            self.waiting.remove(request)
        self._release(request, status)

    def _remove_from_running(self, finished: list[Request]) -> None:
        """Take finished requests out of `running`: a few one by one (a C-level search each), many
        with one pass (one removal each is quadratic when a whole batch ends at once)."""
        self._steady = None
        if len(finished) <= 4:
            for request in finished:
                self.running.remove(request)
        else:
            self.running = [r for r in self.running if r.status is _RUNNING]

    def _release(self, request: Request, status: RequestStatus) -> None:
        request.transition(status)
        request.grammar = None  # the matcher's memory goes with the request
        self.kv.free(request)
        del self.requests[request.request_id]
        self._finished_req_ids.add(request.request_id)
