"""The structured-output mask kernel on a GPU against its torch reference (`apply_token_bitmask_ref`)
and a token-by-token oracle, through the op the runner calls (`voltllm.ops.structured`)."""

from __future__ import annotations

import pytest
import torch
from structured_cases import expected_logits, random_bitmask

from voltllm.ops.structured import apply_token_bitmask, apply_token_bitmask_ref

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows", [None, [3, 0, 5]], ids=["leading-rows", "row-subset"])
def test_kernel_equals_reference_and_oracle(dtype, rows) -> None:
    gen = torch.Generator().manual_seed(0)
    vocab = 1000
    padded = torch.randn(6, vocab + 24, generator=gen).to(dtype)
    bitmask = random_bitmask(3, vocab, gen, extra_words=1)
    expected = expected_logits(padded[:, :vocab].clone(), bitmask, rows)
    reference = padded.clone()
    index = None if rows is None else torch.tensor(rows, dtype=torch.int32)
    apply_token_bitmask_ref(reference[:, :vocab], bitmask, index)
    logits = padded.cuda()
    apply_token_bitmask(logits[:, :vocab], bitmask.cuda(), None if index is None else index.cuda())
    assert torch.equal(logits.cpu(), reference)
    assert torch.equal(logits[:, :vocab].cpu(), expected)


def test_qwen3_width_batch_of_64_equals_reference() -> None:
    gen = torch.Generator().manual_seed(1)
    vocab = 151936
    logits = torch.randn(64, vocab, generator=gen).half().cuda()
    bitmask = random_bitmask(64, vocab, gen).cuda()
    reference = logits.clone()
    apply_token_bitmask_ref(reference, bitmask)
    apply_token_bitmask(logits, bitmask)
    assert torch.equal(logits, reference)


def test_bad_inputs_are_refused_by_the_glue() -> None:
    logits = torch.zeros(2, 64, device="cuda")
    with pytest.raises(RuntimeError, match="rows must be a contiguous int32"):
        apply_token_bitmask(
            logits,
            torch.zeros(2, 2, dtype=torch.int32, device="cuda"),
            torch.zeros(3, dtype=torch.int32, device="cuda"),
        )
    with pytest.raises(RuntimeError, match="different devices|CUDA tensor"):
        apply_token_bitmask(logits, torch.zeros(2, 2, dtype=torch.int32))
