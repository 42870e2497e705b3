"""The sampling kernels (csrc/sampling/radix_sampling.cuh, race_first_sampling.cuh) on the CPU emulator
against their torch reference (`voltllm.ops.sampling.sample_tokens_ref`): the same token for every row,
for each filter alone and combined, greedy rows, ties, masked (-inf) logits, block and split sizes and
logit dtypes, with fresh random inputs each run; race_first's candidate check and its fallback each
taken where they must be, and its draws against the exact distribution."""

from __future__ import annotations

import ctypes

import pytest
import torch
from emulator import build_emulator, needs_gxx, ptr
from sampling_conditioning import assert_same_tokens
from test_sampling_distribution import FALSE_FAILURE, LOGITS, bernstein_tolerance, exact

from voltllm.ops.sampling import race_values, random_seeds, sample_tokens_ref

pytestmark = needs_gxx

DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


@pytest.fixture(scope="module")
def emu(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    return build_emulator(tmp_path_factory.mktemp("emu"), "sampling_harness.cpp")


def run_kernel(emu, logits, temperature, top_k, top_p, min_p, seeds, threads: int) -> torch.Tensor:
    """The kernels' token per row; a filter given as None is off for every row (nothing launched for it)."""
    out = torch.full((logits.shape[0],), -1, dtype=torch.int64)
    emu.emu_radix_sampling(
        DTYPE_CODES[logits.dtype], ptr(out), ptr(logits), ctypes.c_longlong(logits.stride(0)),
        ptr(temperature), ptr(top_k), ptr(top_p), ptr(min_p), ptr(seeds),
        logits.shape[0], logits.shape[1], threads, int(torch.randint(0, 2**31, ()).item()),
    )  # fmt: skip
    return out


def settings(rows: int, gen: torch.Generator, *, k: bool, p: bool, m: bool):
    temperature = torch.rand(rows, generator=gen) * 1.5 + 0.2
    temperature[0] = 0.0  # a greedy row in every batch
    top_k = torch.randint(1, 40, (rows,), generator=gen, dtype=torch.int32)
    top_k = top_k if k else torch.zeros(rows, dtype=torch.int32)
    top_p = torch.rand(rows, generator=gen) * 0.9 + 0.05 if p else torch.ones(rows)
    min_p = torch.rand(rows, generator=gen) * 0.3 if m else torch.zeros(rows)
    return temperature, top_k, top_p, min_p


# (top-k, top-p, min-p) on or off
FILTERS = [(0, 0, 0), (1, 0, 0), (0, 1, 0), (0, 0, 1), (1, 1, 1)]


@pytest.mark.parametrize("k,p,m", FILTERS)
@pytest.mark.parametrize("dtype,threads", [(torch.float32, 64), (torch.float16, 128), (torch.bfloat16, 32)])
def test_kernel_draws_the_reference_token(emu, k, p, m, dtype, threads):
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ()).item()))
    rows, vocab = 12, 300
    logits = (torch.randn(rows, vocab, generator=gen) * 3).to(dtype)
    logits[1, 7] = logits[1, 250] = logits[1].max() + 1  # a tie for the best token
    logits[2, ::3] = float("-inf")  # masked tokens (logit bias, structured output)
    logits[3] = 0.5  # a flat row: every token ties
    temperature, top_k, top_p, min_p = settings(rows, gen, k=k, p=p, m=m)
    seeds = random_seeds(rows, torch.device("cpu"), gen)
    want = sample_tokens_ref(logits, temperature, top_k, top_p, min_p, seeds)
    # the filters that are off: as off values on every row (threads 64), or as None (the others)
    lean = [f if on or threads == 64 else None for f, on in ((top_k, k), (top_p, p), (min_p, m))]
    got = run_kernel(emu, logits, temperature, *lean, seeds, threads)
    assert_same_tokens(got, want, logits, temperature, top_k, top_p, min_p, seeds)
    assert got[0] == logits[0].float().argmax()  # greedy: the first argmax
    assert logits[2, got[2]] != float("-inf")


