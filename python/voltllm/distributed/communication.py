"""Collectives over the tensor-parallel group; the identity when the group is this process alone.

At size 1 they return their input untouched, so the unsharded model runs no extra copy or launch.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from voltllm.distributed.parallel_state import get_tp_group


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum of `x` over the ranks, in place (every rank gets the sum); returns `x`."""
    tp = get_tp_group()
    if tp.size == 1:
        return x
    dist.all_reduce(x, group=tp.group)
    return x


def tensor_model_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """The ranks' `x` concatenated along `dim` in rank order (every rank gets the whole)."""
    tp = get_tp_group()
    if tp.size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(tp.size)]
    dist.all_gather(parts, x, group=tp.group)
    return torch.cat(parts, dim=dim)
