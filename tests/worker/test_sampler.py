"""Sampler: each knob moves the distribution the way it should; seeded rows ignore their neighbours."""

from __future__ import annotations

import math

import pytest
import torch

from voltllm.ops.sampling import (
    RACE_FIRST_MAX_ROWS_TOP_P,
    RACE_FIRST_MIN_TOP_P,
    random_seeds,
    resolve_sampling_method,
    sample_tokens_ref,
    seed_as_int64,
)
from voltllm.worker.sampler import Sampler, SamplingMetadata, seed_for_step

V = 8


def md(
    n: int, temperature: float = 1.0, seeds: dict[int, int] | None = None, noise: int = 0, **kw
) -> SamplingMetadata:
    """Metadata of `n` rows: fresh noise seeds from generator seed `noise`, `seeds` (row -> seed) set."""
    t = torch.full((n,), temperature)
    row_seeds = random_seeds(n, torch.device("cpu"), torch.Generator().manual_seed(noise))
    for row, seed in (seeds or {}).items():
        row_seeds[row] = seed_as_int64(seed)
    return SamplingMetadata(
        temperature=t, all_greedy=temperature == 0, num_logprobs=[None] * n, seeds=row_seeds, **kw
    )


def frequencies(
    logits_row: torch.Tensor, meta_kw: dict, n: int = 4000, temperature: float = 1.0
) -> torch.Tensor:
    logits = logits_row.unsqueeze(0).expand(n, -1).contiguous()
    out = Sampler()(logits, md(n, temperature, **meta_kw(n) if callable(meta_kw) else meta_kw))
    return torch.bincount(torch.tensor(out.sampled_token_ids), minlength=V).float() / n


BASE = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -1.5])


def test_greedy_is_argmax():
    logits = torch.randn(5, V)
    out = Sampler()(logits, md(5, 0.0))
    assert out.sampled_token_ids == logits.argmax(-1).tolist()


def test_greedy_fast_path_agrees_with_full_path():
    """A plain greedy batch skips the logits copy; asking for logprobs (which takes the full path) must
    not change the tokens, and the fast path must not invent logprobs."""
    logits = torch.randn(7, 50, generator=torch.Generator().manual_seed(3)).half()
    fast = Sampler()(logits, md(7, 0.0))
    full_md = md(7, 0.0)
    full_md.num_logprobs = [0] * 7
    full = Sampler()(logits, full_md)
    assert fast.sampled_token_ids == full.sampled_token_ids == logits.float().argmax(-1).tolist()
    assert fast.logprobs is None
    assert all(
        lp is not None and lp.token_ids[0] == t
        for lp, t in zip(full.logprobs, full.sampled_token_ids, strict=True)
    )


def test_greedy_fast_path_is_not_taken_with_a_logit_bias():
    logits = torch.zeros(2, V)
    logits[:, 0] = 1.0
    meta = md(2, 0.0, logit_bias=[(1, torch.tensor([5]), torch.tensor([3.0]))])
    assert Sampler()(logits, meta).sampled_token_ids == [0, 5]


def test_temperature_sampling_matches_softmax_and_sharpens():
    f1 = frequencies(BASE, {})
    assert torch.allclose(f1, BASE.softmax(-1), atol=0.03)
    f_cold = frequencies(BASE, {}, temperature=0.3)
    assert f_cold[0] > f1[0] + 0.2


def test_top_k_top_p_min_p_truncate():
    f = frequencies(BASE, lambda n: {"top_k": torch.full((n,), 2)})
    assert f[2:].sum() == 0 and f[0] > 0 and f[1] > 0
    p = BASE.softmax(-1)  # ~[0.41, 0.25, 0.15, ...]: top_p 0.6 keeps the first two
    f = frequencies(BASE, lambda n: {"top_p": torch.full((n,), 0.6)})
    assert f[2:].sum() == 0 and f[1] > 0
    f = frequencies(BASE, lambda n: {"min_p": torch.full((n,), 0.3)})
    keep = p >= 0.3 * p.max()
    assert f[~keep].sum() == 0 and (f[keep] > 0).all()


def test_logit_bias_and_banned_tokens():
    f = frequencies(
        BASE, lambda n: {"logit_bias": [(r, torch.tensor([7]), torch.tensor([10.0])) for r in range(n)]}
    )
    assert f[7] > 0.9
    out = Sampler()(BASE.unsqueeze(0), md(1, 0.0, banned_token_ids=[(0, torch.tensor([0]))]))
    assert out.sampled_token_ids == [1]


def penalised(**kw) -> torch.Tensor:
    """Greedy logits after penalties, read back through logprobs of a temperature-0 row."""
    m = md(1, 0.0, **kw)
    m.num_logprobs = [V]
    lp = Sampler()(BASE.unsqueeze(0), m).logprobs[0]
    order = sorted(zip(lp.token_ids[1:], lp.logprobs[1:], strict=True))
    return torch.tensor([x for _, x in order])


