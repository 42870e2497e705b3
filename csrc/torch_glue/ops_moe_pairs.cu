// Torch glue for the pair-by-pair decode path of the experts (csrc/moe/pair_gemv.cuh): checks, device
// guard, stream and dtype dispatch, and the op's registration (a fragment of the voltllm_C library).
// Grids come from the shapes only, never from the routing (CUDA-graph safe).
#include "torch_glue/torch_glue.h"
#include "moe/pair_gemv.cuh"

namespace voltllm {

using namespace glue;

// One expert stage pair by pair: gated, out = act [pairs, I] from a = x [tokens, H] and weight [E, 2I, H];
// down, out [tokens, H] (the top-k sum, in a's dtype) from a = act [pairs, I] and weight [E, H, I].
void moe_pair_experts(at::Tensor& out, const at::Tensor& a, const at::Tensor& weight, const at::Tensor& topk_ids,
                      const at::Tensor& topk_weights, bool gated) {
  const char* op = "moe_pair_experts";
  check_cuda(a, "a");
  check_cuda(weight, "weight");
  check_cuda(out, "out");
  check_cuda(topk_ids, "topk_ids");
  check_cuda(topk_weights, "topk_weights");
  check_dtype(a, op);
  check_same_dtype(a, weight, op);
  check_same_dtype(a, out, op);
  TORCH_CHECK(weight.dim() == 3 && weight.is_contiguous() && reinterpret_cast<uintptr_t>(weight.data_ptr()) % 16 == 0,
              op, ": weight must be a contiguous, 16-byte aligned [experts, n, k]");
  TORCH_CHECK(topk_ids.scalar_type() == at::kInt && topk_ids.dim() == 2 && topk_ids.is_contiguous(), op,
              ": topk_ids must be a contiguous int32 [tokens, top_k]");
  TORCH_CHECK(topk_weights.scalar_type() == at::kFloat && topk_weights.sizes() == topk_ids.sizes() &&
                  topk_weights.is_contiguous(),
              op, ": topk_weights must be a contiguous float32 [tokens, top_k]");
  const int64_t tokens = topk_ids.size(0), top_k = topk_ids.size(1), pairs = tokens * top_k;
  const int64_t k = weight.size(2), n = gated ? weight.size(1) / 2 : weight.size(1);
  TORCH_CHECK(!gated || weight.size(1) % 2 == 0, op, ": the gated stage needs [experts, 2n, k] gate/up weights");
  TORCH_CHECK(k % 8 == 0 && n % 8 == 0, op, ": n (", num(n), ") and k (", num(k), ") must be multiples of 8");
  TORCH_CHECK(top_k >= 1 && top_k <= kMoeMaxTopK && top_k <= weight.size(0), op, ": top_k ", num(top_k),
              " out of range");
  TORCH_CHECK(a.dim() == 2 && a.size(1) == k && a.stride(1) == 1 && a.stride(0) % 8 == 0 &&
                  reinterpret_cast<uintptr_t>(a.data_ptr()) % 16 == 0,
              op, ": a must be [rows, ", num(k), "] with contiguous, 16-byte aligned rows");
  TORCH_CHECK(a.size(0) == (gated ? tokens : pairs), op, ": a has ", num(a.size(0)), " rows, expected ",
              num(gated ? tokens : pairs));
  TORCH_CHECK(out.dim() == 2 && out.size(0) == (gated ? pairs : tokens) && out.size(1) == n && out.stride(1) == 1,
              op, ": out must be [", gated ? "pairs" : "tokens", ", ", num(n), "] with contiguous rows");
  TORCH_CHECK(!gated || out.is_contiguous(), op, ": act must be contiguous");
  if (pairs == 0) return;
  const at::cuda::OptionalCUDAGuard guard(a.device());
  MoePairParams p{};
  p.out = out.data_ptr();
  p.a = a.data_ptr();
  p.weight = weight.data_ptr();
  p.topk_ids = topk_ids.data_ptr<int>();
  p.topk_weights = topk_weights.data_ptr<float>();
  p.a_stride = a.stride(0);
  p.out_stride = out.stride(0);
  p.top_k = static_cast<int>(top_k);
  p.n = static_cast<int>(n);
  p.k = static_cast<int>(k);
  const auto stream = at::cuda::getCurrentCUDAStream();
  const dim3 grid(static_cast<unsigned>(gated ? pairs : tokens),
                  static_cast<unsigned>((n + kMoePairWarps - 1) / kMoePairWarps));
  dispatch_dtype(a.scalar_type(), op, [&](auto t) {
    using T = decltype(t);
    if (gated) {
      launch(moe_pair_gated_kernel<T>, grid, 32 * kMoePairWarps, 0, stream, p);
    } else {
      launch(moe_pair_down_kernel<T>, grid, 32 * kMoePairWarps, 0, stream, p);
    }
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace voltllm

TORCH_LIBRARY_FRAGMENT(voltllm_C, m) {
  m.def(
      "moe_pair_experts(Tensor(a!) out, Tensor a, Tensor weight, Tensor topk_ids, Tensor topk_weights, "
      "bool gated) -> ()");
}

TORCH_LIBRARY_IMPL(voltllm_C, CUDA, m) { m.impl("moe_pair_experts", &voltllm::moe_pair_experts); }
