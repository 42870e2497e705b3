"""The CUDA attention backend: voltllm's own kernels, written for Volta (SM70) and run on newer GPUs too.

Per layer and step, when every sequence brings one token, the split-K decode kernel runs the prologue
(q/k RMSNorm + RoPE + the newest token's KV-cache write) itself (`ops.paged_decode_attention_prologue`):
one launch for the whole attention. Otherwise the prologue runs as one kernel
(`ops.qk_norm_rope_kv_write`, in place on the qkv projection) where it applies, else the norm and rotary
layers and `ops.kv_cache_write`; then the tensor-core prefill kernel (which also serves chunked prefill,
prefix-cache hits and mixed prefill/decode batches), or the decode kernel. Same KV layout and semantics
as `TorchAttentionBackend`, which is its test oracle.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from voltllm import ops
from voltllm.layers.attention.backend import (
    AttentionBackend,
    AttentionMetadata,
    AttentionPrologue,
    AttentionSpec,
)
from voltllm.ops import attention as attn_ops
from voltllm.ops.build import KernelBuildError, load
from voltllm.ops.variants import HEAD_SIZES

SUPPORTED_HEAD_SIZES = HEAD_SIZES  # what the kernels are built for
# Decode batches up to this many sequences have the decode kernel ask L2 for the layer's next weights
# (o_proj, then the MLP's leading weights) while it attends: there attention is latency-bound and the
# memory idle, so the GEMVs after it read those weights from L2. Larger batches stream K/V at bandwidth.
# SM90+ only (the kernel asks through the TMA's bulk prefetch, which earlier GPUs lack). 0 until the A/B
# (`benches/batch1_ab.py`, variant `+l2`) has measured it on a GPU.
L2_PREFETCH_MAX_SEQS = 0
L2_PREFETCH_MIN_CAPABILITY = (9, 0)


class SM70AttentionBackend(AttentionBackend):
    """`AttentionBackend` over the voltllm CUDA kernels (fp16 everywhere, bf16 on SM80+)."""

    name = "sm70"
    supports_cuda_graphs = True

    def __init__(
        self,
        device: torch.device | str = "cuda",
        fold_prologue: bool = True,
        decode_merge: str = "auto",
        decode_min_split: int = attn_ops.DECODE_MIN_SPLIT,
        l2_prefetch_max_seqs: int = L2_PREFETCH_MAX_SEQS,
    ) -> None:
        """`fold_prologue=False` runs the prologue kernel before the decode kernel instead of inside it,
        `decode_merge` says who merges the decode kernel's splits (`ops.attention.DECODE_MERGES`),
        `decode_min_split` how many tokens a split covers at least and `l2_prefetch_max_seqs` up to which
        decode batch size the decode kernel asks L2 for the layer's next weights (0: never): the A/B
        switches `benches/batch1_ab.py` times (set them before CUDA graphs are captured)."""
        attn_ops.check_decode_merge(decode_merge)
        if l2_prefetch_max_seqs < 0:
            raise ValueError(f"l2_prefetch_max_seqs must be >= 0, got {l2_prefetch_max_seqs}")
        self.fold_prologue = fold_prologue
        self.decode_merge = decode_merge
        self.decode_min_split = decode_min_split
        self.l2_prefetch_max_seqs = l2_prefetch_max_seqs
        device = torch.device(device)
        if device.type != "cuda" or not torch.cuda.is_available():
            raise RuntimeError(f"the sm70 attention backend needs a CUDA device, got {device}")
        self._has_bulk_prefetch = torch.cuda.get_device_capability(device) >= L2_PREFETCH_MIN_CAPABILITY
        try:
            load()
        except KernelBuildError as err:
            raise RuntimeError(str(err)) from err

    def forward_qkv(
        self,
        spec: AttentionSpec,
        prologue: AttentionPrologue,
        positions: torch.Tensor,
        qkv: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        next_weights: Sequence[torch.Tensor] = (),
    ) -> torch.Tensor:
        if not self._fused_prologue_applies(spec, prologue, qkv, kv_cache):
            return super().forward_qkv(spec, prologue, positions, qkv, kv_cache, metadata)
        prefetch = self._l2_prefetch(metadata, qkv.shape[0], next_weights)
        q_norm, k_norm = prologue.q_norm, prologue.k_norm
        # What the prologue takes, whether it runs inside the decode kernel or as its own launch.
        prologue_args = (
            qkv,
            positions,
            prologue.rotary_emb.cos_sin_table(),
            q_norm.weight if q_norm is not None else None,
            k_norm.weight if k_norm is not None else None,
            q_norm.eps if q_norm is not None else 0.0,
            spec.num_heads,
            kv_cache,
            metadata.slot_mapping,
        )
        if self.fold_prologue and self._is_decode(metadata, qkv.shape[0]):
            # The prologue inside the decode kernel: no launch of its own.
            return ops.paged_decode_attention_prologue(
                *prologue_args,
                metadata.block_tables,
                metadata.seq_lens,
                metadata.seq_lens_cpu,
                spec.scale,
                spec.sliding_window,
                merge=self.decode_merge,
                min_split=self.decode_min_split,
                l2_prefetch=prefetch,
            )
        # q/k norm, rotary and the KV-cache write in one kernel, in place on qkv.
        ops.qk_norm_rope_kv_write(*prologue_args)
        query = qkv[:, : spec.num_heads * spec.head_size].view(qkv.shape[0], spec.num_heads, spec.head_size)
        return self._attend(spec, query, kv_cache, metadata, prefetch)

    def _l2_prefetch(
        self, metadata: AttentionMetadata, num_tokens: int, next_weights: Sequence[torch.Tensor]
    ) -> tuple[torch.Tensor, ...]:
        """What the decode kernel asks L2 for: the next weights (the contiguous, 16-byte aligned CUDA ones,
        at most the kernel's four) on decode batches of at most `l2_prefetch_max_seqs` sequences on an
        SM90+ GPU, else nothing."""
        if not next_weights or not self._has_bulk_prefetch or metadata.num_seqs > self.l2_prefetch_max_seqs:
            return ()
        if not self._is_decode(metadata, num_tokens):
            return ()
        usable = (w for w in next_weights if w.is_cuda and w.is_contiguous() and w.data_ptr() % 16 == 0)
        return tuple(usable)[: attn_ops.L2_PREFETCH_MAX_TENSORS]

    @staticmethod
    def _fused_prologue_applies(
        spec: AttentionSpec, prologue: AttentionPrologue, qkv: torch.Tensor, kv_cache: torch.Tensor
    ) -> bool:
        """The prologue kernel takes fp16/bf16 qkv with the cache in the same dtype, a head size the
        kernels are built for, and always rotates (NeoX halves, the rotary layer's table)."""
        return (
            prologue.rotary_emb is not None
            and qkv.dtype in (torch.float16, torch.bfloat16)
            and kv_cache.dtype == qkv.dtype
            and spec.head_size in SUPPORTED_HEAD_SIZES
        )

    def forward(
        self,
        spec: AttentionSpec,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        attn_ops.kv_cache_write(key, value, kv_cache, metadata.slot_mapping)
        return self._attend(spec, query, kv_cache, metadata)

    @staticmethod
    def _check_head_size(spec: AttentionSpec) -> None:
        if spec.head_size not in SUPPORTED_HEAD_SIZES:
            raise ValueError(f"sm70 backend supports head sizes {SUPPORTED_HEAD_SIZES}, got {spec.head_size}")

    @staticmethod
    def _is_decode(metadata: AttentionMetadata, num_tokens: int) -> bool:
        """Whether the batch is one new token per sequence (the decode kernel's case); a ValueError when
        the metadata does not describe `num_tokens` query tokens."""
        covered = sum(metadata.query_lens_cpu)
        if covered != num_tokens:
            raise ValueError(f"metadata covers {covered} query tokens but the batch has {num_tokens}")
        return metadata.is_pure_decode and num_tokens == metadata.num_seqs

    def _attend(
        self,
        spec: AttentionSpec,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        l2_prefetch: Sequence[torch.Tensor] = (),
    ) -> torch.Tensor:
        """Attention of `query` over the cache, which already holds the step's keys/values (`l2_prefetch`:
        weights the decode kernel asks L2 for)."""
        self._check_head_size(spec)
        if self._is_decode(metadata, query.shape[0]):
            return attn_ops.paged_decode_attention(
                query,
                kv_cache,
                metadata.block_tables,
                metadata.seq_lens,
                metadata.seq_lens_cpu,
                spec.scale,
                spec.sliding_window,
                merge=self.decode_merge,
                min_split=self.decode_min_split,
                l2_prefetch=l2_prefetch,
            )
        return attn_ops.paged_prefill_attention(
            query,
            kv_cache,
            metadata.block_tables,
            metadata.seq_lens,
            metadata.query_start_loc,
            metadata.query_lens_cpu,
            metadata.seq_lens_cpu,
            spec.scale,
            spec.sliding_window,
        )
