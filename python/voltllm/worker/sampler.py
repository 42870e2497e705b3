"""Turns one step's logits into tokens, vectorised over the batch.

Order (as vLLM): logit bias -> min-tokens stop masking -> repetition / frequency / presence penalties
-> temperature -> logprobs of that distribution -> top-k / top-p / min-p -> sample. Greedy rows
(temperature 0) take the argmax of the penalised logits.

The draw itself is `voltllm.ops.sample_tokens` (a kernel on a GPU, its torch reference elsewhere): top-k,
top-p and min-p by threshold search instead of a vocabulary sort, and the exponential race with noise
hashed from a per-row seed and the token id. A seeded row's seed is derived each step from (seed,
number of tokens generated so far), so its tokens depend only on its own seed and history: not on what
else is in the batch, and not on a preemption that rebuilt its state. Other rows get fresh seeds from
the runner's generator each step (`sampling_metadata.SamplingStager` stages both with the step).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from voltllm.ops.sampling import argmax_tokens, check_sampling_method, sample_tokens
from voltllm.protocol import TokenLogprobs

_MASK = float("-inf")


@dataclass
class SamplingMetadata:
    """Per-row sampling inputs of one step (row i = the i-th request that samples)."""

    temperature: torch.Tensor  # [N] float32; 0 = greedy
    all_greedy: bool
    top_k: torch.Tensor | None = None  # [N] int (<= 0 or >= vocab: off); None when no row uses it
    top_p: torch.Tensor | None = None  # [N] float32; None when no row uses it
    min_top_p: float | None = None  # the smallest of top_p, known on the host (None: not known)
    min_p: torch.Tensor | None = None  # [N] float32; None when no row uses it
    # [N] int64: each row's noise seed this step (the runner stages them: `SamplingStager`); may be None
    # only when every row is greedy.
    seeds: torch.Tensor | None = None
    # Penalties, None when no row uses any. Token-id matrices are padded with vocab_size.
    prompt_token_ids: torch.Tensor | None = None  # [N, max_prompt_len] int64
    output_token_ids: torch.Tensor | None = None  # [N, max_output_len] int64
    presence_penalty: torch.Tensor | None = None  # [N]
    frequency_penalty: torch.Tensor | None = None  # [N]
    repetition_penalty: torch.Tensor | None = None  # [N]
    logit_bias: list[tuple[int, torch.Tensor, torch.Tensor]] = field(default_factory=list)  # row, ids, bias
    banned_token_ids: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # row, ids (min_tokens)
    # Per row, None = not requested; empty: no row wants logprobs.
    num_logprobs: list[int | None] = field(default_factory=list)


@dataclass
class SamplerOutput:
    sampled: np.ndarray  # [N] int64 on the host: one device->host copy, no per-row Python
    logprobs: list[TokenLogprobs | None] | None  # per row; None: no row asked for logprobs

    @property
    def sampled_token_ids(self) -> list[int]:
        return self.sampled.tolist()


_SEED_MIX = np.uint64(0x9E3779B97F4A7C15)
_STEP_MIX = np.uint64(0xBF58476D1CE4E5B9)


def seeds_for_step(seeds: np.ndarray, num_generated: np.ndarray) -> np.ndarray:
    """The 64-bit noise seeds of one step of seeded requests: a fixed mix of each user seed (uint64,
    the seed mod 2**64) and the number of tokens it has generated, wrapping mod 2**64. `[n]` uint64."""
    return seeds * _SEED_MIX + (num_generated.astype(np.uint64) + np.uint64(1)) * _STEP_MIX


def seed_for_step(seed: int, num_generated: int) -> int:
    """`seeds_for_step` of one request."""
    one = seeds_for_step(np.array([seed % (1 << 64)], dtype=np.uint64), np.array([num_generated]))
    return int(one[0])


class Sampler:
    """Stateless: every row's noise comes from `SamplingMetadata.seeds`.

    `method` picks the draw's kernels (`voltllm.ops.sampling.METHOD_CHOICES`; every method draws the
    same tokens): "select" (the radix-select sampler, and torch's argmax for greedy rows), "race_first"
    (the race's best tokens checked against top-p; its first pass alone for greedy batches) or "auto"
    (the default: whichever the GPU A/B measured faster for the batch, `resolve_sampling_method`).
    """

    def __init__(self, method: str = "auto") -> None:
        check_sampling_method(method)
        self.method = method

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """The first argmax of each row, on the logits' device (a greedy batch's tokens)."""
        return argmax_tokens(logits, self.method)

    def __call__(self, logits: torch.Tensor, md: SamplingMetadata) -> SamplerOutput:
        if md.all_greedy and _is_plain(md):
            # Nothing modifies the logits and nothing reads a distribution: the argmax is the answer,
            # without copying the [N, vocab] logits (the common case of a greedy batch).
            return SamplerOutput(self.argmax(logits).cpu().numpy(), None)
        logits = _processed(logits, md)
        sampled = self.argmax(logits) if md.all_greedy else self._sample(logits, md)
        logprobs = None
        if wants_logprobs(md):
            temperature = torch.where(md.temperature > 0, md.temperature, torch.ones_like(md.temperature))
            logprobs = _gather_logprobs(logits.float() / temperature.unsqueeze(1), sampled, md.num_logprobs)
        return SamplerOutput(sampled.cpu().numpy(), logprobs)

    def sample_on_device(self, logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        """The sampled ids, `[N]` int64 on the logits' device, without waiting for them (what an
        asynchronous step leaves there for the next one). No logprobs: a step that wants them calls
        the sampler itself."""
        if md.all_greedy and _is_plain(md):
            return self.argmax(logits)
        logits = _processed(logits, md)
        return self.argmax(logits) if md.all_greedy else self._sample(logits, md)

    def _sample(self, logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        """Greedy rows take the argmax; the others draw under their temperature and filters."""
        if md.seeds is None:
            raise ValueError(
                "rows that sample with a temperature need their noise seeds (SamplingMetadata.seeds)"
            )
        top_k = md.top_k.int() if md.top_k is not None else None
        return sample_tokens(
            logits, md.temperature, top_k, md.top_p, md.min_p, md.seeds, self.method, min_top_p=md.min_top_p
        )


def _processed(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """The logits the draw reads: a float32 copy with bias, bans and penalties applied when a row has
    any, else the logits as they are (in their dtype)."""
    if not _edits_logits(md):
        return logits.contiguous()
    logits = logits.float().clone()  # [N, vocab]
    _apply_logit_bias_and_bans(logits, md)
    _apply_penalties(logits, md)
    return logits


def wants_logprobs(md: SamplingMetadata) -> bool:
    """Some row asked for logprobs."""
    return any(n is not None for n in md.num_logprobs)


def _edits_logits(md: SamplingMetadata) -> bool:
    """Some row has a logit bias, banned ids or penalties."""
    return bool(md.logit_bias or md.banned_token_ids or md.output_token_ids is not None)


def _is_plain(md: SamplingMetadata) -> bool:
    """Nothing edits the logits and no row wants logprobs."""
    return not _edits_logits(md) and not wants_logprobs(md)


def _apply_logit_bias_and_bans(logits: torch.Tensor, md: SamplingMetadata) -> None:
    for row, ids, bias in md.logit_bias:
        logits[row, ids] += bias
    for row, ids in md.banned_token_ids:
        logits[row, ids] = _MASK


def _apply_penalties(logits: torch.Tensor, md: SamplingMetadata) -> None:
    """Repetition penalty over prompt + output tokens; presence and frequency over output tokens."""
    if md.output_token_ids is None or md.prompt_token_ids is None:
        return
    num_rows, vocab = logits.shape
    output_counts = _bincount_rows(md.output_token_ids, vocab)
    if md.repetition_penalty is not None:
        seen = (output_counts > 0) | (_bincount_rows(md.prompt_token_ids, vocab) > 0)
        penalty = md.repetition_penalty.unsqueeze(1).expand(num_rows, vocab)
        # As in CTRL / HF: shrink positive logits, push negative ones further down.
        penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits.copy_(torch.where(seen, penalised, logits))
    if md.frequency_penalty is not None:
        logits -= md.frequency_penalty.unsqueeze(1) * output_counts
    if md.presence_penalty is not None:
        logits -= md.presence_penalty.unsqueeze(1) * (output_counts > 0).float()


def _bincount_rows(token_ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """[N, L] ids padded with `vocab` -> [N, vocab] float counts."""
    counts = torch.zeros(token_ids.shape[0], vocab + 1, dtype=torch.float32, device=token_ids.device)
    counts.scatter_add_(1, token_ids, torch.ones_like(token_ids, dtype=torch.float32))
    return counts[:, :vocab]


def _gather_logprobs(
    scaled_logits: torch.Tensor, sampled: torch.Tensor, num_logprobs: list[int | None]
) -> list[TokenLogprobs | None]:
    wanted = [n for n in num_logprobs if n is not None]
    if not wanted:
        return [None] * len(num_logprobs)
    logprobs = scaled_logits.log_softmax(dim=-1)
    sampled_lp = logprobs.gather(1, sampled.unsqueeze(1))
    ranks = (logprobs > sampled_lp).sum(dim=-1) + 1
    top_lp, top_ids = logprobs.topk(max(wanted), dim=-1) if max(wanted) > 0 else (None, None)
    out: list[TokenLogprobs | None] = []
    sampled_l, sampled_lp_l, ranks_l = sampled.tolist(), sampled_lp.squeeze(1).tolist(), ranks.tolist()
    top_lp_l = top_lp.tolist() if top_lp is not None else None
    top_ids_l = top_ids.tolist() if top_ids is not None else None
    for row, n in enumerate(num_logprobs):
        if n is None:
            out.append(None)
            continue
        ids, lps = [sampled_l[row]], [sampled_lp_l[row]]
        if n > 0:
            ids += top_ids_l[row][:n]
            lps += top_lp_l[row][:n]
        out.append(TokenLogprobs(token_ids=ids, logprobs=lps, rank=ranks_l[row]))
    return out
