"""The attention-backend interface: the one seam between the model and the attention kernels.

A step's tokens arrive flattened: the scheduled tokens of every sequence, back to back, prefills and
decodes mixed. The model runner builds one `AttentionMetadata` per step and hands it to the model; every
attention layer passes it, with its own KV cache, to the selected backend. Backends first write the
step's new keys/values into the paged cache, then attend each query to its sequence's whole context
(cached prefix + earlier chunks + this step's tokens), causally.

KV cache layout, shared by every backend (one tensor per layer):
    kv_cache: [2, num_blocks, block_size, num_kv_heads, head_size]   (kv_cache[0] = keys, [1] = values)
A token at position p of a sequence lives in block `block_table[p // block_size]`, offset
`p % block_size`; its flat slot is `block * block_size + offset` (what `slot_mapping` holds).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttentionMetadata:
    """Per-step description of the flattened batch. Tensors live on the model's device."""

    # [num_seqs + 1] int32: sequence i's query tokens are rows query_start_loc[i]:query_start_loc[i+1]
    query_start_loc: torch.Tensor
    # [num_seqs] int32: context length of each sequence after this step (cached + new tokens)
    seq_lens: torch.Tensor
    # [num_seqs, max_num_blocks_per_seq] int32: physical block ids, padded with 0 past the end
    block_tables: torch.Tensor
    # [num_tokens] int64: flat cache slot of each new token (-1 = do not write, e.g. padding)
    slot_mapping: torch.Tensor
    max_query_len: int
    max_seq_len: int
    # The same lengths on the host, so backends need no device->host sync to loop or size buffers.
    query_lens_cpu: tuple[int, ...]
    seq_lens_cpu: tuple[int, ...]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def is_pure_decode(self) -> bool:
        """Every sequence contributes exactly one query token (the decode fast path)."""
        return self.max_query_len == 1


@dataclass(frozen=True)
class AttentionSpec:
    """Static shape of one attention layer."""

    num_heads: int
    num_kv_heads: int
    head_size: int
    scale: float
    sliding_window: int | None = None  # attend to at most this many most recent positions

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads


class AttentionBackend(ABC):
    """Writes a step's K/V into the paged cache and computes attention for its queries."""

    name: str = "abstract"
    # True when a decode step can be captured in a CUDA graph: the backend reads lengths and block
    # tables from device tensors only (host-side metadata may be stale on replay) and never syncs.
    supports_cuda_graphs: bool = False

    @abstractmethod
    def forward(
        self,
        spec: AttentionSpec,
        query: torch.Tensor,  # [num_tokens, num_heads, head_size]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]
        metadata: AttentionMetadata,
        kv_written: bool = False,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_size]
        """Store key/value at `metadata.slot_mapping`, then attend every query causally. With
        `kv_written` the step's keys/values are already in the cache (the fused prologue kernel wrote
        them) and only the attention runs."""
