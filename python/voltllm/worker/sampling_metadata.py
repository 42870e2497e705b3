"""The sampler's per-step inputs (`SamplingMetadata`), built from the runner's request states.

Row i of the metadata is the i-th request that samples this step. Columns a request does not use are
left out (None) when no row uses them, so the sampler skips their work; tensors that only change with
the request (logit bias, the stop ids that min_tokens masks) are built once per request and kept on its
`CachedRequestState`. A seeded request's noise seed is derived every step from its seed and the number
of tokens it has generated (`seed_for_step`), which is what makes its tokens independent of the batch.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from voltllm.protocol import EngineSamplingParams
from voltllm.worker.request_state import CachedRequestState, RequestArrays
from voltllm.worker.sampler import SamplingMetadata, seed_for_step


def is_plain_greedy(p: EngineSamplingParams) -> bool:
    """Greedy, and no logit bias, penalties, logprobs or min_tokens: the next token is the argmax."""
    return (
        p.temperature == 0
        and not p.logit_bias
        and p.logprobs is None
        and p.min_tokens == 0
        and p.presence_penalty == 0
        and p.frequency_penalty == 0
        and p.repetition_penalty == 1
    )


def build_sampling_metadata(
    states: list[CachedRequestState],
    arrays: RequestArrays,
    *,
    device: torch.device,
    vocab_size: int,
    eos_token_ids: tuple[int, ...],
) -> SamplingMetadata:
    """The metadata of a step whose sampling requests are `states`, in sampling order."""
    params = [s.sampling_params for s in states]

    def col(values: list, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=device)

    md = SamplingMetadata(
        temperature=col([p.temperature for p in params]),
        all_greedy=all(p.temperature == 0 for p in params),
        num_logprobs=[p.logprobs for p in params],
    )
    if any(p.top_k > 0 for p in params):
        md.top_k = col([p.top_k if p.top_k > 0 else vocab_size for p in params], torch.int64)
    if any(p.top_p < 1.0 for p in params):
        md.top_p = col([p.top_p for p in params])
    if any(p.min_p > 0.0 for p in params):
        md.min_p = col([p.min_p for p in params])
    for row, state in enumerate(states):
        p = state.sampling_params
        num_output_tokens = int(arrays.num_tokens[state.row]) - state.num_prompt_tokens
        if p.seed is not None:
            md.seeds[row] = seed_for_step(p.seed, num_output_tokens)
        if p.logit_bias:
            if state.logit_bias is None:
                state.logit_bias = (
                    col(list(p.logit_bias.keys()), torch.int64),
                    col(list(p.logit_bias.values())),
                )
            md.logit_bias.append((row, *state.logit_bias))
        if num_output_tokens < p.min_tokens:
            if state.min_tokens_stop_ids is None:
                eos = () if p.ignore_eos else eos_token_ids
                state.min_tokens_stop_ids = col(sorted({*eos, *p.stop_token_ids}), torch.int64)
            if state.min_tokens_stop_ids.numel():
                md.banned_token_ids.append((row, state.min_tokens_stop_ids))
    if any(p.presence_penalty != 0 or p.frequency_penalty != 0 or p.repetition_penalty != 1 for p in params):
        _add_penalty_inputs(md, states, arrays, vocab_size, device, col)
    return md


def _add_penalty_inputs(
    md: SamplingMetadata,
    states: list[CachedRequestState],
    arrays: RequestArrays,
    vocab_size: int,
    device: torch.device,
    col: Callable[..., torch.Tensor],
) -> None:
    """Prompt and output token ids per row (padded with `vocab_size`) and the penalty columns."""

    def padded(rows: list[list[int]]) -> torch.Tensor:
        width = max(1, max(len(r) for r in rows))
        out = np.full((len(rows), width), vocab_size, dtype=np.int64)
        for i, r in enumerate(rows):
            out[i, : len(r)] = r
        return torch.from_numpy(out).to(device)

    tokens = [arrays.tokens(s.row) for s in states]
    md.prompt_token_ids = padded([t[: s.num_prompt_tokens] for t, s in zip(tokens, states, strict=True)])
    md.output_token_ids = padded([t[s.num_prompt_tokens :] for t, s in zip(tokens, states, strict=True)])
    md.presence_penalty = col([s.sampling_params.presence_penalty for s in states])
    md.frequency_penalty = col([s.sampling_params.frequency_penalty for s in states])
    md.repetition_penalty = col([s.sampling_params.repetition_penalty for s in states])
