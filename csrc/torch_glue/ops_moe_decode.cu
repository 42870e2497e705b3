// Torch glue for the decode path of a sparse block (csrc/moe/pair_gemv.cuh: the experts pair by pair):
// checks, device guard, stream and dtype dispatch, and the ops' registration (a fragment of the voltllm_C
// library). Grids come from the shapes only, never from the routing (CUDA-graph safe).
#include "torch_glue/torch_glue.h"
#include "moe/pair_gemv.cuh"

namespace voltllm {

using namespace glue;

namespace {  // this file's helpers

// Checks one pair stage's tensors, the routing's shape given (tokens, top_k): gated, out = act [pairs, n]
// from a = x [tokens, k] and weight [E, 2n, k]; down, out [tokens, n] from a = act [pairs, k] and weight
// [E, n, k]. Returns the params of the stage, its routing fields left to the caller.
MoePairParams check_pair_stage(at::Tensor& out, const at::Tensor& a, const at::Tensor& weight, int64_t tokens,
                               int64_t top_k, bool gated, int64_t down_chunks, const char* op) {
  check_cuda(a, "a");
  check_cuda(weight, "weight");
  check_cuda(out, "out");
  check_dtype(a, op);
  check_same_dtype(a, weight, op);
  check_same_dtype(a, out, op);
  TORCH_CHECK(weight.dim() == 3 && weight.is_contiguous() && reinterpret_cast<uintptr_t>(weight.data_ptr()) % 16 == 0,
              op, ": weight must be a contiguous, 16-byte aligned [experts, n, k]");
  const int64_t pairs = tokens * top_k;
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
  TORCH_CHECK(down_chunks == 0 || down_chunks == 12, op, ": down_chunks must be 0 (the unstaged down stage) or 12, got ",
              num(down_chunks));
  TORCH_CHECK(!gated || down_chunks == 0, op, ": down_chunks applies to the down stage only, got ", num(down_chunks),
              " with gated=True");
  if (!gated && down_chunks != 0) {
    const int64_t smem = moe_pair_staged_smem_bytes(static_cast<int>(top_k), static_cast<int>(k));
    TORCH_CHECK(k > 0, op, ": the staged down stage needs k > 0");
    TORCH_CHECK(smem <= kMoePairStagedMaxSmem, op, ": the staged down stage holds top_k * k / 8 chunks of 20 ",
                "bytes in shared memory: top_k ", num(top_k), " x k ", num(k), " needs ", num(smem), " bytes, over ",
                num(kMoePairStagedMaxSmem), "; use down_chunks=0");
    TORCH_CHECK(weight.numel() / 8 < (int64_t{1} << 32), op, ": the staged down stage indexes the weight stack in ",
                "32-bit 16-byte chunks; this one has ", num(weight.numel() / 8), "; use down_chunks=0");
  }
  MoePairParams p{};
  p.out = out.data_ptr();
  p.a = a.data_ptr();
  p.weight = weight.data_ptr();
  p.a_stride = a.stride(0);
  p.out_stride = out.stride(0);
  p.top_k = static_cast<int>(top_k);
  p.n = static_cast<int>(n);
  p.k = static_cast<int>(k);
  return p;
}

// Launches the down stage's staged kernel, moe_pair_down_staged_kernel<T, 12>.
template <typename T>
void launch_pair_down_staged(const MoePairParams& p, int64_t tokens, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(tokens),
                  static_cast<unsigned>((p.n + kMoePairStagedWarps - 1) / kMoePairStagedWarps));
  const int smem = moe_pair_staged_smem_bytes(p.top_k, p.k);
  launch(moe_pair_down_staged_kernel<T, 12>, grid, 32 * kMoePairStagedWarps, smem, stream, p);
}

// The grid of the gated stage and of moe_pair_down_kernel: (pairs or tokens, feature groups of 4).
dim3 pair_stage_grid(const MoePairParams& p, int64_t tokens, bool gated) {
  return dim3(static_cast<unsigned>(gated ? tokens * p.top_k : tokens),
              static_cast<unsigned>((p.n + kMoePairWarps - 1) / kMoePairWarps));
}

}  // namespace

// One expert stage pair by pair, the routing given (topk_ids [tokens, top_k] int32, topk_weights fp32):
// gated, out = act [pairs, I] from a = x [tokens, H] and weight [E, 2I, H]; down, out [tokens, H] (the
// top-k sum, in a's dtype) from a = act [pairs, I] and weight [E, H, I], by moe_pair_down_kernel
// (down_chunks 0) or the staged kernel with down_chunks 16-byte loads per lane in flight (12).
void moe_pair_experts(at::Tensor& out, const at::Tensor& a, const at::Tensor& weight, const at::Tensor& topk_ids,
                      const at::Tensor& topk_weights, bool gated, int64_t down_chunks) {
  const char* op = "moe_pair_experts";
  check_cuda(topk_ids, "topk_ids");
  check_cuda(topk_weights, "topk_weights");
  TORCH_CHECK(topk_ids.scalar_type() == at::kInt && topk_ids.dim() == 2 && topk_ids.is_contiguous(), op,
              ": topk_ids must be a contiguous int32 [tokens, top_k]");
  TORCH_CHECK(topk_weights.scalar_type() == at::kFloat && topk_weights.sizes() == topk_ids.sizes() &&
                  topk_weights.is_contiguous(),
              op, ": topk_weights must be a contiguous float32 [tokens, top_k]");
  const int64_t tokens = topk_ids.size(0);
  MoePairParams p = check_pair_stage(out, a, weight, tokens, topk_ids.size(1), gated, down_chunks, op);
  if (tokens == 0) return;
  const at::cuda::OptionalCUDAGuard guard(a.device());
  p.topk_ids = topk_ids.data_ptr<int>();
  p.topk_weights = topk_weights.data_ptr<float>();
  const auto stream = at::cuda::getCurrentCUDAStream();
  dispatch_dtype(a.scalar_type(), op, [&](auto t) {
    using T = decltype(t);
    if (gated) {
      launch(moe_pair_gated_kernel<T>, pair_stage_grid(p, tokens, true), 32 * kMoePairWarps, 0, stream, p);
    } else if (down_chunks == 0) {
      launch(moe_pair_down_kernel<T>, pair_stage_grid(p, tokens, false), 32 * kMoePairWarps, 0, stream, p);
    } else {
      launch_pair_down_staged<T>(p, tokens, stream);
    }
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace voltllm

TORCH_LIBRARY_FRAGMENT(voltllm_C, m) {
  m.def(
      "moe_pair_experts(Tensor(a!) out, Tensor a, Tensor weight, Tensor topk_ids, Tensor topk_weights, "
      "bool gated, int down_chunks=0) -> ()");
}

TORCH_LIBRARY_IMPL(voltllm_C, CUDA, m) {
  m.impl("moe_pair_experts", &voltllm::moe_pair_experts);
}
