"""All tensor-parallel ranks allocate the same number of KV blocks: the fewest any rank can hold
(the scheduler on rank 0 hands out one set of block ids that every rank uses)."""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist
import torch.multiprocessing as mp

from voltllm.config import CacheConfig
from voltllm.worker.tensor_parallel import agree_on_num_blocks

WORLD_SIZE = 3


class RankMemory:
    """A rank whose memory holds a rank-dependent number of blocks (rank 1 the fewest)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def determine_num_blocks(self, cache: CacheConfig) -> int:
        return {0: 900, 1: 250, 2: 600}[self.rank]


def run_rank(rank: int, init_file: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD_SIZE)
    try:
        assert agree_on_num_blocks(RankMemory(rank), CacheConfig(), dist.group.WORLD) == 250
    finally:
        dist.destroy_process_group()


def test_ranks_agree_on_the_fewest_blocks(tmp_path: Path) -> None:
    # Forked: a spawned rank would spend seconds importing torch again.
    mp.start_processes(run_rank, (str(tmp_path / "rendezvous"),), nprocs=WORLD_SIZE, start_method="fork")
