"""Every kernel variant that voltllm ships, as C++ name expressions, one list per kernel source.

This module is the single list both proofs read: `tools/sm70_gate.py` instantiates each expression
with NVRTC and assembles it for sm_70, and the torch glue (`csrc/torch_ops.cu`) dispatches over the
same dtypes and head sizes. It imports nothing, so the gate can load it without torch.

bf16 tensor-core math needs SM80: the bf16 attention variants are checked for compute_80 instead of
compute_70, and the glue refuses them on older GPUs.
"""

from __future__ import annotations

HEAD_SIZES = (64, 128, 256)
FP16 = "__half"
BF16 = "__nv_bfloat16"
DTYPES = (FP16, BF16)


def _elementwise() -> dict[str, list[str]]:
    variants: dict[str, list[str]] = {
        "kv_cache.cuh": [f"voltllm::kv_cache_write_kernel<{t}>" for t in DTYPES],
        "rms_norm.cuh": [
            f"voltllm::{kernel}<{t}, {vec}>"
            for kernel in ("rms_norm_kernel", "fused_add_rms_norm_kernel")
            for t in DTYPES
            for vec in (1, 8)
        ],
        "rotary.cuh": [
            f"voltllm::rotary_embedding_kernel<{t}, {neox}>" for t in DTYPES for neox in ("true", "false")
        ],
        "activation.cuh": [f"voltllm::silu_and_mul_kernel<{t}, {vec}>" for t in DTYPES for vec in (1, 8)],
    }
    return variants


def _attention(dtype: str) -> dict[str, list[str]]:
    return {
        "paged_decode_attention.cuh": [
            f"voltllm::{kernel}<{dtype}, {h}>"
            for kernel in ("paged_decode_attention_kernel", "paged_decode_reduce_kernel")
            for h in HEAD_SIZES
        ],
        "paged_prefill_attention.cuh": ["voltllm::prefill_tile_map_kernel"]
        + [f"voltllm::paged_prefill_attention_kernel<{dtype}, {h}>" for h in HEAD_SIZES],
    }


def dynamic_smem_probes() -> dict[str, str]:
    """Kernel expression -> a `__device__` constant holding the dynamic shared memory it launches with."""
    probes: dict[str, str] = {}
    for dtype in DTYPES:
        for h in HEAD_SIZES:
            probes[f"voltllm::paged_decode_attention_kernel<{dtype}, {h}>"] = (
                f"voltllm::decode_smem_bytes<{h}>"
            )
            probes[f"voltllm::paged_prefill_attention_kernel<{dtype}, {h}>"] = (
                f"voltllm::prefill_smem_bytes<{h}>"
            )
    return probes


def sm70_variants() -> dict[str, list[str]]:
    """Kernel source -> name expressions that must compile for compute_70 and assemble for sm_70."""
    variants = _elementwise()
    variants.update(_attention(FP16))
    return variants


def sm80_bf16_variants() -> dict[str, list[str]]:
    """The bf16 tensor-core variants, shipped for SM80 and newer only."""
    return _attention(BF16)
