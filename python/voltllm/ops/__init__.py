"""Python face of the voltllm CUDA kernels.

One function per op. CUDA tensors run the kernel (built on first use, see `voltllm.ops.build`); other
tensors run the plain-torch reference beside it (`*_ref`), which is also the test oracle.
"""

from voltllm.ops.activation import silu_and_mul, silu_and_mul_ref
from voltllm.ops.attention import (
    kv_cache_write,
    kv_cache_write_ref,
    paged_attention_ref,
    paged_decode_attention,
    paged_prefill_attention,
)
from voltllm.ops.build import KernelBuildError
from voltllm.ops.linear import add_rms_norm_gemv, add_rms_norm_gemv_ref
from voltllm.ops.norm import fused_add_rms_norm, fused_add_rms_norm_ref, rms_norm, rms_norm_ref
from voltllm.ops.prologue import (
    paged_decode_attention_prologue,
    qk_norm_rope_kv_write,
    qk_norm_rope_kv_write_ref,
)
from voltllm.ops.rotary import cos_sin_cache, rotary_embedding, rotary_embedding_ref

__all__ = [
    "KernelBuildError",
    "add_rms_norm_gemv",
    "add_rms_norm_gemv_ref",
    "cos_sin_cache",
    "fused_add_rms_norm",
    "fused_add_rms_norm_ref",
    "kv_cache_write",
    "kv_cache_write_ref",
    "paged_attention_ref",
    "paged_decode_attention",
    "paged_decode_attention_prologue",
    "paged_prefill_attention",
    "qk_norm_rope_kv_write",
    "qk_norm_rope_kv_write_ref",
    "rms_norm",
    "rms_norm_ref",
    "rotary_embedding",
    "rotary_embedding_ref",
    "silu_and_mul",
    "silu_and_mul_ref",
]
