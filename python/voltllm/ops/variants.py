"""Every kernel variant that voltllm ships, as C++ name expressions, one list per kernel source.

This module is the single list both proofs read: `tools/sm70_gate.py` instantiates each expression
with NVRTC and assembles it, and the torch glue (`csrc/torch_glue/ops_*.cu`) dispatches over the same
dtypes and head sizes. Sources are keyed by their path from `csrc/`. It imports nothing, so the gate can
load it without torch.

Architectures:
  * sm_70 (Volta): the `ops/` and `quantization/` kernels, the prefill row-tile map and the fp16 WMMA
    attention kernels (paged_decode_wmma, paged_prefill_wmma); the `_mma_sm80` attention kernels too,
    whose bodies compile to a trap there (the Python layer runs the WMMA prefill on Volta), so that a
    V100 build of the extension cannot break.
  * sm_70 also: the expert kernels (`moe/`), the grouped GEMM in fp16.
  * sm_80: the bf16 WMMA attention kernels and the bf16 grouped expert GEMM (bf16 tensor-core math
    needs SM80), and every `_mma_sm80` kernel (mma.sync m16n8k16, ldmatrix, cp.async): attention and
    the register-dequantizing 4-bit GEMM (a trap on sm_70 too, where the streaming WMMA GEMM runs).
  * sm_90: everything, as the H200 build compiles it.
"""

from __future__ import annotations

HEAD_SIZES = (64, 128, 256)
FP16 = "__half"
BF16 = "__nv_bfloat16"
DTYPES = (FP16, BF16)


# The sampling kernels templated on the logits dtype alone (select_digit_kernel also takes MASS).
SAMPLING_KERNELS = (
    "row_max_partial_kernel",
    "gather_candidates_kernel",
    "finish_candidates_kernel",
    "race_partial_kernel",
)
# race_first_sampling.cuh's kernels, each templated on the logits dtype alone.
RACE_FIRST_KERNELS = ("race_top_kernel", "race_mass_kernel", "race_finish_row_kernel")
# radix_sampling.cuh's two kernels that are no template: every unit that includes the header compiles
# them (race_first_sampling.cuh does), so both sources list them and the gate reports them by name.
RADIX_PLAIN_KERNELS = ("voltllm::row_max_merge_kernel", "voltllm::race_merge_kernel")


def _elementwise() -> dict[str, list[str]]:
    variants: dict[str, list[str]] = {
        "ops/kv_cache_write.cuh": [f"voltllm::kv_cache_write_kernel<{t}>" for t in DTYPES],
        "ops/rms_norm.cuh": [
            f"voltllm::{kernel}<{t}, {vec}>"
            for kernel in ("rms_norm_kernel", "fused_add_rms_norm_kernel")
            for t in DTYPES
            for vec in (1, 8)
        ],
        "ops/rotary.cuh": [
            f"voltllm::rotary_embedding_kernel<{t}, {neox}>" for t in DTYPES for neox in ("true", "false")
        ],
        "ops/activation.cuh": [f"voltllm::silu_and_mul_kernel<{t}, {vec}>" for t in DTYPES for vec in (1, 8)],
        "ops/gemv.cuh": [
            f"voltllm::{kernel}<{t}, {rows}, {swiglu}>"
            for kernel in ("gemv_kernel", "gemv_norm_kernel")
            for t in DTYPES
            for rows in (1, 2)
            for swiglu in ("false", "true")
        ]
        + [f"voltllm::gemv_kernel<{t}, {rows}, false, float>" for t in DTYPES for rows in (1, 2)],
        "sampling/radix_sampling.cuh": [
            *(f"voltllm::{kernel}<{t}>" for kernel in SAMPLING_KERNELS for t in ("float", *DTYPES)),
            *(
                f"voltllm::select_digit_kernel<{t}, {mass}>"
                for t in ("float", *DTYPES)
                for mass in ("false", "true")
            ),
            *RADIX_PLAIN_KERNELS,
        ],
        "sampling/race_first_sampling.cuh": [
            *(f"voltllm::{kernel}<{t}>" for kernel in RACE_FIRST_KERNELS for t in ("float", *DTYPES)),
            *RADIX_PLAIN_KERNELS,
        ],
        "ops/qk_norm_rope.cuh": [
            f"voltllm::qk_norm_rope_kernel<{t}, {h}>" for t in DTYPES for h in HEAD_SIZES
        ],
        "structured/apply_token_bitmask.cuh": [
            f"voltllm::apply_token_bitmask_kernel<{t}>" for t in ("float", *DTYPES)
        ],
    }
    return variants


