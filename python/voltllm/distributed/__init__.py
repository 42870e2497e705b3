"""Tensor parallelism: the process group the parallel layers shard over, and its collectives."""

from voltllm.distributed.communication import (
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)
from voltllm.distributed.parallel_state import (
    TensorParallelGroup,
    destroy_tensor_parallel,
    divide,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    get_tp_group,
    init_tensor_parallel,
)

__all__ = [
    "TensorParallelGroup",
    "destroy_tensor_parallel",
    "divide",
    "get_tensor_model_parallel_rank",
    "get_tensor_model_parallel_world_size",
    "get_tp_group",
    "init_tensor_parallel",
    "tensor_model_parallel_all_gather",
    "tensor_model_parallel_all_reduce",
]
