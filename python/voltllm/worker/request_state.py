"""What the model runner keeps of each running request between steps.

A request is a row: the same row of `RequestArrays` (token ids, progress, sampling settings) and of the
block table (`step_inputs.BlockTable`), from the plan that sends it in full (`NewRequestData`) to the one
that lists it as finished. Row-indexed arrays let a decode step of a few hundred requests be prepared
and finished with a handful of numpy operations instead of Python loops over requests. Invariant:
`num_computed[row] <= num_tokens[row]`, the runner's copy of the scheduler's counts for the request.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from voltllm.protocol import EngineSamplingParams, TokenLogprobs
from voltllm.structured_output import Grammar
from voltllm.worker.step_inputs import SAMPLING_FLOATS

_U64 = 1 << 64
_INT32_LIMIT = 1 << 31


def uses_penalties(p: EngineSamplingParams) -> bool:
    """Presence, frequency or repetition penalty: the sampler reads the request's output tokens."""
    return p.presence_penalty != 0 or p.frequency_penalty != 0 or p.repetition_penalty != 1


def is_plain_greedy(p: EngineSamplingParams) -> bool:
    """Greedy, and no logit bias, penalties, logprobs or min_tokens: the next token is the argmax."""
    return (
        p.temperature == 0
        and not p.logit_bias
        and p.logprobs is None
        and p.min_tokens == 0
        and not uses_penalties(p)
    )


@dataclass
class CachedRequestState:
    """A running request's row and what is not an array: its sampling inputs, built once."""

    request_id: str
    num_prompt_tokens: int
    sampling_params: EngineSamplingParams
    row: int  # this request's row of the block table and of the request arrays
    num_blocks: int  # entries of its block-table row in use
    # Device tensors the sampling metadata needs every step, built on first use:
    logit_bias: tuple[torch.Tensor, torch.Tensor] | None = None  # (token ids int64, bias float32)
    min_tokens_stop_ids: torch.Tensor | None = None  # EOS (unless ignore_eos) + stop ids, int64
    grammar: Grammar | None = None  # its structured-output matcher (the scheduler advances it)
    # While its prompt is being computed, the logprobs of the prompt positions so far; None when not
    # wanted, or once handed over with its first sampled token.
    prompt_logprobs: list[TokenLogprobs] | None = None


class SamplingColumns:
    """Each running request's sampling settings, one column per setting, indexed by row.

    Written once when a request starts; a step gathers its sampling rows' columns straight into its
    staging buffer (`sampling_metadata.SamplingStager`), so no per-request Python runs per step.
    `floats` holds the `SAMPLING_FLOATS` settings in the staging layout's order (indices `TEMPERATURE`
    .. `REPETITION`).
    """

    TEMPERATURE, TOP_P, MIN_P, PRESENCE, FREQUENCY, REPETITION = range(SAMPLING_FLOATS)

    def __init__(self, num_rows: int) -> None:
        self.floats = np.zeros((SAMPLING_FLOATS, num_rows), dtype=np.float32)
        self.top_k = np.zeros(num_rows, dtype=np.int32)  # <= 0: off
        self.seeded = np.zeros(num_rows, dtype=bool)
        self.seed = np.zeros(num_rows, dtype=np.uint64)  # the user seed mod 2**64 (seeded rows)
        self.num_prompt = np.zeros(num_rows, dtype=np.int64)
        self.min_tokens = np.zeros(num_rows, dtype=np.int64)
        self.num_logprobs = np.full(num_rows, -1, dtype=np.int64)  # -1: not requested
        self.has_logit_bias = np.zeros(num_rows, dtype=bool)

    def start(self, row: int, p: EngineSamplingParams, num_prompt_tokens: int) -> None:
        self.floats[:, row] = (
            p.temperature,
            p.top_p,
            p.min_p,
            p.presence_penalty,
            p.frequency_penalty,
            p.repetition_penalty,
        )
        # Any top-k of the vocabulary's size or more keeps every token: off, like 0 and -1 (an int32
        # column cannot hold every value the API accepts).
        self.top_k[row] = p.top_k if 0 < p.top_k < _INT32_LIMIT else 0
        self.seeded[row] = p.seed is not None
        self.seed[row] = 0 if p.seed is None else p.seed % _U64
        self.num_prompt[row] = num_prompt_tokens
        self.min_tokens[row] = p.min_tokens
        self.num_logprobs[row] = -1 if p.logprobs is None else p.logprobs
        self.has_logit_bias[row] = bool(p.logit_bias)


class RequestArrays:
    """Per-request step state in arrays indexed by row (one spare row at the end).

    `token_ids[row, :num_tokens[row]]` are the request's prompt and generated tokens (the runner writes
    what it samples), `num_computed[row]` how many of them are in the KV cache, `plain_greedy[row]`
    whether its next token is just the argmax (`is_plain_greedy`), `sampling` its other settings.
    """

    def __init__(self, num_rows: int, max_model_len: int) -> None:
        self.token_ids = np.zeros((num_rows + 1, max_model_len + 1), dtype=np.int32)
        self.num_tokens = np.zeros(num_rows + 1, dtype=np.int64)
        self.num_computed = np.zeros(num_rows + 1, dtype=np.int64)
        self.plain_greedy = np.zeros(num_rows + 1, dtype=bool)
        self.sampling = SamplingColumns(num_rows + 1)

    def start(
        self,
        row: int,
        token_ids: tuple[int, ...],
        num_computed: int,
        params: EngineSamplingParams,
        num_prompt_tokens: int,
    ) -> None:
        """Fill `row` for a request starting (or resuming) with `token_ids`, `num_computed` of them in
        the KV cache."""
        self.token_ids[row, : len(token_ids)] = token_ids
        self.num_tokens[row] = len(token_ids)
        self.num_computed[row] = num_computed
        self.plain_greedy[row] = is_plain_greedy(params)
        self.sampling.start(row, params, num_prompt_tokens)

    def tokens(self, row: int) -> list[int]:
        return self.token_ids[row, : self.num_tokens[row]].tolist()