# The packed weight kinds of csrc/quantization/quant_common.cuh (QuantKind), the decode row counts above
# one the quantized GEMV is built for (one row has its own shapes), and the row tiles of the quantized
# WMMA GEMM.
QUANT_KINDS = {"int4": 0, "int8": 1, "fp8": 2}
QUANT_GEMV_ROWS = (2, 4, 8)
# The one-row GEMV shapes, QuantGemvOneRowShape<0 .. n-1> in quant_gemv.cuh.
QUANT_GEMV_ONE_ROW_SHAPES = 2
QUANT_GEMM_BLOCK_M = (16, 64, 128)
# The weight-streaming GEMM's fragments of 16 rows of x per warp and of 16 weight rows per warp (its
# template arguments after the kind, csrc/quantization/quant_gemm_stream.cuh).
QUANT_STREAM_M_FRAGS = (1, 2, 3, 4)
QUANT_STREAM_N_FRAGS = (1, 2)


def _stream_args(kind: int, m_frags: int, n_frags: int) -> str:
    return f"{kind}, {m_frags}, {n_frags}"


# quant_gemv_kernel's shape arguments at more than one row (the defaults), spelled out.
_DEFAULT_GEMV_SHAPE_ARGS = (
    "voltllm::kQuantGemvMats, voltllm::kQuantGemvUnroll, voltllm::kQuantGemvWarps, 1, 1, false"
)


def _one_row_shape_args(index: int) -> str:
    shape = f"voltllm::QuantGemvOneRowShape<{index}>"
    fields = ("kMats", "kUnroll", "kWarps", "kSplit", "kPrefetch", "kNoL1")
    return ", ".join(f"{shape}::{field}" for field in fields)


def _quantization() -> dict[str, list[str]]:
    """The weight-only quantized kernels: fp16 activations only, so one list for every architecture."""
    kinds = QUANT_KINDS.values()
    return {
        "quantization/quant_gemv.cuh": [
            *(
                f"voltllm::quant_gemv_kernel<{kind}, {rows}, {swiglu}>"
                for kind in kinds
                for rows in QUANT_GEMV_ROWS
                for swiglu in ("false", "true")
            ),
            *(
                f"voltllm::quant_gemv_kernel<{kind}, 1, {swiglu}, {_one_row_shape_args(index)}>"
                for kind in kinds
                for swiglu in ("false", "true")
                for index in range(QUANT_GEMV_ONE_ROW_SHAPES)
            ),
            # With the add + RMSNorm epilogue (ADD_NORM, the last template argument).
            *(
                f"voltllm::quant_gemv_kernel<{kind}, {rows}, false, {_DEFAULT_GEMV_SHAPE_ARGS}, true>"
                for kind in kinds
                for rows in QUANT_GEMV_ROWS
            ),
            *(
                f"voltllm::quant_gemv_kernel<{kind}, 1, false, {_one_row_shape_args(index)}, true>"
                for kind in kinds
                for index in range(QUANT_GEMV_ONE_ROW_SHAPES)
            ),
        ],
        "quantization/quant_gemm_wmma.cuh": [
            *(
                f"voltllm::quant_gemm_wmma_kernel<{kind}, {bm}>"
                for kind in kinds
                for bm in QUANT_GEMM_BLOCK_M
            ),
            "voltllm::quant_gemm_finalize_kernel",
            *(f"voltllm::quant_dequantize_kernel<{kind}>" for kind in kinds),
        ],
        "quantization/quant_gemm_stream.cuh": [
            f"voltllm::quant_gemm_stream_kernel<{_stream_args(kind, mf, nf)}>"
            for kind in kinds
            for mf in QUANT_STREAM_M_FRAGS
            for nf in QUANT_STREAM_N_FRAGS
        ],
    }


# The register-dequantizing 4-bit GEMM's fragments of 16 rows of x per block (its first template argument,
# csrc/quantization/quant_gemm_mma_sm80.cuh; the second says whether x is staged by cp.async).
QUANT_MMA_M_FRAGS = (1, 2, 3, 4)
# Its staged form's row fragments per warp (quant_gemm_mma_staged_kernel<MFW>: 32 MFW rows a block).
QUANT_MMA_STAGED_ROW_FRAGS = (1, 2)


