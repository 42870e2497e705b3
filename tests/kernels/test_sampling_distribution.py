"""`sample_tokens` draws from the right distribution: for temperature, top-k, top-p, min-p and their
combination, on a small fixed vocabulary, the frequencies of many independent draws (one seed each)
match the exact distribution, computed here from its definition in float64, and tokens outside the kept
set are never drawn. Runs the torch reference on the CPU and the CUDA kernels (both methods) where there
is a GPU; a filter that is off is passed as None, as the sampler passes it (race_first draws rows with
temperature and top-p itself, and hands a batch with top-k or min-p to "select").

Each token's frequency is held to Bernstein's inequality at FALSE_FAILURE per token (a bound, not a
normal approximation): at most 6 cases x 9 tokens on the CPU, so a correct sampler fails a CI run with
probability under 6e-8 (1.2e-7 more per method on a GPU). The draws are fresh each run."""

from __future__ import annotations

import math

import pytest
import torch

from voltllm.ops.sampling import SAMPLING_METHODS, random_seeds, sample_tokens

LOGITS = torch.tensor([2.0, 1.5, 1.5, 0.7, 0.1, -0.3, -1.0, -2.5, -4.0, float("-inf")])
DRAWS = 400_000  # twice 5 sigma's 200,000: the sound bound is ~1.3x wider at the same draws
FALSE_FAILURE = 1e-9  # per token compared

# (device, method): the CPU runs the reference whatever the method
DEVICES = [("cpu", "select")] + ([("cuda", m) for m in SAMPLING_METHODS] if torch.cuda.is_available() else [])


def bernstein_tolerance(p: torch.Tensor, draws: int, false_failure: float) -> torch.Tensor:
    """The deviation t with P(|frequency - p| >= t) <= false_failure for `draws` independent draws of
    probability p: Bernstein's bound 2 exp(-n t^2 / (2 (p (1 - p) + t / 3))) solved for t."""
    log_term = math.log(2 / false_failure)
    n_t = log_term / 3 + (log_term**2 / 9 + 2 * log_term * draws * p * (1 - p)).sqrt()
    return n_t / draws


def exact(temperature: float, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """The target distribution by its definition: top-k, then top-p of the renormalised rest, then min-p,
    ties at a threshold kept whole."""
    probs = torch.softmax(LOGITS.double() / temperature, dim=0)
    keep = torch.ones_like(probs, dtype=torch.bool)
    if top_k:
        keep &= probs >= probs.sort(descending=True).values[top_k - 1]
    if top_p < 1:
        kept = torch.where(keep, probs, 0.0)
        kept = kept / kept.sum()
        values = kept.sort(descending=True).values
        cut = values[int((values.cumsum(0) >= top_p - 1e-12).nonzero()[0])]  # smallest value reaching top_p
        keep &= kept >= cut
    if min_p:
        keep &= probs >= min_p * probs.max()
    target = torch.where(keep, probs, 0.0)
    return target / target.sum()


@pytest.mark.parametrize("device,method", DEVICES)
@pytest.mark.parametrize(
    "temperature,top_k,top_p,min_p",
    [(1.0, 0, 1.0, 0.0), (0.6, 0, 1.0, 0.0), (1.3, 3, 1.0, 0.0), (1.0, 0, 0.8, 0.0), (0.9, 0, 1.0, 0.2),
     (1.2, 6, 0.9, 0.05)],
)  # fmt: skip
def test_draws_follow_the_distribution(device, method, temperature, top_k, top_p, min_p):
    rows = DRAWS
    logits = LOGITS.to(device).repeat(rows, 1)
    out = sample_tokens(
        logits,
        torch.full((rows,), temperature, device=device),
        torch.full((rows,), top_k, dtype=torch.int32, device=device) if top_k else None,
        torch.full((rows,), top_p, device=device),
        torch.full((rows,), min_p, device=device) if min_p else None,
        random_seeds(rows, torch.device(device)),
        method,
    )
    freq = torch.bincount(out.cpu(), minlength=len(LOGITS)).double() / rows
    want = exact(temperature, top_k, top_p, min_p)
    assert torch.all(freq[want == 0] == 0), f"drew outside the kept set: {freq} vs {want}"
    tolerance = bernstein_tolerance(want, rows, FALSE_FAILURE)
    assert torch.all((freq - want).abs() <= tolerance), f"frequencies {freq} vs exact {want}"