def test_kernel_keeps_exactly_the_top_k_and_top_p_sets(emu):
    """Many draws of one row (different seeds) land only in the filtered set, and cover it."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ()).item()))
    rows, vocab = 256, 64
    logits = torch.randn(vocab, generator=gen).repeat(rows, 1)
    temperature = torch.ones(rows)
    top_k = torch.full((rows,), 5, dtype=torch.int32)
    top_p, min_p = torch.ones(rows), torch.zeros(rows)
    seeds = random_seeds(rows, torch.device("cpu"), gen)
    got = run_kernel(emu, logits, temperature, top_k, top_p, min_p, seeds, 64)
    assert set(got.tolist()) == set(logits[0].topk(5).indices.tolist())


def test_kernel_paths_of_a_large_vocabulary(emu):
    """A vocabulary over several race splits (temperature-only rows), and top-p over a nearly flat row
    whose candidates do not fit in shared memory (the row-wide select)."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ()).item()))
    rows, vocab = 6, 9000
    logits = torch.randn(rows, vocab, generator=gen) * 3
    logits[3:] *= 0.001  # flat: every token is a top-p candidate
    temperature = torch.full((rows,), 0.8)
    top_k = torch.tensor([0, 0, 50, 0, 0, 20], dtype=torch.int32)
    top_p = torch.tensor([1.0, 0.9, 1.0, 0.7, 0.95, 0.5])
    min_p = torch.zeros(rows)
    seeds = random_seeds(rows, torch.device("cpu"), gen)
    want = sample_tokens_ref(logits, temperature, top_k, top_p, min_p, seeds)
    got = run_kernel(emu, logits, temperature, top_k, top_p, min_p, seeds, 256)
    assert_same_tokens(got, want, logits, temperature, top_k, top_p, min_p, seeds)


# ----- race_first_sampling.cuh: the race's best candidates checked against top-p, then the row's select


def run_race_first(emu, logits, temperature, top_p, seeds, threads: int, min_split_tokens: int):
    """race_first's token per row, and how many rows its last kernel (the row-wide select) finished;
    temperature None: every row greedy; top_p None: off for every row."""
    out = torch.full((logits.shape[0],), -1, dtype=torch.int64)
    finished = emu.emu_race_first_sampling(
        DTYPE_CODES[logits.dtype], ptr(out), ptr(logits), ctypes.c_longlong(logits.stride(0)),
        ptr(temperature), ptr(top_p), ptr(seeds), logits.shape[0], logits.shape[1], threads,
        min_split_tokens, int(torch.randint(0, 2**31, ()).item()),
    )  # fmt: skip
    assert finished >= 0, "a launch left a row's ticket nonzero"
    return out, finished


def race_rank_of(logits, temperature, top_p, seeds) -> torch.Tensor:
    """Per row, where the reference's token stands in the race order of the whole row (best race value
    first, ties by token): 0 when the race's winner is in the top-p set, >= 4 when race_first's four
    candidates are all out of it and the row-wide select must draw."""
    want = sample_tokens_ref(logits, temperature, None, top_p, None, seeds)
    g = race_values(logits.float(), 1.0 / temperature, seeds)
    order = torch.argsort(-g, dim=-1, stable=True)
    return (order == want.unsqueeze(1)).int().argmax(dim=-1)


