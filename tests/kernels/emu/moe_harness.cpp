// C entry points that run the mixture-of-experts kernels (csrc/moe/) on the CPU emulator, for
// tests/kernels/test_moe_emulated.py (loaded with ctypes; pointers are CPU torch tensors).
#include "cuda_emu.h"
// The kernel headers come after the emulator, which stands in for the CUDA toolchain.
#include "dispatch.h"
#include "moe/align.cuh"
#include "moe/combine.cuh"
#include "moe/expert_gemv.cuh"
#include "moe/grouped_gemm_wmma.cuh"
#include "moe/pair_gemv.cuh"
#include "moe/quant_pair_gemv.cuh"
#include "moe/topk_softmax.cuh"

namespace {

// The staged down stage, moe_pair_down_staged_kernel<T, 12>, as the glue launches it.
void run_pair_down_staged(int bf16, const voltllm::MoePairParams& p, int num_tokens, int down_chunks, unsigned seed) {
  const dim3 grid(num_tokens, (p.n + voltllm::kMoePairStagedWarps - 1) / voltllm::kMoePairStagedWarps);
  const int smem = voltllm::moe_pair_staged_smem_bytes(p.top_k, p.k);
  if (smem > voltllm::kMoePairStagedMaxSmem) emu::fail("staged down stage: shared memory over its limit");
  if (down_chunks != 12) emu::fail("down_chunks");
  emu::dispatch_dtype(bf16, [&](auto t) {
    using T = decltype(t);
    emu::launch(grid, dim3(32 * voltllm::kMoePairStagedWarps), smem,
                [&] { voltllm::moe_pair_down_staged_kernel<T, 12>(p); }, seed);
  });
}

}  // namespace