def _quant_mma_sm80() -> dict[str, list[str]]:
    """The SM80+ 4-bit GEMM (mma.sync m16n8k16): fp16 only, a trap on sm_70."""
    return {
        "quantization/quant_gemm_mma_sm80.cuh": [
            *(
                f"voltllm::quant_gemm_mma_sm80_kernel<{mf}, {async_x}>"
                for mf in QUANT_MMA_M_FRAGS
                for async_x in ("false", "true")
            ),
            *(f"voltllm::quant_gemm_mma_staged_kernel<{mfw}>" for mfw in QUANT_MMA_STAGED_ROW_FRAGS),
        ]
    }


def _attention_wmma(dtype: str) -> dict[str, list[str]]:
    return {
        "attention/paged_decode_wmma.cuh": [
            f"voltllm::{kernel}<{dtype}, {h}>"
            for kernel in ("paged_decode_wmma_kernel", "paged_decode_reduce_kernel")
            for h in HEAD_SIZES
        ],
        # The row-tile map every prefill launch (either kernel) builds first; the same for every dtype.
        "attention/paged_prefill_tile_map.cuh": ["voltllm::prefill_tile_map_kernel"],
        "attention/paged_prefill_wmma.cuh": [
            f"voltllm::paged_prefill_wmma_kernel<{dtype}, {h}>" for h in HEAD_SIZES
        ],
    }


def _attention_mma_sm80(dtype: str) -> dict[str, list[str]]:
    return {
        "attention/paged_prefill_mma_sm80.cuh": [
            f"voltllm::paged_prefill_mma_sm80_kernel<{dtype}, {h}>" for h in HEAD_SIZES
        ],
    }


# The staged pair-path down stage's 16-byte loads per lane in flight (moe_pair_down_staged_kernel<T,
# CHUNKS>): 12, the H100 A/B's winner over 24 (issue 17); voltllm.ops.moe.PAIR_DOWN_CHUNKS.
MOE_PAIR_DOWN_STAGED_CHUNKS = (12,)


def _moe() -> dict[str, list[str]]:
    """The expert kernels on CUDA cores: routing, the decode GEMV and the combine, every dtype."""
    return {
        "moe/topk_softmax.cuh": [f"voltllm::moe_topk_softmax_kernel<{t}>" for t in DTYPES],
        "moe/align.cuh": ["voltllm::moe_align_kernel"],
        "moe/expert_gemv.cuh": [
            f"voltllm::moe_expert_gemv_kernel<{t}, {gated}>" for t in DTYPES for gated in ("true", "false")
        ],
        "moe/combine.cuh": [f"voltllm::moe_combine_kernel<{t}>" for t in DTYPES],
        "moe/pair_gemv.cuh": [
            *(f"voltllm::moe_pair_{stage}_kernel<{t}>" for t in DTYPES for stage in ("gated", "down")),
            *(
                f"voltllm::moe_pair_down_staged_kernel<{t}, {chunks}>"
                for t in DTYPES
                for chunks in MOE_PAIR_DOWN_STAGED_CHUNKS
            ),
        ],
        # The quantized experts' pair path: fp16 activations, every packed kind.
        "moe/quant_pair_gemv.cuh": [
            f"voltllm::moe_quant_pair_{stage}_kernel<{kind}>"
            for kind in QUANT_KINDS.values()
            for stage in ("gated", "down")
        ],
    }


def _moe_gemm_wmma(dtype: str) -> dict[str, list[str]]:
    """The experts' tensor-core grouped GEMM, gated (gate/up + SwiGLU) and down."""
    return {
        "moe/grouped_gemm_wmma.cuh": [
            f"voltllm::moe_grouped_gemm_wmma_kernel<{dtype}, {gated}>" for gated in ("true", "false")
        ]
    }


def _merge(*parts: dict[str, list[str]]) -> dict[str, list[str]]:
    merged: dict[str, list[str]] = {}
    for part in parts:
        for source, exprs in part.items():
            merged.setdefault(source, []).extend(e for e in exprs if e not in merged.get(source, []))
    return merged


