"""Which kernels the pair path runs: the down stage (`voltllm.ops.moe.pair_down_chunks`), the staged kernel
only where its shared memory and 32-bit chunk indices take the shape, the unstaged one everywhere else; and
whether a sparse block routes inside the pair stages (`fused_moe_pairs_routed_applies`)."""

from __future__ import annotations

import pytest
import torch

from voltllm.ops import moe as moe_ops
from voltllm.ops.moe import (
    PAIR_DOWN_STAGED_CHUNKS,
    PAIRS_MAX_TOKENS,
    fused_moe_pairs_routed_applies,
    pair_down_chunks,
    staged_pair_down_fits,
)


def _w2(experts: int, hidden: int, inter: int) -> torch.Tensor:
    return torch.empty(experts, hidden, inter, dtype=torch.float16, device="meta")


@pytest.mark.parametrize("chunks", PAIR_DOWN_STAGED_CHUNKS)
def test_the_staged_kernel_runs_where_it_fits(chunks):
    qwen3_30b = _w2(128, 2048, 768)  # top-8: 8 * (96 chunks of 20 bytes + 8) = 15,424 bytes of shared memory
    assert staged_pair_down_fits(8, qwen3_30b)
    assert pair_down_chunks(8, qwen3_30b, chunks) == chunks
    mixtral = _w2(8, 4096, 14336)  # top-2: 2 * (1,792 chunks of 20 bytes + 8) = 71,696 bytes, over 48 KB
    assert not staged_pair_down_fits(2, mixtral)
    assert pair_down_chunks(2, mixtral, chunks) == 0
    assert pair_down_chunks(8, qwen3_30b, 0) == 0


def test_a_stack_of_2_to_the_32_chunks_takes_the_unstaged_kernel():
    huge = _w2(1024, 8192, 4096)  # 2^35 elements: 2^32 chunks of 8
    assert not staged_pair_down_fits(1, huge)
    assert pair_down_chunks(1, huge, PAIR_DOWN_STAGED_CHUNKS[-1]) == 0


def test_the_default_and_a_bad_variant(monkeypatch):
    w2 = _w2(128, 2048, 768)
    for default in (0, *PAIR_DOWN_STAGED_CHUNKS):
        monkeypatch.setattr(moe_ops, "PAIR_DOWN_CHUNKS", default)
        assert pair_down_chunks(8, w2) == default
    with pytest.raises(ValueError, match="down_chunks must be 0 or one of"):
        pair_down_chunks(8, w2, 16)


def test_the_pair_path_routes_itself_only_where_switched_on_and_staged(monkeypatch):
    w2 = _w2(128, 2048, 768)
    x = torch.empty(1, 2048, dtype=torch.float16, device="meta")
    logits = torch.empty(1, 128, dtype=torch.float16, device="meta")
    monkeypatch.setattr(moe_ops, "PAIR_DOWN_CHUNKS", 24)
    assert not fused_moe_pairs_routed_applies(x, logits, w2, 8)  # PAIR_ROUTED off: the default
    monkeypatch.setattr(moe_ops, "PAIR_ROUTED", True)
    assert fused_moe_pairs_routed_applies(x, logits, w2, 8)
    assert not fused_moe_pairs_routed_applies(x, logits.float(), w2, 8)  # logits of another dtype
    two = torch.empty(2, 2048, dtype=torch.float16, device="meta")
    columns = torch.empty(128, 2, dtype=torch.float16, device="meta").t()  # [2, 128], rows not contiguous
    assert not fused_moe_pairs_routed_applies(two, columns, w2, 8)
    assert fused_moe_pairs_routed_applies(two, columns.contiguous(), w2, 8)
    many = torch.empty(PAIRS_MAX_TOKENS + 1, 2048, dtype=torch.float16, device="meta")
    assert not fused_moe_pairs_routed_applies(many, logits.expand(PAIRS_MAX_TOKENS + 1, 128), w2, 8)
    wide = _w2(256, 2048, 768)  # more experts than the routed kernels route among
    assert not fused_moe_pairs_routed_applies(
        x, torch.empty(1, 256, dtype=torch.float16, device="meta"), wide, 8
    )
    monkeypatch.setattr(moe_ops, "PAIR_DOWN_CHUNKS", 0)  # no staged down stage: the routing kernel runs
    assert not fused_moe_pairs_routed_applies(x, logits, w2, 8)
