"""Which kernel runs the pair path's down stage (`voltllm.ops.moe.pair_down_chunks`): by default the staged
kernel up to PAIR_DOWN_STAGED_MAX_TOKENS tokens and the unstaged one past that; the staged kernel only where
its shared memory and 32-bit chunk indices take the shape, the unstaged one everywhere else."""

from __future__ import annotations

import pytest
import torch

from voltllm.ops import moe as moe_ops
from voltllm.ops.moe import (
    PAIR_DOWN_STAGED_CHUNKS,
    PAIR_DOWN_STAGED_MAX_TOKENS,
    pair_down_chunks,
    staged_pair_down_fits,
)


def _w2(experts: int, hidden: int, inter: int) -> torch.Tensor:
    return torch.empty(experts, hidden, inter, dtype=torch.float16, device="meta")


@pytest.mark.parametrize("chunks", PAIR_DOWN_STAGED_CHUNKS)
def test_the_staged_kernel_runs_where_it_fits(chunks):
    qwen3_30b = _w2(128, 2048, 768)  # top-8: 8 * 96 chunks of 20 bytes = 15,360 bytes of shared memory
    assert staged_pair_down_fits(8, qwen3_30b)
    assert pair_down_chunks(1, 8, qwen3_30b, chunks) == chunks
    mixtral = _w2(8, 4096, 14336)  # top-2: 2 * 1,792 chunks of 20 bytes = 71,680 bytes, over 48 KB
    assert not staged_pair_down_fits(2, mixtral)
    assert pair_down_chunks(1, 2, mixtral, chunks) == 0
    assert pair_down_chunks(1, 8, qwen3_30b, 0) == 0


def test_a_stack_of_2_to_the_32_chunks_takes_the_unstaged_kernel():
    huge = _w2(1024, 8192, 4096)  # 2^35 elements: 2^32 chunks of 8
    assert not staged_pair_down_fits(1, huge)
    assert pair_down_chunks(1, 1, huge, PAIR_DOWN_STAGED_CHUNKS[-1]) == 0


def test_the_default_is_staged_up_to_its_token_limit():
    w2 = _w2(128, 2048, 768)
    assert moe_ops.PAIR_DOWN_CHUNKS == 12  # the H100 A/B's winner (issue 17)
    for num_tokens in (1, 8, PAIR_DOWN_STAGED_MAX_TOKENS):
        assert pair_down_chunks(num_tokens, 8, w2) == moe_ops.PAIR_DOWN_CHUNKS
    assert pair_down_chunks(PAIR_DOWN_STAGED_MAX_TOKENS + 1, 8, w2) == 0  # chunks 0 wins at 64 tokens
    assert pair_down_chunks(64, 8, w2, 12) == 12  # asked for: the bench's trend rows


def test_a_switched_off_default_and_a_bad_variant(monkeypatch):
    w2 = _w2(128, 2048, 768)
    monkeypatch.setattr(moe_ops, "PAIR_DOWN_CHUNKS", 0)
    assert pair_down_chunks(1, 8, w2) == 0
    for dropped in (16, 24):  # 24: the other A/B candidate, dropped
        with pytest.raises(ValueError, match="down_chunks must be 0 or one of"):
            pair_down_chunks(1, 8, w2, dropped)