def dynamic_smem_probes() -> dict[str, str]:
    """Kernel expression -> a `__device__` constant holding the dynamic shared memory it launches with."""
    probes = {}
    for t in ("float", *DTYPES):
        probes[f"voltllm::row_max_partial_kernel<{t}>"] = "voltllm::argmax_smem_bytes_probe"
        probes[f"voltllm::race_partial_kernel<{t}>"] = "voltllm::argmax_smem_bytes_probe"
        probes[f"voltllm::gather_candidates_kernel<{t}>"] = "voltllm::select_smem_bytes_probe"
        probes[f"voltllm::finish_candidates_kernel<{t}>"] = "voltllm::select_smem_bytes_probe"
        probes[f"voltllm::race_top_kernel<{t}>"] = "voltllm::race_smem_bytes_probe"
        probes[f"voltllm::race_mass_kernel<{t}>"] = "voltllm::race_smem_bytes_probe"
        probes[f"voltllm::race_finish_row_kernel<{t}>"] = "voltllm::select_smem_bytes_probe"
        for mass in ("false", "true"):
            probes[f"voltllm::select_digit_kernel<{t}, {mass}>"] = "voltllm::select_smem_bytes_probe"
    for dtype in DTYPES:
        for h in HEAD_SIZES:
            args = f"<{dtype}, {h}>"
            probes[f"voltllm::paged_decode_wmma_kernel{args}"] = f"voltllm::decode_wmma_smem_bytes<{h}>"
            probes[f"voltllm::paged_decode_reduce_kernel{args}"] = "voltllm::decode_reduce_smem_bytes"
            mma_sm80 = f"voltllm::prefill_mma_sm80_smem_bytes<{h}>"
            probes[f"voltllm::paged_prefill_mma_sm80_kernel{args}"] = mma_sm80
            probes[f"voltllm::paged_prefill_wmma_kernel{args}"] = f"voltllm::prefill_wmma_smem_bytes<{h}>"
        for gated in ("true", "false"):
            gemm = f"voltllm::moe_grouped_gemm_wmma_kernel<{dtype}, {gated}>"
            probes[gemm] = f"voltllm::moe_gemm_wmma_smem_bytes<{gated}>"
    for kind in QUANT_KINDS.values():
        for bm in QUANT_GEMM_BLOCK_M:
            args = f"<{kind}, {bm}>"
            probes[f"voltllm::quant_gemm_wmma_kernel{args}"] = f"voltllm::quant_gemm_wmma_smem_bytes{args}"
    for kind in QUANT_KINDS.values():
        for mf in QUANT_STREAM_M_FRAGS:
            for nf in QUANT_STREAM_N_FRAGS:
                args = f"<{_stream_args(kind, mf, nf)}>"
                probe = f"voltllm::quant_gemm_stream_smem_bytes_probe{args}"
                probes[f"voltllm::quant_gemm_stream_kernel{args}"] = probe
    for mf in QUANT_MMA_M_FRAGS:
        for async_x in ("false", "true"):
            probe = f"voltllm::quant_gemm_mma_smem_bytes_probe<{mf}, {async_x}>"
            probes[f"voltllm::quant_gemm_mma_sm80_kernel<{mf}, {async_x}>"] = probe
    for mfw in QUANT_MMA_STAGED_ROW_FRAGS:
        probe = f"voltllm::quant_gemm_mma_staged_smem_bytes_probe<{mfw}>"
        probes[f"voltllm::quant_gemm_mma_staged_kernel<{mfw}>"] = probe
    probes["voltllm::moe_align_kernel"] = "voltllm::moe_align_max_smem_bytes"
    for dtype in DTYPES:
        for chunks in MOE_PAIR_DOWN_STAGED_CHUNKS:
            staged = f"voltllm::moe_pair_down_staged_kernel<{dtype}, {chunks}>"
            probes[staged] = "voltllm::moe_pair_staged_max_smem_bytes"
    return probes


def sm70_variants() -> dict[str, list[str]]:
    """Kernel source -> name expressions that must compile for compute_70 and assemble for sm_70."""
    return _merge(
        _elementwise(),
        _quantization(),
        _attention_wmma(FP16),
        _attention_mma_sm80(FP16),
        _quant_mma_sm80(),
        _moe(),
        _moe_gemm_wmma(FP16),
    )


def sm80_bf16_variants() -> dict[str, list[str]]:
    """The bf16 WMMA variants (decode and prefill attention, the experts' grouped GEMM), shipped for SM80
    and newer only."""
    return _merge(_attention_wmma(BF16), _moe_gemm_wmma(BF16))


def sm80_variants() -> dict[str, list[str]]:
    """The `_mma_sm80` variants (attention in both dtypes, the 4-bit GEMM), whose real bodies exist
    from SM80 on."""
    return _merge(_attention_mma_sm80(FP16), _attention_mma_sm80(BF16), _quant_mma_sm80())


def sm90_variants() -> dict[str, list[str]]:
    """Every variant, as a build for an H100/H200 compiles it."""
    return _merge(sm70_variants(), sm80_bf16_variants(), sm80_variants())
