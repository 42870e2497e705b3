"""Inputs shared by the structured-output mask tests (CPU reference, emulator, CUDA): random logits
and bitmasks with the edge cases the kernel must get right, and a per-token oracle."""

from __future__ import annotations

import torch


def random_bitmask(num_masks: int, vocab: int, gen: torch.Generator, extra_words: int = 0) -> torch.Tensor:
    """[num_masks, ceil(vocab/32) + extra_words] int32: random bits, plus an all-allowed mask, one that
    allows only the last token, and set bits past `vocab` (which must be ignored)."""
    words = (vocab + 31) // 32 + extra_words
    bits = torch.randint(-(2**31), 2**31, (num_masks, words), generator=gen, dtype=torch.int64)
    bits = bits.to(torch.int32)
    if num_masks > 1:
        bits[1] = -1  # everything allowed
    if num_masks > 2:
        bits[2] = 0
        bit = 1 << ((vocab - 1) % 32)
        bits[2, (vocab - 1) // 32] = bit - (1 << 32) if bit >= 1 << 31 else bit  # only the last token
    return bits


def expected_logits(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int] | None) -> torch.Tensor:
    """Token by token: -inf where the mask's bit is 0 (the oracle, independent of any unpacking)."""
    out = logits.clone()
    vocab = logits.shape[1]
    for m in range(bitmask.shape[0]):
        row = m if rows is None else rows[m]
        for t in range(vocab):
            if not (int(bitmask[m, t // 32]) >> (t % 32)) & 1:
                out[row, t] = float("-inf")
    return out
