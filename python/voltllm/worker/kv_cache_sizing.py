"""How many KV-cache blocks the runner allocates, and the memory profiling that decides it on CUDA.

A block holds `block_size` tokens of every layer's K and V (`kv_cache_bytes_per_block`). The count is,
in order of precedence: `CacheConfig.num_kv_blocks`; `kv_cache_memory_bytes` / bytes per block; on
CUDA, what `gpu_memory_utilization` of the device leaves after everything resident (weights, other
processes), the largest step's transient peak and the CUDA graphs' reserve (`profile_cuda_kv_budget`);
on the CPU, `DEFAULT_CPU_KV_CACHE_BYTES`. A count derived from memory is capped at `MAX_BATCHES_OF_KV`
full batches of full-length sequences.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from voltllm.config import CacheConfig
from voltllm.layers.attention.backend import AttentionMetadata

logger = logging.getLogger(__name__)

DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30
MAX_BATCHES_OF_KV = 4  # cap, in full batches of max_model_len sequences, on a memory-derived cache


def kv_cache_bytes_per_block(model: Any, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one block across all layers (the model's `kv_cache_shape_per_layer` for one block)."""
    shape = model.kv_cache_shape_per_layer(1, block_size)
    elem = torch.empty((), dtype=dtype).element_size()
    return int(np.prod(shape)) * elem * model.num_layers


def determine_num_blocks(
    cache: CacheConfig,
    *,
    bytes_per_block: int,
    block_size: int,
    max_model_len: int,
    max_num_seqs: int,
    cuda_budget: Callable[[float], int] | None,
) -> int:
    """KV blocks to allocate: an explicit count, explicit bytes, or what memory allows.

    `cuda_budget(gpu_memory_utilization)` gives the bytes free for the KV cache on CUDA (None on the
    CPU, where the default budget applies)."""
    if cache.num_kv_blocks is not None:
        return cache.num_kv_blocks
    if cache.kv_cache_memory_bytes is not None:
        budget = cache.kv_cache_memory_bytes
    elif cuda_budget is not None:
        budget = cuda_budget(cache.gpu_memory_utilization)
    else:
        budget = DEFAULT_CPU_KV_CACHE_BYTES
    num_blocks = budget // bytes_per_block
    if num_blocks < 1:
        raise RuntimeError(
            f"no memory left for the KV cache ({budget / 2**30:.2f} GiB available); "
            "lower max_num_batched_tokens or raise gpu_memory_utilization"
        )
    # A small model on a large GPU would get millions of blocks, each a Python object in the block
    # pool. Beyond a few full batches of full-length sequences they only feed the prefix cache.
    blocks_per_seq = -(-max_model_len // block_size)
    limit = MAX_BATCHES_OF_KV * max_num_seqs * blocks_per_seq
    if num_blocks > limit:
        logger.info("KV cache capped at %d blocks (memory allows %d)", limit, num_blocks)
    return int(min(num_blocks, limit))


@torch.inference_mode()
def profile_cuda_kv_budget(
    model: Any,
    utilization: float,
    *,
    device: torch.device,
    dtype: torch.dtype,
    block_size: int,
    max_model_len: int,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    reserve_bytes: int,
) -> int:
    """Run the largest step the scheduler can produce (without a KV cache to write), measure its
    peak activation memory, and return what `utilization` of the GPU leaves for the KV cache, less
    `reserve_bytes` (the CUDA graphs' logits and memory pool when graphs will be captured)."""
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    num_tokens = max_num_batched_tokens
    seq_lens = []
    while sum(seq_lens) < num_tokens:
        seq_lens.append(min(max_model_len, num_tokens - sum(seq_lens)))
    dummy_shape = model.kv_cache_shape_per_layer(1, block_size)
    dummy_caches = [torch.zeros(dummy_shape, dtype=dtype, device=device) for _ in range(model.num_layers)]
    input_ids, positions, metadata = _prefill_without_cache(seq_lens, block_size, device)
    hidden = model(input_ids, positions, metadata, dummy_caches)
    num_rows = min(max_num_seqs, num_tokens)
    model.compute_logits(hidden[:num_rows])
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    del hidden, dummy_caches
    current = torch.cuda.memory_allocated(device)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    # Everything now resident on the device (weights, other processes) plus the step's transient
    # peak must fit beside the KV cache inside the utilization cap.
    budget = int(total * utilization - (total - free) - (peak - current) - reserve_bytes)
    logger.info(
        "CUDA memory: total %.1f GiB, in use %.1f GiB, step peak %.2f GiB, graphs %.2f GiB, "
        "KV budget %.2f GiB",
        total / 2**30,
        (total - free) / 2**30,
        (peak - current) / 2**30,
        reserve_bytes / 2**30,
        budget / 2**30,
    )
    return max(budget, 0)


def _prefill_without_cache(
    seq_lens: list[int], block_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Inputs of a prefill of whole sequences that writes no KV (slots -1): the profiling step."""
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    num_tokens = int(lens.sum())
    query_start_loc = torch.zeros(len(seq_lens) + 1, dtype=torch.int32)
    query_start_loc[1:] = lens.cumsum(0)
    positions = torch.cat([torch.arange(n) for n in seq_lens])
    metadata = AttentionMetadata(
        query_start_loc=query_start_loc.to(device),
        seq_lens=lens.to(device),
        block_tables=torch.zeros(
            (len(seq_lens), -(-max(seq_lens) // block_size)), dtype=torch.int32, device=device
        ),
        slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64, device=device),
        max_query_len=max(seq_lens),
        max_seq_len=max(seq_lens),
        query_lens_cpu=tuple(seq_lens),
        seq_lens_cpu=tuple(seq_lens),
    )
    return torch.zeros(num_tokens, dtype=torch.int64, device=device), positions.to(device), metadata
