"""Test helper: lay sequences out in a paged KV cache and build `AttentionMetadata` for one step.

Blocks are handed out in a shuffled order so block tables are not contiguous, as in a real cache.
"""

from __future__ import annotations

import torch

from voltllm.layers.attention.backend import AttentionMetadata


class PagedBatch:
    """Tracks each sequence's tokens-in-cache and block table across steps."""

    def __init__(self, num_seqs: int, num_blocks: int, block_size: int, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.free_blocks = torch.randperm(num_blocks, generator=gen).tolist()
        self.block_size = block_size
        self.block_tables: list[list[int]] = [[] for _ in range(num_seqs)]
        self.num_cached = [0] * num_seqs

    def step(self, query_lens: list[int], device: torch.device | str = "cpu") -> AttentionMetadata:
        """Metadata for a step where sequence i adds `query_lens[i]` tokens after its cached ones."""
        slots: list[int] = []
        seq_lens: list[int] = []
        for i, query_len in enumerate(query_lens):
            seq_len = self.num_cached[i] + query_len
            while len(self.block_tables[i]) * self.block_size < seq_len:
                self.block_tables[i].append(self.free_blocks.pop())
            for pos in range(self.num_cached[i], seq_len):
                block = self.block_tables[i][pos // self.block_size]
                slots.append(block * self.block_size + pos % self.block_size)
            seq_lens.append(seq_len)
            self.num_cached[i] = seq_len
        width = max(len(t) for t in self.block_tables)
        tables = [t + [0] * (width - len(t)) for t in self.block_tables]
        starts = [0]
        for query_len in query_lens:
            starts.append(starts[-1] + query_len)
        return AttentionMetadata(
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_tables=torch.tensor(tables, dtype=torch.int32, device=device),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            query_lens_cpu=tuple(query_lens),
            seq_lens_cpu=tuple(seq_lens),
        )

    def positions(self, query_lens: list[int]) -> torch.Tensor:
        """Positions of the tokens of the step just built (call after `step`)."""
        return torch.cat([torch.arange(n - q, n) for n, q in zip(self.num_cached, query_lens, strict=True)])
