// Torch glue for the decode path of a sparse block (csrc/moe/route.cuh: add + norm + router + top-k in
// one launch; csrc/moe/pair_gemv.cuh: the experts pair by pair): checks, device guard, stream and dtype
// dispatch, and the ops' registration (a fragment of the voltllm_C library). Grids come from the shapes
// only, never from the routing (CUDA-graph safe).
#include <initializer_list>

#include "torch_glue/torch_glue.h"
#include "moe/pair_gemv.cuh"
#include "moe/route.cuh"

namespace voltllm {

using namespace glue;

namespace {

using Tensors = std::initializer_list<const at::Tensor*>;

// Whether two contiguous tensors share bytes (the aliasing check of moe_route). Its own name: another
// branch adds a general glue::overlap to torch_glue.h, and `using namespace glue` would make one name
// ambiguous; once that lands this can go.
bool contiguous_overlap(const at::Tensor& a, const at::Tensor& b) {
  const auto a0 = reinterpret_cast<uintptr_t>(a.data_ptr()), b0 = reinterpret_cast<uintptr_t>(b.data_ptr());
  const auto a1 = a0 + a.numel() * a.element_size(), b1 = b0 + b.numel() * b.element_size();
  return a0 < b1 && b0 < a1;
}

}  // namespace

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

// normed_out, residual_out = rms_norm(hidden + residual) (the new residual unnormed); logits = normed @
// gate_weight^T in hidden's dtype; topk_weights / topk_ids = the top-k softmax of each row's logits.
// counter: one int32, 0 (the kernel leaves it 0 again). One launch for up to kMoeRouteMaxRows rows.
void moe_route(at::Tensor& normed_out, at::Tensor& residual_out, at::Tensor& logits, at::Tensor& topk_weights,
               at::Tensor& topk_ids, at::Tensor& counter, const at::Tensor& hidden, const at::Tensor& residual,
               const at::Tensor& norm_weight, double eps, const at::Tensor& gate_weight, bool renormalize) {
  const char* op = "moe_route";
  for (const at::Tensor* t : Tensors{&normed_out, &residual_out, &logits, &topk_weights, &topk_ids, &counter, &hidden,
                              &residual, &norm_weight, &gate_weight}) {
    check_cuda(*t, "moe_route's tensors");
  }
  check_dtype(hidden, op);
  for (const at::Tensor* t : Tensors{&normed_out, &residual_out, &logits, &residual, &norm_weight, &gate_weight}) {
    check_same_dtype(hidden, *t, op);
  }
  TORCH_CHECK(hidden.dim() == 2 && hidden.is_contiguous(), op, ": hidden must be a contiguous [rows, k]");
  const int64_t rows = hidden.size(0), k = hidden.size(1);
  TORCH_CHECK(rows >= 1 && rows <= kMoeRouteMaxRows, op, ": ", num(rows), " rows (1..", num(kMoeRouteMaxRows), ")");
  TORCH_CHECK(k % 8 == 0 && k <= kGemvNormMaxK, op, ": hidden size ", num(k), " must be a multiple of 8, at most ",
              num(kGemvNormMaxK));
  for (const at::Tensor* t : Tensors{&residual, &residual_out, &normed_out}) {
    TORCH_CHECK(t->sizes() == hidden.sizes() && t->is_contiguous(), op,
                ": residual, residual_out and normed_out must be contiguous and shaped like hidden");
  }
  TORCH_CHECK(norm_weight.dim() == 1 && norm_weight.size(0) == k && norm_weight.is_contiguous(), op,
              ": norm_weight must be a contiguous [k]");
  TORCH_CHECK(gate_weight.dim() == 2 && gate_weight.size(1) == k && gate_weight.is_contiguous(), op,
              ": gate_weight must be a contiguous [num_experts, k]");
  const int64_t experts = gate_weight.size(0), top_k = topk_ids.size(-1);
  TORCH_CHECK(experts >= 1 && experts <= kMoeMaxExperts, op, ": ", num(experts), " experts (1..",
              num(kMoeMaxExperts), ")");
  TORCH_CHECK(top_k >= 1 && top_k <= experts && top_k <= kMoeMaxTopK, op, ": top_k ", num(top_k), " out of range");
  TORCH_CHECK(logits.dim() == 2 && logits.size(0) == rows && logits.size(1) == experts && logits.is_contiguous(), op,
              ": logits must be a contiguous [rows, num_experts]");
  TORCH_CHECK(topk_weights.scalar_type() == at::kFloat && topk_ids.scalar_type() == at::kInt &&
                  topk_weights.dim() == 2 && topk_weights.size(0) == rows && topk_weights.is_contiguous() &&
                  topk_ids.sizes() == topk_weights.sizes() && topk_ids.is_contiguous(),
              op, ": topk_weights (float32) and topk_ids (int32) must be contiguous [rows, top_k]");
  TORCH_CHECK(counter.scalar_type() == at::kInt && counter.numel() == 1, op, ": counter must be one int32");
  for (const at::Tensor* t : Tensors{&hidden, &residual, &residual_out, &normed_out, &norm_weight, &gate_weight}) {
    TORCH_CHECK(reinterpret_cast<uintptr_t>(t->data_ptr()) % 16 == 0, op, ": rows must be 16-byte aligned");
  }
  // Block 0 writes residual_out and normed_out while other blocks still read hidden and residual.
  TORCH_CHECK(!contiguous_overlap(residual_out, residual) && !contiguous_overlap(residual_out, hidden) &&
                  !contiguous_overlap(normed_out, residual) && !contiguous_overlap(normed_out, hidden) &&
                  !contiguous_overlap(normed_out, residual_out),
              op, ": normed_out and residual_out must not overlap each other, hidden or residual");
  const at::cuda::OptionalCUDAGuard guard(hidden.device());
  MoeRouteParams p{};
  p.norm.out = logits.data_ptr();
  p.norm.residual_out = residual_out.data_ptr();
  p.norm.hidden = hidden.data_ptr();
  p.norm.residual_in = residual.data_ptr();
  p.norm.norm_weight = norm_weight.data_ptr();
  p.norm.weight = gate_weight.data_ptr();
  p.norm.bias = nullptr;
  p.norm.out_stride = experts;
  p.norm.residual_out_stride = k;
  p.norm.hidden_stride = k;
  p.norm.residual_in_stride = k;
  p.norm.eps = static_cast<float>(eps);
  p.norm.rows = static_cast<int>(rows);
  p.norm.n = static_cast<int>(experts);
  p.norm.k = static_cast<int>(k);
  p.normed_out = normed_out.data_ptr();
  p.topk.topk_weights = topk_weights.data_ptr<float>();
  p.topk.topk_ids = topk_ids.data_ptr<int>();
  p.topk.logits = logits.data_ptr();
  p.topk.logits_stride = experts;
  p.topk.num_tokens = static_cast<int>(rows);
  p.topk.num_experts = static_cast<int>(experts);
  p.topk.top_k = static_cast<int>(top_k);
  p.topk.renormalize = renormalize ? 1 : 0;
  p.counter = counter.data_ptr<int>();
  const auto stream = at::cuda::getCurrentCUDAStream();
  const int blocks = static_cast<int>((experts + kGemvNormWarps - 1) / kGemvNormWarps);
  const int smem = gemv_norm_smem_bytes(static_cast<int>(rows), static_cast<int>(k));
  dispatch_dtype(hidden.scalar_type(), op, [&](auto t) {
    using T = decltype(t);
    if (rows == 1) {
      launch(moe_route_kernel<T, 1>, blocks, 32 * kGemvNormWarps, smem, stream, p);
    } else {
      launch(moe_route_kernel<T, 2>, blocks, 32 * kGemvNormWarps, smem, stream, p);
    }
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace voltllm

TORCH_LIBRARY_FRAGMENT(voltllm_C, m) {
  m.def(
      "moe_pair_experts(Tensor(a!) out, Tensor a, Tensor weight, Tensor topk_ids, Tensor topk_weights, "
      "bool gated) -> ()");
  m.def(
      "moe_route(Tensor(a!) normed_out, Tensor(b!) residual_out, Tensor(c!) logits, Tensor(d!) topk_weights, "
      "Tensor(e!) topk_ids, Tensor(f!) counter, Tensor hidden, Tensor residual, Tensor norm_weight, float eps, "
      "Tensor gate_weight, bool renormalize) -> ()");
}

TORCH_LIBRARY_IMPL(voltllm_C, CUDA, m) {
  m.impl("moe_pair_experts", &voltllm::moe_pair_experts);
  m.impl("moe_route", &voltllm::moe_route);
}
