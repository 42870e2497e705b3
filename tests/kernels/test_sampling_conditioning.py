"""`sampling_conditioning.unsettled_rows` (what the emulated sampling tests excuse from token equality):
every row whose reference token moves when exp, log and log1p are each off by a small relative error is
flagged, at that error's scale; at the real one (an ulp) it flags almost no random row."""

from __future__ import annotations

from unittest import mock

import sampling_conditioning
import torch
from sampling_conditioning import unsettled_rows

from voltllm.ops.sampling import random_seeds, sample_tokens_ref

FILTERS = [(0, 0, 0), (1, 0, 0), (0, 1, 0), (0, 0, 1), (1, 1, 1)]


def _batch(seed: int, scale: float, k: int, p: int, m: int):
    gen = torch.Generator().manual_seed(seed)
    rows, vocab = 64, 300
    logits = torch.randn(rows, vocab, generator=gen) * scale
    logits[3] = 0.5  # a flat row
    temperature = torch.rand(rows, generator=gen) * 1.5 + 0.2
    top_k = torch.randint(1, 40, (rows,), generator=gen, dtype=torch.int32) if k else None
    top_p = torch.rand(rows, generator=gen) * 0.9 + 0.05 if p else None
    min_p = torch.rand(rows, generator=gen) * 0.3 if m else None
    return logits, temperature, top_k, top_p, min_p, random_seeds(rows, torch.device("cpu"), gen)


def _off_by(relative: float, gen: torch.Generator):
    """torch.exp/log/log1p whose float32 results are off by +-`relative` on 30% of the elements."""
    real = {name: getattr(torch, name) for name in ("exp", "log", "log1p")}

    def wrap(name: str):
        def f(x: torch.Tensor) -> torch.Tensor:
            y = real[name](x)
            r = torch.rand(y.shape, generator=gen)
            return torch.where(r < 0.15, y * (1 + relative), torch.where(r < 0.3, y * (1 - relative), y))

        return f

    return [mock.patch.object(torch, name, wrap(name)) for name in real]


def test_every_row_an_error_moves_is_flagged() -> None:
    """At 64x the error (the real margin over an ulp), every moved token is in a flagged row: nearly
    flat rows (where errors move tokens) and the emulated tests' spread ones."""
    relative = 2.0**-10
    flips = 0
    with mock.patch.object(sampling_conditioning, "SETTLED", 64 * relative):
        for seed, scale in ((seed, scale) for seed in range(12) for scale in (0.05, 3.0)):
            for k, p, m in FILTERS:
                args = _batch(seed, scale, k, p, m)
                want = sample_tokens_ref(*args)
                unsettled = unsettled_rows(*args)
                patches = _off_by(relative, torch.Generator().manual_seed(seed))
                with patches[0], patches[1], patches[2]:
                    moved = sample_tokens_ref(*args) != want
                assert not (moved & ~unsettled).any(), (seed, k, p, m, moved.nonzero().flatten().tolist())
                flips += int(moved.sum())
    assert flips > 0  # the errors did move some tokens: the check above was not vacuous


def test_almost_every_random_row_is_settled() -> None:
    flagged = total = 0
    for seed in range(4):
        for k, p, m in FILTERS:
            args = _batch(seed, 3.0, k, p, m)
            flagged += int(unsettled_rows(*args).sum())
            total += args[0].shape[0]
    assert flagged <= total // 100, f"{flagged} of {total} rows unsettled"


def test_a_top_p_or_min_p_threshold_on_a_boundary_is_unsettled() -> None:
    """A top-p target at the first token's share of the mass, and a min-p equal to a token's e, are
    unsettled; the same rows with thresholds well off every boundary are settled."""
    logits = torch.tensor([[0.0, -1.0, -2.0]]).repeat(2, 1)
    temperature, seeds = torch.ones(2), torch.tensor([11, 12])
    e = torch.exp(-torch.tensor([0.0, 1.0, 2.0]))
    share = float(e[0] / e.sum())
    top_p = torch.tensor([share, share + 0.1])
    assert unsettled_rows(logits, temperature, None, top_p, None, seeds).tolist() == [True, False]
    min_p = torch.tensor([float(e[1]), 0.2])
    assert unsettled_rows(logits, temperature, None, None, min_p, seeds).tolist() == [True, False]
