"""The engine's view of one request: its tokens, its progress and its status.

Invariant: `num_computed_tokens <= num_tokens`. Prefill and decode are the same thing seen from here:
each step the scheduler lets `num_computed_tokens` catch up to `num_tokens` (a whole prompt, a chunk
of one, or the single token sampled last step); once it has caught up, the step samples a new token,
which makes `num_tokens` one larger again. Under asynchronous scheduling the next step is planned
before the last one's ids are known: its sampled tokens count as `num_output_placeholders` until they
arrive, and the invariant is `num_computed_tokens <= num_tokens + num_output_placeholders`.
"""

from __future__ import annotations

import enum
import itertools
import time
from typing import TYPE_CHECKING

from voltllm.protocol import EngineCoreRequest, EngineSamplingParams, FinishReason

if TYPE_CHECKING:
    from voltllm.structured_output import Grammar


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH_CAPPED = "finished_length_capped"
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_ERROR = "finished_error"

    @property
    def is_finished(self) -> bool:
        return self in _FINISH_REASONS

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}
_ANY_FINISH = frozenset(_FINISH_REASONS)
_TRANSITIONS: dict[RequestStatus, frozenset[RequestStatus]] = {
    RequestStatus.WAITING: frozenset({RequestStatus.RUNNING}) | _ANY_FINISH,
    RequestStatus.RUNNING: frozenset({RequestStatus.PREEMPTED}) | _ANY_FINISH,
    RequestStatus.PREEMPTED: frozenset({RequestStatus.RUNNING}) | _ANY_FINISH,
}


class InvalidTransition(RuntimeError):
    """A status change the request state machine does not allow (an engine bug, never user input)."""


_arrival_counter = itertools.count()


class Request:
    """Mutable per-request state owned by the scheduler."""

    # Slots: the scheduler reads and writes a few of these per running request per step, and slot
    # access is faster than a __dict__ lookup.
    __slots__ = (
        "request_id",
        "prompt_token_ids",
        "sampling_params",
        "arrival_time",
        "priority",
        "arrival_seq",
        "status",
        "num_prompt_tokens",
        "all_token_ids",
        "num_computed_tokens",
        "num_output_placeholders",
        "max_num_tokens",
        "num_cached_tokens",
        "num_preemptions",
        "stop_reason",
        "block_hashes",
        "queued_ts",
        "scheduled_ts",
        "first_token_ts",
        "stop_token_ids",
        "grammar",
        "prompt_logprobs_sent",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: EngineSamplingParams,
        eos_token_ids: tuple[int, ...] = (),
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.priority = priority
        # Ties in (priority, arrival_time) are broken by the order the engine saw the requests.
        self.arrival_seq = next(_arrival_counter)
        self.status = RequestStatus.WAITING
        self.num_prompt_tokens = len(self.prompt_token_ids)
        # Prompt then generated tokens; the generated ones are not kept twice (one append per step).
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        # Tokens a step has sampled (or is sampling) whose ids the scheduler has not seen yet: a step
        # that `Scheduler.advance` counted and `update_from_output` has not resolved. At most two, under
        # asynchronous scheduling (the step in flight and the one just planned).
        self.num_output_placeholders = 0
        # num_tokens at which it stops for length: max_tokens reached (the scheduler lowers it to
        # max_model_len when that comes first).
        self.max_num_tokens = self.num_prompt_tokens + sampling_params.max_tokens
        self.num_cached_tokens = 0  # prompt tokens served by the prefix cache at first scheduling
        self.num_preemptions = 0
        self.stop_reason: int | None = None
        # Chained hashes of this request's full blocks, filled lazily by the KV cache manager.
        self.block_hashes: list[bytes] = []
        self.queued_ts = time.time()
        self.scheduled_ts: float | None = None
        self.first_token_ts: float | None = None
        # Stop ids this request honours: EOS (unless ignore_eos) plus the user's stop_token_ids.
        eos = () if sampling_params.ignore_eos else tuple(eos_token_ids)
        self.stop_token_ids = frozenset(eos) | frozenset(sampling_params.stop_token_ids)
        # The structured-output constraint's matcher (the engine compiles it when it accepts the
        # request); dropped when the request finishes.
        self.grammar: Grammar | None = None
        # Prompt logprobs go out once, with the first sampled token; a resumed request does not resend.
        self.prompt_logprobs_sent = False

    @classmethod
    def from_wire(cls, req: EngineCoreRequest, eos_token_ids: tuple[int, ...]) -> Request:
        return cls(
            req.request_id,
            req.prompt_token_ids,
            req.sampling_params,
            eos_token_ids,
            arrival_time=req.arrival_time,
            priority=req.priority,
        )

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        """The generated tokens (a copy)."""
        return self.all_token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def transition(self, new_status: RequestStatus) -> None:
        """Move to `new_status`; raise `InvalidTransition` when the state machine forbids it."""
        if new_status not in _TRANSITIONS.get(self.status, frozenset()):
            raise InvalidTransition(f"request {self.request_id!r}: {self.status.name} -> {new_status.name}")
        self.status = new_status

    def append_output_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.name}, "
            f"computed={self.num_computed_tokens}/{self.num_tokens})"
        )
