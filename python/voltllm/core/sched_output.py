"""The plan the scheduler hands to the model runner each step, and what the runner hands back.

The runner keeps per-request state (token ids, block table) between steps, so a request appears in
full once (`NewRequestData`: when first scheduled, or again when resumed after preemption, since the
runner dropped it then) and afterwards only in `num_scheduled_tokens`, plus a diff
(`CachedRequestData`) in the steps that give it new KV blocks.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec

from voltllm.protocol import EngineSamplingParams, TokenLogprobs

if TYPE_CHECKING:
    from voltllm.structured_output import EndedGrammar


@dataclass(frozen=True)
class NewRequestData:
    request_id: str
    token_ids: tuple[int, ...]  # prompt plus any tokens generated before a preemption
    num_prompt_tokens: int
    sampling_params: EngineSamplingParams
    block_ids: tuple[int, ...]
    num_computed_tokens: int  # tokens already in the KV cache (prefix-cache hits)
    # The request's structured-output matcher (a `structured_output.Grammar`), shared with the
    # scheduler's `Request` (the runner advances it and fills its next-token mask); None
    # when unconstrained. Typed Any: the tensor-parallel step command decodes this struct with msgspec,
    # and the ranks it goes to (which sample nothing) get None in its place.
    grammar: Any = None
    # The runner computes the prompt's logprobs (a request that already sent them, resumed after a
    # preemption, does not).
    wants_prompt_logprobs: bool = False


class CachedRequestData(msgspec.Struct, frozen=True, gc=False):
    """The new KV blocks of a running request, in the steps that give it any (a decode gets one every
    `block_size` steps). A running request without new blocks has no entry: the runner advances it
    by its `num_scheduled_tokens` alone. A frozen msgspec struct: its C constructor is several times
    cheaper than a frozen dataclass's."""

    request_id: str
    new_block_ids: tuple[int, ...]  # appended to the request's block table
    num_computed_tokens: int  # before this step; the runner checks it matches its own count


class SchedulerOutput(msgspec.Struct, frozen=True):
    """One step's plan (a frozen msgspec struct: built every step, its C constructor is cheap)."""

    scheduled_new_reqs: tuple[NewRequestData, ...]
    scheduled_cached_reqs: tuple[CachedRequestData, ...]  # running requests with new blocks only
    # request id -> tokens to compute this step, in batch order (running requests first)
    num_scheduled_tokens: Mapping[str, int]
    total_num_scheduled_tokens: int
    # Requests the runner must forget: finished, aborted or preempted since the last plan.
    finished_req_ids: frozenset[str] = frozenset()

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass
class ModelRunnerOutput:
    """What one step sampled, in the plan's batch order (that of `num_scheduled_tokens`): per
    scheduled request its sampled token, or None when its scheduled tokens did not reach its last
    known token (a non-final prefill chunk samples nothing). `logprobs` is in the same order, or None
    when no request of the step asked for logprobs. An empty plan's output is empty."""

    sampled_token_ids: list[int | None] = field(default_factory=list)
    logprobs: list[TokenLogprobs | None] | None = None
    # request id -> logprobs of prompt positions 1..len-1, for the requests whose prompt ended this step
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    # The grammars that ended with (or rejected) the tokens the previous step sampled: the runner
    # advances them one step late, so the scheduler finishes those requests now and drops this
    # step's token of theirs (`structured_output.EndedGrammar`).
    ended_grammars: list[EndedGrammar] = field(default_factory=list)
