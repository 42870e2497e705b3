"""Which rows of a sampling test have a token the fp32 arithmetic does not settle.

The sampling kernels and their torch reference (`voltllm.ops.sampling.sample_tokens_ref`) make the same
decisions from the same fp32 values, except where a value comes from exp, log or log1p: the emulator's
libm and torch's vectorised functions differ by one ulp on ~1-7% of inputs. A decision those values
settle by less than a few ulps can go either way: two race values closer than that, a top-p ceiling
whose mass sum is that close to its target, a token's e that close to min_p. A test drawing fresh
random rows meets such a row now and then (~1e-4 of CI runs); it compares only the rows that are
settled, where one ulp cannot change the token, and there the kernels must agree exactly.
"""

from __future__ import annotations

import torch

from voltllm.ops.sampling import exponential_noise, top_p_cut

# Relative size of a difference that one-ulp errors of exp/log (2**-24 each, a few of them per value)
# cannot cross, with a wide margin.
SETTLED = 2.0**-18


def unsettled_rows(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    min_p: torch.Tensor | None,
    seeds: torch.Tensor,
) -> torch.Tensor:
    """`[N]` bool: the sampling rows whose token a one-ulp change of exp/log could change (the
    arguments as `sample_tokens_ref` takes them). Greedy rows are always settled."""
    rows, vocab = logits.shape
    x = logits.float()
    max_logit = x.max(dim=-1, keepdim=True).values
    sampling = (temperature > 0) & (max_logit.squeeze(1) != float("-inf"))
    inv_t = 1.0 / torch.where(sampling, temperature, torch.ones_like(temperature))
    d = (max_logit - x) * inv_t.unsqueeze(1)  # exact arithmetic: the same bits in the kernels
    keep = d != float("inf")
    if top_k is not None:
        k = top_k.long()
        k_on = ((k > 0) & (k < vocab)).unsqueeze(1)
        kth = d.sort(dim=-1).values.gather(1, (k.clamp(1, vocab) - 1).unsqueeze(1))
        keep &= ~k_on | (d <= kth)
    e = torch.exp(-d)
    unsettled = torch.zeros(rows, dtype=torch.bool)
    if top_p is not None:
        p_on = top_p < 1
        ceiling, close = _top_p_ceiling_and_closeness(d, e, keep, top_p)
        unsettled |= p_on & close
        keep &= ~p_on.unsqueeze(1) | (d <= ceiling)
    if min_p is not None:
        m_on = (min_p > 0).unsqueeze(1)
        near = (e - min_p.unsqueeze(1)).abs() <= SETTLED * min_p.unsqueeze(1)
        unsettled |= (m_on & keep & near).any(dim=-1)
        keep &= ~m_on | (e >= min_p.unsqueeze(1))
    if vocab > 1:
        log_noise = torch.log(exponential_noise(seeds, vocab))
        race = torch.where(keep, x * inv_t.unsqueeze(1) - log_noise, float("-inf"))  # race_values
        best, best_ids = race.topk(2, dim=-1)
        gap = best[:, 0] - best[:, 1]
        # log E's error is an ulp of |log E| (up to ~22), the race value's an ulp of itself
        scale = (best.abs() + log_noise.gather(1, best_ids).abs()).sum(dim=-1)
        unsettled |= torch.isfinite(best[:, 1]) & (gap <= SETTLED * scale)
    return unsettled & sampling


def _top_p_ceiling_and_closeness(
    d: torch.Tensor, e: torch.Tensor, keep: torch.Tensor, top_p: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's top-p ceiling (`[N, 1]`) and, per row, whether the mass below it or up to it
    is within the mass sum's possible error of the target (then a one-ulp change of e moves it)."""
    ceiling, mass, target = top_p_cut(d, e, keep, top_p)
    total = mass.sum(dim=-1)
    below = torch.where(keep & (d < ceiling), mass, 0).sum(dim=-1)
    up_to = torch.where(keep & (d <= ceiling), mass, 0).sum(dim=-1)
    # each token's e off by SETTLED at most (its floor by one more unit), the target with the total
    slack = 2 * SETTLED * total.double() + d.shape[1]
    close = ((target - below).double() <= slack) | ((up_to - target).double() < slack)
    return ceiling, close


def assert_same_tokens(
    got: torch.Tensor,
    want: torch.Tensor,
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    min_p: torch.Tensor | None,
    seeds: torch.Tensor,
) -> torch.Tensor:
    """The kernel's tokens `got` equal the reference's `want` on every settled row (most rows must
    be: a settledness check that excused everything would prove nothing). Returns the unsettled rows."""
    unsettled = unsettled_rows(logits, temperature, top_k, top_p, min_p, seeds)
    assert 2 * int(unsettled.sum()) < len(got), f"most rows unsettled: {unsettled.tolist()}"
    settled = ~unsettled
    assert torch.equal(got[settled], want[settled]), (
        f"rows {(got != want).nonzero().flatten().tolist()} differ: {got.tolist()} vs {want.tolist()}"
    )
    return unsettled
