"""The attention-backend interface: the one seam between the model and the attention kernels.

A step's tokens arrive flattened: the scheduled tokens of every sequence, back to back, prefills and
decodes mixed. The model runner builds one `AttentionMetadata` per step and hands it to the model; every
attention layer passes it, with its own KV cache, to the selected backend.

The backend owns everything that touches the KV cache. The model hands it the fused qkv projection
(`forward_qkv`) with the layer's `AttentionPrologue` (optional per-head q/k RMSNorm, then RoPE); the
backend runs the prologue, writes the step's new keys/values into the paged cache and attends each
query to its sequence's whole context (cached prefix + earlier chunks + this step's tokens), causally.
How it does so is its own choice: the CUDA backend runs norm + rope + cache write as one kernel, the
reference backend runs the layers one after another. `forward` is the same minus the prologue, for
q/k/v already normed and rotated.

KV cache layout, shared by every backend (one tensor per layer):
    kv_cache: [2, num_blocks, block_size, num_kv_heads, head_size]   (kv_cache[0] = keys, [1] = values)
A token at position p of a sequence lives in block `block_table[p // block_size]`, offset
`p % block_size`; its flat slot is `block * block_size + offset` (what `slot_mapping` holds).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from voltllm.layers.norm import RMSNorm
from voltllm.layers.rotary import RotaryEmbedding


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


@dataclass(frozen=True, eq=False)
class AttentionPrologue:
    """What a layer applies to q and k before attention: optional per-head RMSNorm (Qwen3), then RoPE.

    The modules belong to the model (their parameters keep the checkpoint's names there); the attention
    layer hands them to its backend, which applies them in whatever form it likes.
    """

    rotary_emb: RotaryEmbedding | None = None
    q_norm: RMSNorm | None = None
    k_norm: RMSNorm | None = None

    def __post_init__(self) -> None:
        if (self.q_norm is None) != (self.k_norm is None):
            raise ValueError("q_norm and k_norm come together")

    def __call__(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The unfused form: the norm layers, then the rotary layer (each a kernel on CUDA)."""
        if self.q_norm is not None and self.k_norm is not None:
            query, key = self.q_norm(query), self.k_norm(key)
        if self.rotary_emb is not None:
            query, key = self.rotary_emb(positions, query, key)
        return query, key


def split_qkv(spec: AttentionSpec, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Views `[T, heads, head]`, `[T, kv_heads, head]` x 2 of a fused `[q | k | v]` projection."""
    q_size, kv_size = spec.num_heads * spec.head_size, spec.num_kv_heads * spec.head_size
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    num_tokens = qkv.shape[0]
    return (
        q.view(num_tokens, spec.num_heads, spec.head_size),
        k.view(num_tokens, spec.num_kv_heads, spec.head_size),
        v.view(num_tokens, spec.num_kv_heads, spec.head_size),
    )


class AttentionBackend(ABC):
    """Runs a layer's q/k prologue, writes the step's K/V into the paged cache and computes attention."""

    name: str = "abstract"
    # True when a decode step can be captured in a CUDA graph: the backend reads lengths and block
    # tables from device tensors only (host-side metadata may be stale on replay) and never syncs.
    supports_cuda_graphs: bool = False

    def forward_qkv(
        self,
        spec: AttentionSpec,
        prologue: AttentionPrologue,
        positions: torch.Tensor,  # [num_tokens] int64
        qkv: torch.Tensor,  # [num_tokens, (num_heads + 2 * num_kv_heads) * head_size], updated in place
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]
        metadata: AttentionMetadata,
        next_weights: Sequence[torch.Tensor] = (),
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_size]
        """Apply `prologue` to the q and k heads of `qkv`, then `forward`. Backends with a fused
        prologue override this.

        `next_weights` are the weights the layer reads right after attention, in order (its o_proj,
        then the MLP's until one depends on the input): a backend may bring them into the GPU's cache
        while it attends (the CUDA backend does at small decode batches, where attention leaves the
        memory idle). A hint only: the result never depends on it, and this reference form ignores it."""
        query, key, value = split_qkv(spec, qkv)
        query, key = prologue(positions, query, key)
        return self.forward(spec, query, key, value, kv_cache, metadata)

    @abstractmethod
    def forward(
        self,
        spec: AttentionSpec,
        query: torch.Tensor,  # [num_tokens, num_heads, head_size]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]
        metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_size]
        """Store key/value at `metadata.slot_mapping`, then attend every query causally."""
