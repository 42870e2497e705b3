"""The sampling kernel (csrc/sampling/radix_sampling.cuh) on the CPU emulator against its torch reference
(`voltllm.ops.sampling.sample_tokens_ref`): the same token for every row, for each filter alone and
combined, greedy rows, ties, masked (-inf) logits, block sizes and logit dtypes, with fresh random
inputs each run."""

from __future__ import annotations

import ctypes

import pytest
import torch
from emulator import build_emulator, needs_gxx, ptr

from voltllm.ops.sampling import random_seeds, sample_tokens_ref

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
    assert torch.equal(got, want)
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
    assert torch.equal(run_kernel(emu, logits, temperature, top_k, top_p, min_p, seeds, 256), want)
