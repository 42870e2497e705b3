"""What the model runner keeps of each running request between steps.

A request is a row: the same row of `RequestArrays` (token ids, progress, plain-greedy flag) and of the
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


class RequestArrays:
    """Per-request step state in arrays indexed by row (one spare row at the end).

    `token_ids[row, :num_tokens[row]]` are the request's prompt and generated tokens (the runner writes
    what it samples), `num_computed[row]` how many of them are in the KV cache, `plain_greedy[row]`
    whether its next token is just the argmax (`sampling_metadata.is_plain_greedy`).
    """

    def __init__(self, num_rows: int, max_model_len: int) -> None:
        self.token_ids = np.zeros((num_rows + 1, max_model_len + 1), dtype=np.int32)
        self.num_tokens = np.zeros(num_rows + 1, dtype=np.int64)
        self.num_computed = np.zeros(num_rows + 1, dtype=np.int64)
        self.plain_greedy = np.zeros(num_rows + 1, dtype=bool)

    def start(self, row: int, token_ids: tuple[int, ...], num_computed: int, plain_greedy: bool) -> None:
        self.token_ids[row, : len(token_ids)] = token_ids
        self.num_tokens[row] = len(token_ids)
        self.num_computed[row] = num_computed
        self.plain_greedy[row] = plain_greedy

    def tokens(self, row: int) -> list[int]:
        return self.token_ids[row, : self.num_tokens[row]].tolist()