extern "C" {

void emu_moe_topk_softmax(int bf16, float* topk_weights, int* topk_ids, const void* logits, long long logits_stride,
                          int num_tokens, int num_experts, int top_k, int renormalize, unsigned seed) {
  voltllm::MoeTopkParams p{topk_weights, topk_ids, logits, logits_stride, num_tokens, num_experts, top_k, renormalize};
  const int blocks = (num_tokens + voltllm::kMoeTopkWarps - 1) / voltllm::kMoeTopkWarps;
  emu::dispatch_dtype(bf16, [&](auto t) {
    emu::launch(dim3(blocks), dim3(32 * voltllm::kMoeTopkWarps), 0,
                [&] { voltllm::moe_topk_softmax_kernel<decltype(t)>(p); }, seed);
  });
}

void emu_moe_align(const int* topk_ids, int* sorted_pair_ids, int* tile_experts, int* num_tiles, int num_pairs,
                   int num_experts, int tile_rows, unsigned seed) {
  voltllm::MoeAlignParams p{topk_ids, sorted_pair_ids, tile_experts, num_tiles, num_pairs, num_experts, tile_rows};
  emu::launch(dim3(1), dim3(voltllm::kMoeAlignThreads), voltllm::moe_align_smem_bytes(num_experts),
              [&] { voltllm::moe_align_kernel(p); }, seed);
}

// One expert stage: the decode GEMV (grouped_gemm = 0) or the tensor-core grouped GEMM, gated or down.
void emu_moe_experts(int bf16, int grouped_gemm, int gated, void* out, const void* a, const void* weight,
                     const int* sorted_pair_ids, const int* tile_experts, const int* num_tiles,
                     const float* topk_weights, long long a_stride, int top_k, int n, int k, int max_tiles,
                     unsigned seed) {
  voltllm::MoeExpertParams p{out, a, weight, sorted_pair_ids, tile_experts, num_tiles, topk_weights, a_stride,
                             top_k, n, k};
  emu::dispatch_dtype(bf16, [&](auto t) {
    using T = decltype(t);
    auto run = [&](auto is_gated) {
      constexpr bool kGated = decltype(is_gated)::value;
      if (grouped_gemm) {
        using Traits = voltllm::MoeGemmTraits<kGated>;
        const dim3 grid(max_tiles, (n + Traits::kBlockN - 1) / Traits::kBlockN);
        emu::launch(grid, dim3(32 * Traits::kWarps), Traits::kSmemBytes,
                    [&] { voltllm::moe_grouped_gemm_wmma_kernel<T, kGated>(p); }, seed);
      } else {
        const dim3 grid(max_tiles, (n + voltllm::kMoeGemvWarps - 1) / voltllm::kMoeGemvWarps);
        emu::launch(grid, dim3(32 * voltllm::kMoeGemvWarps), 0,
                    [&] { voltllm::moe_expert_gemv_kernel<T, kGated>(p); }, seed);
      }
    };
    if (gated) {
      run(std::true_type{});
    } else {
      run(std::false_type{});
    }
  });
}

void emu_moe_combine(int bf16, void* out, const float* y, long long out_stride, int num_tokens, int top_k, int n,
                     unsigned seed) {
  voltllm::MoeCombineParams p{out, y, out_stride, num_tokens, top_k, n};
  const dim3 grid(num_tokens, (n + 4 * voltllm::kMoeCombineThreads - 1) / (4 * voltllm::kMoeCombineThreads));
  emu::dispatch_dtype(bf16, [&](auto t) {
    emu::launch(grid, dim3(voltllm::kMoeCombineThreads), 0, [&] { voltllm::moe_combine_kernel<decltype(t)>(p); },
                seed);
  });
}

// One expert stage pair by pair (the decode path of a token or two): gated writes act [pairs, n], down
// writes out [tokens, n], the top-k sum, by moe_pair_down_kernel (down_chunks 0) or the staged kernel
// (12), as the glue launches them.
void emu_moe_pair_experts(int bf16, int gated, void* out, const void* a, const void* weight, const int* topk_ids,
                          const float* topk_weights, long long a_stride, long long out_stride, int num_tokens,
                          int top_k, int n, int k, int down_chunks, unsigned seed) {
  voltllm::MoePairParams p{out, a, weight, topk_ids, topk_weights, a_stride, out_stride, top_k, n, k};
  if (!gated && down_chunks != 0) return run_pair_down_staged(bf16, p, num_tokens, down_chunks, seed);
  const dim3 grid(gated ? num_tokens * top_k : num_tokens, (n + voltllm::kMoePairWarps - 1) / voltllm::kMoePairWarps);
  emu::dispatch_dtype(bf16, [&](auto t) {
    using T = decltype(t);
    emu::launch(grid, dim3(32 * voltllm::kMoePairWarps), 0, [&] {
      if (gated) {
        voltllm::moe_pair_gated_kernel<T>(p);
      } else {
        voltllm::moe_pair_down_kernel<T>(p);
      }
    }, seed);
  });
}

// One quantized expert stage pair by pair (kind: 0 int4, 1 int8, 2 fp8): gated writes act [pairs, n] from
// x (a row per token, or per pair), down writes out [tokens, n], the top-k sum.
void emu_moe_quant_pair_experts(int kind, int gated, void* out, const void* a, const void* weight,
                                const void* group_params, const int* topk_ids, const float* topk_weights,
                                long long a_stride, long long out_stride, int a_rows_per_pair, int num_tokens,
                                int top_k, int n, int k, int num_groups, int chunk_group_shift, unsigned seed) {
  voltllm::MoeQuantPairParams p{out, a, static_cast<const uint4*>(weight), static_cast<const unsigned*>(group_params),
                                topk_ids, topk_weights, a_stride, out_stride, a_rows_per_pair, top_k, n, k,
                                num_groups, chunk_group_shift};
  const int per_block = gated ? voltllm::moe_quant_gated_features_per_block()
                              : voltllm::moe_quant_down_features_per_block();
  const dim3 grid(gated ? num_tokens * top_k : num_tokens, (n + per_block - 1) / per_block);
  auto run = [&](auto kind_c) {
    constexpr int K = decltype(kind_c)::value;
    emu::launch(grid, dim3(32 * voltllm::kMoeQuantPairWarps), 0, [&] {
      if (gated) {
        voltllm::moe_quant_pair_gated_kernel<K>(p);
      } else {
        voltllm::moe_quant_pair_down_kernel<K>(p);
      }
    }, seed);
  };
  switch (kind) {
    case 0: return run(std::integral_constant<int, 0>{});
    case 1: return run(std::integral_constant<int, 1>{});
    case 2: return run(std::integral_constant<int, 2>{});
    default: emu::fail("quantized kind");
  }
}

int emu_moe_tile_rows(int grouped_gemm) {
  return grouped_gemm ? voltllm::MoeGemmTraits<true>::kBlockM : voltllm::kMoeGemvRows;
}

}  // extern "C"