def test_penalties():
    prompt = torch.tensor([[1, V]])  # token 1 in the prompt (V pads)
    output = torch.tensor([[0, 0, 6]])  # token 0 twice and token 6 once in the output
    one, zero = torch.ones(1), torch.zeros(1)
    common = {"prompt_token_ids": prompt, "output_token_ids": output}
    base = penalised(**common, presence_penalty=zero, frequency_penalty=zero, repetition_penalty=one)
    assert torch.allclose(base, BASE.log_softmax(-1), atol=1e-5)
    raw = lambda lp: lp - lp[4]  # logits up to a constant: token 4 is untouched by every penalty  # noqa: E731
    freq = raw(
        penalised(**common, presence_penalty=zero, frequency_penalty=one * 0.5, repetition_penalty=one)
    )
    assert (
        freq[0] == pytest.approx(2.0 - 1.0)
        and freq[6] == pytest.approx(-1.5)
        and freq[1] == pytest.approx(1.5)
    )
    pres = raw(
        penalised(**common, presence_penalty=one * 0.5, frequency_penalty=zero, repetition_penalty=one)
    )
    assert pres[0] == pytest.approx(1.5) and pres[6] == pytest.approx(-1.5) and pres[1] == pytest.approx(1.5)
    rep = raw(penalised(**common, presence_penalty=zero, frequency_penalty=zero, repetition_penalty=one * 2))
    # prompt and output tokens: positive logits halved, negative doubled; others untouched
    assert rep[0] == pytest.approx(1.0) and rep[1] == pytest.approx(0.75) and rep[6] == pytest.approx(-2.0)
    assert rep[2] == pytest.approx(1.0)


def test_logprobs_rank_and_order():
    m = md(1, 1.0, seeds={0: 5})
    m.num_logprobs = [3]
    out = Sampler()(BASE.unsqueeze(0), m)
    lp = out.logprobs[0]
    ref = BASE.log_softmax(-1)
    assert lp.token_ids[0] == out.sampled_token_ids[0]
    assert lp.token_ids[1:] == [0, 1, 2]
    assert lp.logprobs[0] == pytest.approx(ref[lp.token_ids[0]].item(), abs=1e-6)
    assert lp.rank == int((ref > ref[lp.token_ids[0]]).sum()) + 1
    assert all(math.isfinite(x) for x in lp.logprobs)


def test_seeded_rows_do_not_depend_on_batch():
    logits = torch.randn(6, 50)

    def run(rows: list[int], seeded_row_in_batch: int) -> int:
        batch = logits[rows]
        seeds = {seeded_row_in_batch: seed_for_step(42, 3)}
        out = Sampler()(batch, md(len(rows), 1.0, seeds=seeds, noise=len(rows)))
        return out.sampled_token_ids[seeded_row_in_batch]

    results = {run([2], 0), run([0, 1, 2, 3], 2), run([5, 2], 1), run([2, 4, 0, 1, 3, 5], 0)}
    assert len(results) == 1
    draws = set()
    for step in range(20):
        draws.add(Sampler()(logits[2:3], md(1, 1.0, seeds={0: seed_for_step(42, step)})).sampled_token_ids[0])
    assert len(draws) > 1  # different steps draw differently


def test_the_draw_uses_the_rows_seeds_and_needs_them():
    """The noise is the metadata's seeds (the runner stages them with the step): the same seeds give the
    reference's tokens; sampling rows without seeds are refused rather than drawn from anything else."""
    logits = torch.randn(5, 50)
    meta = md(5, 0.9, top_p=torch.full((5,), 0.8))
    meta.seeds = torch.arange(5, dtype=torch.int64) * 1_000_003
    expected = sample_tokens_ref(logits, meta.temperature, None, meta.top_p, None, meta.seeds)
    assert Sampler()(logits, meta).sampled_token_ids == expected.tolist()
    meta.seeds = None
    with pytest.raises(ValueError, match="noise seeds"):
        Sampler()(logits, meta)


def test_methods_draw_the_same_tokens_and_an_unknown_method_is_refused():
    """Sampler(method=...) picks the draw's kernels; every method gives the same tokens (on the CPU both
    run the reference), greedy, sampled and filtered; a name that is not a method is a ValueError."""
    logits = torch.randn(6, V, generator=torch.Generator().manual_seed(5))
    for temperature, kw in [(0.0, {}), (0.8, {}), (0.8, {"top_p": torch.full((6,), 0.7)})]:
        meta = md(6, temperature, noise=9, **kw)
        tokens = {m: Sampler(m)(logits, meta).sampled_token_ids for m in ("select", "race_first", "auto")}
        assert tokens["select"] == tokens["race_first"] == tokens["auto"]
        assert Sampler("race_first").sample_on_device(logits, meta).tolist() == tokens["select"]
    with pytest.raises(ValueError, match="sampling method"):
        Sampler("sort")


def test_auto_races_first_where_the_gpu_measured_it_faster():
    """The default, "auto", names race_first for every greedy batch, for one row, and for top-p batches
    of at most RACE_FIRST_MAX_ROWS_TOP_P rows whose top-p are all at least RACE_FIRST_MIN_TOP_P; select
    for temperature alone past one row, low top-p past one row and large top-p batches. A kernel named
    outright is kept."""
    assert Sampler().method == "auto"
    resolve = resolve_sampling_method
    assert resolve("auto", 4096, greedy=True) == "race_first"
    assert resolve("auto", 1, greedy=False) == "race_first"
    assert resolve("auto", 1, greedy=False, min_top_p=0.5) == "race_first"
    assert resolve("auto", 4, greedy=False) == "select"  # temperature alone
    assert resolve("auto", RACE_FIRST_MAX_ROWS_TOP_P, greedy=False, min_top_p=0.95) == "race_first"
    assert resolve("auto", RACE_FIRST_MAX_ROWS_TOP_P + 1, greedy=False, min_top_p=0.95) == "select"
    assert resolve("auto", 8, greedy=False, min_top_p=RACE_FIRST_MIN_TOP_P) == "race_first"
    assert resolve("auto", 8, greedy=False, min_top_p=0.5) == "select"
    assert resolve("select", 1, greedy=True) == "select"
    with pytest.raises(ValueError, match="sampling method"):
        resolve("fastest", 1, greedy=False)
