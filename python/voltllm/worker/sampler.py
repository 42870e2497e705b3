"""Turns one step's logits into tokens, vectorised over the batch.

Order (as vLLM): logit bias -> min-tokens stop masking -> repetition / frequency / presence penalties
-> temperature -> logprobs of that distribution -> top-k / top-p / min-p -> sample. Greedy rows
(temperature 0) take the argmax of the penalised logits.

Sampling uses the exponential race: argmax(p / E) with E ~ Exp(1) per token draws exactly from p, and
lets every seeded row draw its noise from its own generator. A seeded row's generator is re-seeded
each step from (seed, number of tokens generated so far), so its tokens depend only on its own seed
and history: not on what else is in the batch, and not on a preemption that rebuilt its state.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from voltllm.protocol import TokenLogprobs

_MASK = float("-inf")


@dataclass
class SamplingMetadata:
    """Per-row sampling inputs of one step (row i = the i-th request that samples)."""

    temperature: torch.Tensor  # [N] float32; 0 = greedy
    all_greedy: bool
    top_k: torch.Tensor | None = None  # [N] int64, vocab_size where off; None when no row uses it
    top_p: torch.Tensor | None = None  # [N] float32; None when no row uses it
    min_p: torch.Tensor | None = None  # [N] float32; None when no row uses it
    generators: dict[int, torch.Generator] = field(default_factory=dict)  # row -> seeded generator
    # Penalties, None when no row uses any. Token-id matrices are padded with vocab_size.
    prompt_token_ids: torch.Tensor | None = None  # [N, max_prompt_len] int64
    output_token_ids: torch.Tensor | None = None  # [N, max_output_len] int64
    presence_penalty: torch.Tensor | None = None  # [N]
    frequency_penalty: torch.Tensor | None = None  # [N]
    repetition_penalty: torch.Tensor | None = None  # [N]
    logit_bias: list[tuple[int, torch.Tensor, torch.Tensor]] = field(default_factory=list)  # row, ids, bias
    banned_token_ids: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # row, ids (min_tokens)
    num_logprobs: list[int | None] = field(default_factory=list)  # per row, None = not requested


@dataclass
class SamplerOutput:
    sampled_token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


def seed_for_step(seed: int, num_generated: int) -> int:
    """A 64-bit seed for one step of a seeded request (a fixed mix of the user seed and the step)."""
    return (seed * 0x9E3779B97F4A7C15 + (num_generated + 1) * 0xBF58476D1CE4E5B9) % (1 << 64)


class Sampler:
    def __init__(self, generator: torch.Generator | None = None) -> None:
        self.generator = generator  # noise for unseeded rows

    def __call__(self, logits: torch.Tensor, md: SamplingMetadata) -> SamplerOutput:
        if md.all_greedy and _is_plain(md):
            # Nothing modifies the logits and nothing reads a distribution: the argmax is the answer,
            # without copying the [N, vocab] logits (the common case of a greedy batch).
            return SamplerOutput(logits.argmax(dim=-1).tolist(), [None] * logits.shape[0])
        logits = logits.float().clone()  # [N, vocab]
        _apply_logit_bias_and_bans(logits, md)
        _apply_penalties(logits, md)
        greedy = logits.argmax(dim=-1)
        if md.all_greedy:
            scaled, sampled = logits, greedy
        else:
            temperature = torch.where(md.temperature > 0, md.temperature, torch.ones_like(md.temperature))
            scaled = logits / temperature.unsqueeze(1)
            random = self._sample(_apply_filters(scaled.clone(), md), md)
            sampled = torch.where(md.temperature > 0, random, greedy)
        logprobs = _gather_logprobs(scaled, sampled, md.num_logprobs)
        return SamplerOutput(sampled.tolist(), logprobs)

    def _sample(self, logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        probs = logits.softmax(dim=-1)
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        for row, gen in md.generators.items():
            noise[row].exponential_(generator=gen)
        # Exp(1) can round to 0; a floor keeps p / E finite (0 / 0 would be NaN, which argmax picks).
        return (probs / noise.clamp_min_(1e-20)).argmax(dim=-1)


def _is_plain(md: SamplingMetadata) -> bool:
    """No logit bias, banned ids, penalties or logprobs in any row."""
    return (
        not md.logit_bias
        and not md.banned_token_ids
        and md.output_token_ids is None
        and all(n is None for n in md.num_logprobs)
    )


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


def _apply_filters(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    if md.top_k is not None or md.top_p is not None:
        logits = _apply_top_k_top_p(logits, md.top_k, md.top_p)
    if md.min_p is not None:
        probs = logits.softmax(dim=-1)
        threshold = md.min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(probs < threshold, _MASK)
    return logits


def _apply_top_k_top_p(logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None) -> torch.Tensor:
    """Mask all but the k most likely tokens, then all but the smallest set with mass >= p."""
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    vocab = logits.shape[1]
    if k is not None:
        kth = sorted_logits.gather(1, (vocab - k.clamp(1, vocab)).unsqueeze(1))
        sorted_logits.masked_fill_(sorted_logits < kth, _MASK)
    if p is not None:
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative <= (1 - p).unsqueeze(1)
        drop[:, -1] = False  # always keep the most likely token
        sorted_logits.masked_fill_(drop, _MASK)
    return logits.scatter(1, order, sorted_logits)


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
