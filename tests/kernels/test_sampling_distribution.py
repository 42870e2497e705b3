"""`sample_tokens` draws from the right distribution: for temperature, top-k, top-p, min-p and their
combination, on a small fixed vocabulary, the frequencies of many independent draws (one seed each)
match the exact distribution, computed here from its definition in float64, and tokens outside the kept
set are never drawn. Runs the torch reference on the CPU and the CUDA kernel where there is a GPU."""

from __future__ import annotations

import pytest
import torch

from voltllm.ops.sampling import random_seeds, sample_tokens

LOGITS = torch.tensor([2.0, 1.5, 1.5, 0.7, 0.1, -0.3, -1.0, -2.5, -4.0, float("-inf")])
DRAWS = 200_000

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


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


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "temperature,top_k,top_p,min_p",
    [(1.0, 0, 1.0, 0.0), (0.6, 0, 1.0, 0.0), (1.3, 3, 1.0, 0.0), (1.0, 0, 0.8, 0.0), (0.9, 0, 1.0, 0.2),
     (1.2, 6, 0.9, 0.05)],
)  # fmt: skip
def test_draws_follow_the_distribution(device, temperature, top_k, top_p, min_p):
    rows = DRAWS
    logits = LOGITS.to(device).repeat(rows, 1)
    out = sample_tokens(
        logits,
        torch.full((rows,), temperature, device=device),
        torch.full((rows,), top_k, dtype=torch.int32, device=device),
        torch.full((rows,), top_p, device=device),
        torch.full((rows,), min_p, device=device),
        random_seeds(rows, torch.device(device)),
    )
    freq = torch.bincount(out.cpu(), minlength=len(LOGITS)).double() / rows
    want = exact(temperature, top_k, top_p, min_p)
    assert torch.all(freq[want == 0] == 0), f"drew outside the kept set: {freq} vs {want}"
    tolerance = 5 * (want * (1 - want) / rows).sqrt() + 1e-9  # 5 sigma per token
    assert torch.all((freq - want).abs() <= tolerance), f"frequencies {freq} vs exact {want}"
