"""The structured-output mask kernel (csrc/structured/apply_token_bitmask.cuh) on the CPU emulator
against a token-by-token oracle: every logit dtype, leading rows or a subset of rows, a vocabulary that
is not a multiple of 32 or of the block, padded logits rows (stride > vocab), out-of-range rows
skipped, and bits past the vocabulary ignored."""

from __future__ import annotations

import ctypes

import pytest
import torch
from emulator import build_emulator, needs_gxx, ptr
from structured_cases import expected_logits, random_bitmask

pytestmark = needs_gxx

DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


@pytest.fixture(scope="module")
def emu(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    return build_emulator(tmp_path_factory.mktemp("emu"), "structured_harness.cpp")


def run_kernel(emu, logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None) -> None:
    emu.emu_apply_token_bitmask(
        DTYPE_CODES[logits.dtype], ptr(logits), ctypes.c_longlong(logits.stride(0)), logits.shape[0],
        ptr(bitmask), ptr(rows), bitmask.shape[0], bitmask.shape[1], logits.shape[1], 7,
    )  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows", [None, [3, 0, 5]], ids=["leading-rows", "row-subset"])
@pytest.mark.parametrize("vocab", [31, 300, 513, 8292])  # 8292: three blocks, each warp three rounds
def test_kernel_masks_exactly_the_disallowed_tokens(emu, dtype, rows, vocab) -> None:
    gen = torch.Generator().manual_seed(vocab + len(rows or []))
    padded = torch.randn(6, vocab + 5, generator=gen).to(dtype)  # rows 5 elements longer than vocab
    logits = padded[:, :vocab]
    bitmask = random_bitmask(3, vocab, gen, extra_words=1)
    expected = expected_logits(padded, bitmask, rows)[:, :vocab]
    tail = padded[:, vocab:].clone()
    index = None if rows is None else torch.tensor(rows, dtype=torch.int32)
    run_kernel(emu, logits, bitmask, index)
    assert torch.equal(logits, expected)
    assert torch.equal(padded[:, vocab:], tail)  # nothing written past the vocabulary


def test_a_row_outside_the_logits_is_skipped(emu) -> None:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 64, generator=gen)
    original = logits.clone()
    bitmask = torch.zeros(2, 2, dtype=torch.int32)  # everything disallowed
    run_kernel(emu, logits, bitmask, torch.tensor([1, 2], dtype=torch.int32))
    assert torch.equal(logits[0], original[0]) and torch.isinf(logits[1]).all()