@pytest.mark.parametrize("p", [False, True])
@pytest.mark.parametrize(
    "dtype,threads,min_split", [(torch.float32, 64, 32), (torch.float16, 128, 1024), (torch.bfloat16, 32, 50)]
)
def test_race_first_draws_the_reference_and_the_select_token(emu, p, dtype, threads, min_split):
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ()).item()))
    rows, vocab = 12, 300
    logits = (torch.randn(rows, vocab, generator=gen) * 3).to(dtype)
    logits[1, 7] = logits[1, 250] = logits[1].max() + 1  # a tie for the best token
    logits[2, ::3] = float("-inf")  # masked tokens (logit bias, structured output)
    logits[3] = 0.5  # a flat row: every token ties
    logits[4] = float("-inf")  # nothing left to draw: the first token
    temperature, _, top_p, _ = settings(rows, gen, k=False, p=p, m=False)
    seeds = random_seeds(rows, torch.device("cpu"), gen)
    want = sample_tokens_ref(logits, temperature, None, top_p, None, seeds)
    got, _ = run_race_first(emu, logits, temperature, top_p if p else None, seeds, threads, min_split)
    unsettled = assert_same_tokens(got, want, logits, temperature, None, top_p, None, seeds)
    # the select kernel draws the same tokens, so a row's draw does not depend on which kernel its batch took
    selected = run_kernel(emu, logits, temperature, None, top_p if p else None, None, seeds, threads)
    assert_same_tokens(selected, want, logits, temperature, None, top_p, None, seeds)
    alone, _ = run_race_first(
        emu, logits[5:6], temperature[5:6], top_p[5:6] if p else None, seeds[5:6], threads, 16
    )
    # a row alone (other split sizes) draws what it drew in the batch
    assert alone.item() == want[5].item() or unsettled[5]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_race_first_greedy_batch_takes_the_first_argmax(emu, dtype):
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ()).item()))
    rows, vocab = 5, 2000
    logits = torch.randn(rows, vocab, generator=gen).to(dtype)
    logits[1, 100] = logits[1, 1900] = 50.0  # a tie across splits: the lower index
    logits[2] = float("-inf")
    got, finished = run_race_first(emu, logits, None, None, None, 64, 128)
    assert torch.equal(got, logits.float().argmax(dim=-1)) and finished == 0


def test_race_first_checks_each_candidate_and_falls_back_to_the_select(emu):
    """Rows whose token is the race's 1st, 2nd, 3rd, 4th best (settled by the candidate check) and rows
    where it is further down (finished by the row-wide select): all draw the reference's token, and
    exactly the latter take the last kernel."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ()).item()))
    vocab, pool = 200, 600
    logits = (torch.randn(vocab, generator=gen) * 0.5).repeat(pool, 1)
    temperature, top_p = torch.ones(pool), torch.full((pool,), 0.3)
    seeds = random_seeds(pool, torch.device("cpu"), gen)
    rank = race_rank_of(logits, temperature, top_p, seeds)
    picked = torch.cat([(rank == k).nonzero()[:2, 0] for k in range(4)] + [(rank >= 4).nonzero()[:3, 0]])
    assert len(picked) == 11, f"the pool lacks a rank: {torch.bincount(rank.clamp(max=4))}"
    rows = picked[torch.randperm(len(picked), generator=gen)]
    want = sample_tokens_ref(logits[rows], temperature[rows], None, top_p[rows], None, seeds[rows])
    got, finished = run_race_first(emu, logits[rows], temperature[rows], top_p[rows], seeds[rows], 64, 64)
    unsettled = assert_same_tokens(
        got, want, logits[rows], temperature[rows], None, top_p[rows], None, seeds[rows]
    )
    assert finished == int((rank[rows] >= 4).sum()) == 3 or bool(unsettled.any())


def test_race_first_draws_follow_the_distribution(emu):
    """Many rows of one small vocabulary, one seed each: the frequencies match the exact top-p
    distribution (Bernstein's bound at FALSE_FAILURE per token) and nothing outside the set is drawn.
    (Few draws: the emulator is slow; tests/kernels/test_sampling_distribution.py draws 400,000 on a
    GPU.)"""
    rows, temperature, top_p = 1500, 1.2, 0.6
    logits = LOGITS.repeat(rows, 1)
    seeds = random_seeds(rows, torch.device("cpu"))
    got, _ = run_race_first(
        emu, logits, torch.full((rows,), temperature), torch.full((rows,), top_p), seeds, 32, 1024
    )
    freq = torch.bincount(got, minlength=len(LOGITS)).double() / rows
    want = exact(temperature, 0, top_p, 0.0)
    assert torch.all(freq[want == 0] == 0), f"drew outside the kept set: {freq} vs {want}"
    tolerance = bernstein_tolerance(want, rows, FALSE_FAILURE)
    assert torch.all((freq - want).abs() <= tolerance), f"frequencies {freq} vs exact {want}"
