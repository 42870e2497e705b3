"""The CUDA attention backend: voltllm's own kernels, written for Volta (SM70) and run on newer GPUs too.

Per step it writes the new keys/values into the paged cache (`ops.kv_cache_write`), then runs the
split-K decode kernel when every sequence brings one token, and the tensor-core prefill kernel (which
also serves chunked prefill, prefix-cache hits and mixed prefill/decode batches) otherwise. Same KV
layout and semantics as `TorchAttentionBackend`, which is its test oracle.
"""

from __future__ import annotations

import torch

from voltllm.layers.attention.backend import AttentionBackend, AttentionMetadata, AttentionSpec
from voltllm.ops import attention as attn_ops
from voltllm.ops.build import KernelBuildError, load
from voltllm.ops.variants import HEAD_SIZES

SUPPORTED_HEAD_SIZES = HEAD_SIZES  # what the kernels are built for


class SM70AttentionBackend(AttentionBackend):
    """`AttentionBackend` over the voltllm CUDA kernels (fp16 everywhere, bf16 on SM80+)."""

    name = "sm70"
    supports_cuda_graphs = True

    def __init__(self, device: torch.device | str = "cuda") -> None:
        device = torch.device(device)
        if device.type != "cuda" or not torch.cuda.is_available():
            raise RuntimeError(f"the sm70 attention backend needs a CUDA device, got {device}")
        try:
            load()
        except KernelBuildError as err:
            raise RuntimeError(str(err)) from err

    def forward(
        self,
        spec: AttentionSpec,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        kv_written: bool = False,
    ) -> torch.Tensor:
        if spec.head_size not in SUPPORTED_HEAD_SIZES:
            raise ValueError(f"sm70 backend supports head sizes {SUPPORTED_HEAD_SIZES}, got {spec.head_size}")
        num_tokens = sum(metadata.query_lens_cpu)
        if num_tokens != query.shape[0]:
            raise ValueError(f"metadata covers {num_tokens} query tokens but the batch has {query.shape[0]}")
        if not kv_written:
            attn_ops.kv_cache_write(key, value, kv_cache, metadata.slot_mapping)
        if metadata.is_pure_decode and query.shape[0] == metadata.num_seqs:
            return attn_ops.paged_decode_attention(
                query,
                kv_cache,
                metadata.block_tables,
                metadata.seq_lens,
                metadata.seq_lens_cpu,
                spec.scale,
                spec.sliding_window,
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
