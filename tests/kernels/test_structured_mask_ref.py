"""The structured-output mask's torch reference (`voltllm.ops.structured`) against a token-by-token
oracle, and the wrapper's refusals; CPU only."""

from __future__ import annotations

import pytest
import torch
from structured_cases import expected_logits, random_bitmask

from voltllm.ops.structured import apply_token_bitmask


@pytest.mark.parametrize("rows", [None, [4, 0, 2]], ids=["leading-rows", "row-subset"])
@pytest.mark.parametrize("vocab", [32, 77, 300])
def test_reference_masks_exactly_the_disallowed_tokens(rows, vocab) -> None:
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(5, vocab, generator=gen)
    bitmask = random_bitmask(3, vocab, gen, extra_words=1)
    expected = expected_logits(logits, bitmask, rows)
    index = None if rows is None else torch.tensor(rows, dtype=torch.int32)
    apply_token_bitmask(logits, bitmask, index)
    assert torch.equal(logits, expected)


def test_refuses_a_mask_too_short_or_not_int32() -> None:
    logits = torch.zeros(2, 100)
    with pytest.raises(ValueError, match="cannot cover 100 tokens"):
        apply_token_bitmask(logits, torch.zeros(2, 3, dtype=torch.int32))
    with pytest.raises(ValueError, match="int32"):
        apply_token_bitmask(logits, torch.zeros(2, 4, dtype=torch.int64))
