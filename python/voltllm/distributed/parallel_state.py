"""The tensor-parallel group this process belongs to: its rank and size, and the torch.distributed group.

Layers read the rank and size once, when they are built, to decide their shard; the collectives
(`voltllm.distributed.communication`) use the group when they run. By default the group is this process
alone (size 1, rank 0, no torch.distributed needed), where every parallel layer is a plain layer and
every collective is the identity. `init_tensor_parallel` joins a group after
`torch.distributed.init_process_group` (NCCL on GPUs, gloo on CPUs): build the model after it and keep
it until the model is no longer run (one group per process).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist


@dataclass(frozen=True)
class TensorParallelGroup:
    """This process's place in the tensor-parallel group."""

    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None  # None at size 1: nothing to communicate with

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank {self.rank} out of range for size {self.size}")


_SINGLE = TensorParallelGroup()
_tp_group = _SINGLE


def get_tp_group() -> TensorParallelGroup:
    return _tp_group


def get_tensor_model_parallel_rank() -> int:
    return _tp_group.rank


def get_tensor_model_parallel_world_size() -> int:
    return _tp_group.size


def init_tensor_parallel(group: dist.ProcessGroup | None = None) -> TensorParallelGroup:
    """Shard the layers built from now on over `group` (default: the whole torch.distributed world)."""
    global _tp_group
    if not dist.is_initialized():
        raise RuntimeError("init_tensor_parallel needs torch.distributed.init_process_group first")
    group = group if group is not None else dist.group.WORLD
    _tp_group = TensorParallelGroup(dist.get_rank(group), dist.get_world_size(group), group)
    return _tp_group


def destroy_tensor_parallel() -> None:
    """Back to the single-process group (the process group itself is the caller's to destroy)."""
    global _tp_group
    _tp_group = _SINGLE


def divide(numerator: int, denominator: int, what: str = "size") -> int:
    """`numerator / denominator`, which must be exact: a shard of a layer is a whole number of rows."""
    if numerator % denominator:
        raise ValueError(f"{what} {numerator} is not divisible by the tensor-parallel size {denominator}")
    return numerator // denominator
