"""Results of the offline API, shaped as vLLM's so code written against `vllm.LLM` runs unchanged."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """Log-probability of one candidate token at one position."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One entry per generated token: candidate token id -> its Logprob (the sampled token always included).
SampleLogprobs = list[dict[int, Logprob]]
# One entry per prompt token, None for the first (nothing precedes it), as vLLM's `PromptLogprobs`.
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    """One generated sequence (one of `n`)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """Everything generated for one prompt."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int = 0
    prompt_logprobs: PromptLogprobs | None = None  # when SamplingParams.prompt_logprobs asked for them
