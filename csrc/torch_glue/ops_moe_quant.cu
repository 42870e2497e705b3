// Torch glue for the quantized experts' decode path (csrc/moe/quant_pair_gemv.cuh: pair by pair): checks,
// device guard, stream and kind dispatch, and the op's registration (a fragment of the voltllm_C library). Grids come
// from the shapes only, never from the routing (CUDA-graph safe).
#include "torch_glue/moe_glue.h"
#include "moe/quant_pair_gemv.cuh"

namespace voltllm {

using namespace glue;
using namespace moe_glue;

// One quantized expert stage pair by pair. Gated: out = act [pairs, I] from a = x (a row per token, or
// with a_rows_per_pair a row per pair) and weight [E, 2I, H]; down: out [tokens, H] (the top-k sum) from
// a = act [pairs, I] (a row per pair: a_rows_per_pair must be true) and weight [E, H, I]. fp16 activations.
void moe_quant_pair_experts(at::Tensor& out, const at::Tensor& a, const at::Tensor& weight,
                            const at::Tensor& group_params, const at::Tensor& topk_ids,
                            const at::Tensor& topk_weights, int64_t kind, int64_t group_size, bool gated,
                            bool a_rows_per_pair) {
  const char* op = "moe_quant_pair_experts";
  const StackedShape shape = check_stacked(weight, group_params, kind, group_size, op);
  check_cuda(a, "a");
  check_cuda(out, "out");
  check_cuda(topk_ids, "topk_ids");
  check_cuda(topk_weights, "topk_weights");
  TORCH_CHECK(a.scalar_type() == at::kHalf && out.scalar_type() == at::kHalf, op,
              ": a and out must be float16 (the quantized kernels' activations)");
  TORCH_CHECK(topk_ids.scalar_type() == at::kInt && topk_ids.dim() == 2 && topk_ids.is_contiguous(), op,
              ": topk_ids must be a contiguous int32 [tokens, top_k]");
  TORCH_CHECK(topk_weights.scalar_type() == at::kFloat && topk_weights.sizes() == topk_ids.sizes() &&
                  topk_weights.is_contiguous(),
              op, ": topk_weights must be a contiguous float32 [tokens, top_k]");
  TORCH_CHECK(gated || a_rows_per_pair, op, ": the down stage's input is a row per pair (a_rows_per_pair)");
  const int64_t tokens = topk_ids.size(0), top_k = topk_ids.size(1), pairs = tokens * top_k;
  TORCH_CHECK(!gated || shape.rows % 2 == 0, op, ": the gated stage needs [experts, 2n, k] gate/up weights");
  const int64_t n = gated ? shape.rows / 2 : shape.rows, k = shape.k;
  TORCH_CHECK(top_k >= 1 && top_k <= kMoeMaxTopK && top_k <= shape.experts, op, ": top_k ", num(top_k),
              " out of range");
  TORCH_CHECK(a.dim() == 2 && a.size(1) == k && a.stride(1) == 1 && vec8_ok(a, k), op, ": a must be [rows, ",
              num(k), "] with contiguous, 16-byte aligned rows");
  const int64_t a_rows = a_rows_per_pair ? pairs : tokens;
  TORCH_CHECK(a.size(0) == a_rows, op, ": a has ", num(a.size(0)), " rows, expected ", num(a_rows));
  TORCH_CHECK(out.dim() == 2 && out.size(0) == (gated ? pairs : tokens) && out.size(1) == n && out.stride(1) == 1,
              op, ": out must be [", gated ? "pairs" : "tokens", ", ", num(n), "] with contiguous rows");
  TORCH_CHECK(!gated || out.is_contiguous(), op, ": act must be contiguous");
  if (pairs == 0) return;
  const at::cuda::OptionalCUDAGuard guard(a.device());
  MoeQuantPairParams p{};
  p.out = out.data_ptr();
  p.a = a.data_ptr();
  p.weight = reinterpret_cast<const uint4*>(weight.data_ptr());
  p.group_params = reinterpret_cast<const unsigned*>(group_params.data_ptr());
  p.topk_ids = topk_ids.data_ptr<int>();
  p.topk_weights = topk_weights.data_ptr<float>();
  p.a_stride = a.stride(0);
  p.out_stride = out.stride(0);
  p.a_rows_per_pair = a_rows_per_pair ? 1 : 0;
  p.top_k = static_cast<int>(top_k);
  p.n = static_cast<int>(n);
  p.k = static_cast<int>(k);
  p.num_groups = static_cast<int>(shape.num_groups);
  p.chunk_group_shift = static_cast<int>(shape.chunk_group_shift);
  const auto stream = at::cuda::getCurrentCUDAStream();
  const int64_t per_block = gated ? moe_quant_gated_features_per_block() : moe_quant_down_features_per_block();
  const dim3 grid(static_cast<unsigned>(gated ? pairs : tokens), static_cast<unsigned>((n + per_block - 1) / per_block));
  dispatch_kind(kind, op, [&](auto kind_c) {
    constexpr int K = decltype(kind_c)::value;
    if (gated) {
      launch(moe_quant_pair_gated_kernel<K>, grid, 32 * kMoeQuantPairWarps, 0, stream, p);
    } else {
      launch(moe_quant_pair_down_kernel<K>, grid, 32 * kMoeQuantPairWarps, 0, stream, p);
    }
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace voltllm

TORCH_LIBRARY_FRAGMENT(voltllm_C, m) {
  m.def(
      "moe_quant_pair_experts(Tensor(a!) out, Tensor a, Tensor weight, Tensor group_params, Tensor topk_ids, "
      "Tensor topk_weights, int kind, int group_size, bool gated, bool a_rows_per_pair) -> ()");
}

TORCH_LIBRARY_IMPL(voltllm_C, CUDA, m) { m.impl("moe_quant_pair_experts", &voltllm::moe_quant_pair_experts); }
