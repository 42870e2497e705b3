"""RotaryEmbedding computes cos/sin once per positions tensor (once per step, not per layer)."""

from __future__ import annotations

import torch

from voltllm.layers.rotary import RotaryEmbedding, apply_rotary


def _rope() -> RotaryEmbedding:
    return RotaryEmbedding(16, {"rope_type": "default", "rope_theta": 10000.0}, 128)


def test_each_positions_tensor_gets_its_own_angles() -> None:
    rope = _rope()
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(5, 4, 16, generator=gen)
    k = torch.randn(5, 2, 16, generator=gen)
    for positions in (torch.arange(5), torch.arange(5), torch.tensor([9, 3, 40, 0, 7]), torch.arange(20, 25)):
        for _layer in range(3):  # the same positions object, as every layer of a step passes it
            rq, rk = rope(positions, q, k)
            torch.testing.assert_close(rq, apply_rotary(positions, q, rope.inv_freq))
            torch.testing.assert_close(rk, apply_rotary(positions, k, rope.inv_freq))


def test_angles_are_recomputed_after_a_dtype_or_device_move() -> None:
    rope = _rope()
    positions = torch.arange(3, 6)
    q = torch.randn(3, 1, 16)
    rope(positions, q, q)
    rope.to(torch.float64)  # inv_freq stays fp32, the cached angles are dropped
    assert rope._step_cos_sin is None
    rq, _ = rope(positions, q.double(), q.double())
    assert rq.dtype == torch.float64
    torch.testing.assert_close(rq, apply_rotary(positions, q.double(), rope.inv_freq))
