// Torch glue for the mixture-of-experts kernels (csrc/moe/): checks, device guard, stream, dtype and
// stage dispatch. Grids are sized from the buffers the Python side allocates for the worst case, never
// from the routing, so no launch here reads the device (CUDA-graph safe).
#include <algorithm>
#include <type_traits>

#include "torch_glue/torch_glue.h"
#include "torch_glue/moe_glue.h"
#include "moe/align.cuh"
#include "moe/combine.cuh"
#include "moe/expert_gemv.cuh"
#include "moe/grouped_gemm_wmma.cuh"
#include "moe/topk_softmax.cuh"

namespace voltllm {

using namespace glue;
using namespace moe_glue;

void moe_topk_softmax(at::Tensor& topk_weights, at::Tensor& topk_ids, const at::Tensor& router_logits,
                      bool renormalize) {
  const char* op = "moe_topk_softmax";
  check_cuda(router_logits, "router_logits");
  check_dtype(router_logits, op);
  TORCH_CHECK(router_logits.dim() == 2 && router_logits.stride(1) == 1, op,
              ": router_logits must be [tokens, num_experts] with contiguous rows");
  const int64_t tokens = router_logits.size(0), experts = router_logits.size(1), top_k = topk_ids.size(-1);
  TORCH_CHECK(experts >= 1 && experts <= kMoeMaxExperts, op, ": ", num(experts), " experts (1..",
              num(kMoeMaxExperts), ")");
  TORCH_CHECK(top_k >= 1 && top_k <= experts && top_k <= kMoeMaxTopK, op, ": top_k ", num(top_k), " out of range");
  check_cuda(topk_weights, "topk_weights");
  check_cuda(topk_ids, "topk_ids");
  TORCH_CHECK(topk_weights.scalar_type() == at::kFloat && topk_ids.scalar_type() == at::kInt, op,
              ": topk_weights must be float32 and topk_ids int32");
  TORCH_CHECK(topk_weights.dim() == 2 && topk_weights.size(0) == tokens && topk_weights.size(1) == top_k &&
                  topk_weights.is_contiguous() && topk_ids.sizes() == topk_weights.sizes() && topk_ids.is_contiguous(),
              op, ": topk_weights and topk_ids must be contiguous [tokens, top_k]");
  if (tokens == 0) return;
  const at::cuda::OptionalCUDAGuard guard(router_logits.device());
  MoeTopkParams p{};
  p.topk_weights = topk_weights.data_ptr<float>();
  p.topk_ids = topk_ids.data_ptr<int>();
  p.logits = router_logits.data_ptr();
  p.logits_stride = router_logits.stride(0);
  p.num_tokens = static_cast<int>(tokens);
  p.num_experts = static_cast<int>(experts);
  p.top_k = static_cast<int>(top_k);
  p.renormalize = renormalize ? 1 : 0;
  const auto stream = at::cuda::getCurrentCUDAStream();
  const int blocks = static_cast<int>((tokens + kMoeTopkWarps - 1) / kMoeTopkWarps);
  dispatch_dtype(router_logits.scalar_type(), op, [&](auto t) {
    launch(moe_topk_softmax_kernel<decltype(t)>, blocks, 32 * kMoeTopkWarps, 0, stream, p);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void moe_align(at::Tensor& sorted_pair_ids, at::Tensor& tile_experts, at::Tensor& num_tiles,
               const at::Tensor& topk_ids, int64_t num_experts, int64_t tile_rows) {
  const char* op = "moe_align";
  check_cuda(topk_ids, "topk_ids");
  TORCH_CHECK(topk_ids.scalar_type() == at::kInt && topk_ids.is_contiguous(), op,
              ": topk_ids must be a contiguous int32 tensor");
  check_int32_vector(sorted_pair_ids, "sorted_pair_ids", op);
  check_int32_vector(tile_experts, "tile_experts", op);
  check_int32_vector(num_tiles, "num_tiles", op);
  TORCH_CHECK(num_experts >= 1 && num_experts <= kMoeMaxExperts, op, ": ", num(num_experts), " experts (1..",
              num(kMoeMaxExperts), ")");
  TORCH_CHECK(tile_rows >= 1, op, ": tile_rows must be positive");
  TORCH_CHECK(sorted_pair_ids.numel() == tile_experts.numel() * tile_rows && num_tiles.numel() == 1, op,
              ": sorted_pair_ids must hold tile_rows slots per tile, num_tiles one entry");
  const int64_t pairs = topk_ids.numel();
  // Enough tiles for the worst case (moe_max_tiles): every used expert padded to whole tiles.
  const int64_t used = std::min<int64_t>(num_experts, pairs);
  TORCH_CHECK(tile_experts.numel() >= std::min<int64_t>(pairs, (pairs + used * (tile_rows - 1)) / tile_rows), op,
              ": tile_experts holds fewer tiles than the routing can fill");
  const at::cuda::OptionalCUDAGuard guard(topk_ids.device());
  MoeAlignParams p{};
  p.topk_ids = topk_ids.data_ptr<int>();
  p.sorted_pair_ids = sorted_pair_ids.data_ptr<int>();
  p.tile_experts = tile_experts.data_ptr<int>();
  p.num_tiles = num_tiles.data_ptr<int>();
  p.num_pairs = static_cast<int>(pairs);
  p.num_experts = static_cast<int>(num_experts);
  p.tile_rows = static_cast<int>(tile_rows);
  const auto stream = at::cuda::getCurrentCUDAStream();
  launch(moe_align_kernel, 1, kMoeAlignThreads, moe_align_smem_bytes(p.num_experts), stream, p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

int64_t moe_tile_rows(bool grouped_gemm) {
  return grouped_gemm ? MoeGemmTraits<true>::kBlockM : kMoeGemvRows;
}

// One expert stage (see moe_params.cuh): gated, out = act [slots, I] from a = x [tokens, H] and weight
// [E, 2I, H]; down, out = y [pairs, H] fp32 from a = act and weight [E, H, I].
void moe_experts(at::Tensor& out, const at::Tensor& a, const at::Tensor& weight, const at::Tensor& sorted_pair_ids,
                 const at::Tensor& tile_experts, const at::Tensor& num_tiles, const at::Tensor& topk_weights,
                 int64_t top_k, bool gated, bool grouped_gemm) {
  const char* op = "moe_experts";
  check_cuda(a, "a");
  check_cuda(weight, "weight");
  check_dtype(a, op);
  check_same_dtype(a, weight, op);
  check_int32_vector(sorted_pair_ids, "sorted_pair_ids", op);
  check_int32_vector(tile_experts, "tile_experts", op);
  check_int32_vector(num_tiles, "num_tiles", op);
  TORCH_CHECK(weight.dim() == 3 && weight.is_contiguous() && reinterpret_cast<uintptr_t>(weight.data_ptr()) % 16 == 0,
              op, ": weight must be a contiguous, 16-byte aligned [experts, n, k]");
  const int64_t k = weight.size(2), n = gated ? weight.size(1) / 2 : weight.size(1);
  const int64_t tile_rows = moe_tile_rows(grouped_gemm), max_tiles = tile_experts.numel();
  TORCH_CHECK(!gated || weight.size(1) % 2 == 0, op, ": the gated stage needs [experts, 2n, k] gate/up weights");
  TORCH_CHECK(k % 8 == 0 && n % 8 == 0, op, ": n (", num(n), ") and k (", num(k), ") must be multiples of 8");
  TORCH_CHECK(sorted_pair_ids.numel() == max_tiles * tile_rows, op, ": sorted_pair_ids must hold ", num(tile_rows),
              " slots per tile");
  TORCH_CHECK(top_k >= 1 && top_k <= kMoeMaxTopK, op, ": top_k ", num(top_k), " out of range");
  check_cuda(topk_weights, "topk_weights");
  TORCH_CHECK(topk_weights.scalar_type() == at::kFloat && topk_weights.dim() == 1 && topk_weights.is_contiguous(), op,
              ": topk_weights must be a contiguous float32 [pairs]");
  const int64_t pairs = topk_weights.numel();
  check_contiguous_rows(out, n, "out", op);
  if (gated) {
    TORCH_CHECK(a.dim() == 2 && a.size(1) == k && a.stride(1) == 1 && a.stride(0) % 8 == 0 &&
                    reinterpret_cast<uintptr_t>(a.data_ptr()) % 16 == 0,
                op, ": x must be [tokens, k] with contiguous, 16-byte aligned rows");
    TORCH_CHECK(a.size(0) * top_k == pairs, op, ": x has ", num(a.size(0)), " tokens for ", num(pairs), " pairs");
    check_same_dtype(a, out, op);
    TORCH_CHECK(out.size(0) == max_tiles * tile_rows, op, ": act must have one row per slot");
  } else {
    check_contiguous_rows(a, k, "act", op);
    TORCH_CHECK(a.size(0) == max_tiles * tile_rows, op, ": act must have one row per slot");
    TORCH_CHECK(out.scalar_type() == at::kFloat && out.size(0) == pairs, op, ": y must be float32 [pairs, n]");
  }
  if (grouped_gemm && a.scalar_type() == at::kBFloat16) check_tensor_core_dtype(a.scalar_type(), op);
  if (pairs == 0) return;
  const at::cuda::OptionalCUDAGuard guard(a.device());
  MoeExpertParams p{};
  p.out = out.data_ptr();
  p.a = a.data_ptr();
  p.weight = weight.data_ptr();
  p.sorted_pair_ids = sorted_pair_ids.data_ptr<int>();
  p.tile_experts = tile_experts.data_ptr<int>();
  p.num_tiles = num_tiles.data_ptr<int>();
  p.topk_weights = topk_weights.data_ptr<float>();
  p.a_stride = a.stride(0);
  p.top_k = static_cast<int>(top_k);
  p.n = static_cast<int>(n);
  p.k = static_cast<int>(k);
  const auto stream = at::cuda::getCurrentCUDAStream();
  dispatch_dtype(a.scalar_type(), op, [&](auto t) {
    using T = decltype(t);
    auto run = [&](auto is_gated) {
      constexpr bool kGated = decltype(is_gated)::value;
      if (grouped_gemm) {
        using Traits = MoeGemmTraits<kGated>;
        const dim3 grid(static_cast<unsigned>(max_tiles), static_cast<unsigned>((n + Traits::kBlockN - 1) / Traits::kBlockN));
        launch(moe_grouped_gemm_wmma_kernel<T, kGated>, grid, 32 * Traits::kWarps, Traits::kSmemBytes, stream, p);
      } else {
        const dim3 grid(static_cast<unsigned>(max_tiles), static_cast<unsigned>((n + kMoeGemvWarps - 1) / kMoeGemvWarps));
        launch(moe_expert_gemv_kernel<T, kGated>, grid, 32 * kMoeGemvWarps, 0, stream, p);
      }
    };
    if (gated)
      run(std::true_type{});
    else
      run(std::false_type{});
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void moe_combine(at::Tensor& out, const at::Tensor& y, int64_t top_k) {
  const char* op = "moe_combine";
  check_cuda(out, "out");
  check_dtype(out, op);
  TORCH_CHECK(out.dim() == 2 && out.stride(1) == 1 && out.stride(0) % 8 == 0 &&
                  reinterpret_cast<uintptr_t>(out.data_ptr()) % 16 == 0,
              op, ": out must be [tokens, n] with contiguous, 16-byte aligned rows");
  const int64_t tokens = out.size(0), n = out.size(1);
  TORCH_CHECK(top_k >= 1, op, ": top_k must be positive");
  check_contiguous_rows(y, n, "y", op);
  TORCH_CHECK(y.scalar_type() == at::kFloat && y.size(0) == tokens * top_k, op, ": y must be float32 [tokens * top_k, n]");
  TORCH_CHECK(n % 4 == 0, op, ": n must be a multiple of 4");
  if (tokens == 0) return;
  const at::cuda::OptionalCUDAGuard guard(out.device());
  MoeCombineParams p{};
  p.out = out.data_ptr();
  p.y = y.data_ptr<float>();
  p.out_stride = out.stride(0);
  p.num_tokens = static_cast<int>(tokens);
  p.top_k = static_cast<int>(top_k);
  p.n = static_cast<int>(n);
  const auto stream = at::cuda::getCurrentCUDAStream();
  const dim3 grid(static_cast<unsigned>(tokens), static_cast<unsigned>((n + 4 * kMoeCombineThreads - 1) / (4 * kMoeCombineThreads)));
  dispatch_dtype(out.scalar_type(), op, [&](auto t) {
    launch(moe_combine_kernel<decltype(t)>, grid, kMoeCombineThreads, 0, stream, p);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace voltllm
