// The decode path of quantized experts (AWQ, GPTQ, compressed-tensors int4 / int8, fp8 as W8A16):
// pair_gemv.cuh's two stages, pair by pair, with each selected expert's packed weights
// (quantization/quant_common.cuh's layout) read once and dequantized in registers.
//
// The arithmetic is the quantized GEMV's (quantization/quant_gemv.cuh): its step loads (a warp's weight
// rows and their group words, UNROLL chunks per lane in flight), its chunk products (fp16 pairs summed
// 8 per fp16 value, then fp32) and, for the gated stage, its SwiGLU epilogue (both projections rounded
// to fp16 first, as the unfused layer stores them). What this file adds is where the rows come from: the
// expert of each pair, read from the routing on the device, so nothing reaches the host and a decode step
// captures in a CUDA graph.
// - Gated stage, grid (pair, feature groups): act[pair] = silu(x . gate_f) * (x . up_f) of the pair's
//   expert, one warp per feature (its gate row and its up row).
// - Down stage, grid (token, feature groups): out[token, f] = sum_j weight_j * (act[pair_j] . down_f) over
//   the token's k pairs in fp32, rounded once; IN_FLIGHT pairs' rows are loaded together, since a down
//   row is short (Qwen3-30B-A3B: 768 codes, 24 chunks of 4-bit: less than one load per lane).
// Activations are fp16 (the quantized kernels' type). Act-order checkpoints are packed with their columns
// sorted by group, so the caller gathers each pair's input row into its expert's column order first and
// passes one row per pair (a_rows_per_pair).
#pragma once

#include "moe/moe_params.cuh"
#include "quantization/quant_gemv.cuh"

namespace voltllm {

struct MoeQuantPairParams {
  void* out;                     // gated: act [pairs, n] fp16, contiguous; down: [tokens, n] fp16, rows
                                 // out_stride apart (the top-k sum of the token's pairs)
  const void* a;                 // fp16 rows a_stride apart. Gated: x, one row per token (row p / top_k) or,
                                 // with a_rows_per_pair, one per pair; down: act [pairs, k]
  const uint4* weight;           // [experts, rows, k / kChunk] packed chunks; rows = 2n gated (gate rows,
                                 // then up rows), n down
  const unsigned* group_params;  // [experts, rows, num_groups]
  const int* topk_ids;           // [pairs]: the expert of each pair
  const float* topk_weights;     // [pairs] (down only)
  long long a_stride;
  long long out_stride;          // down only
  int a_rows_per_pair;           // gated: 1 when a holds a row per pair, 0 when a row per token
  int top_k;
  int n;                         // output features (gated: of the activation)
  int k;                         // input features, a multiple of the kind's chunk
  int num_groups;                // groups per weight row
  int chunk_group_shift;         // log2(chunks per group); unused when num_groups == 1
};

// The shapes the extension builds: weight rows per warp (gated: a gate and an up row per feature),
// chunks per row per lane in flight, and for the down stage the pairs whose rows load together.
constexpr int kMoeQuantPairWarps = 4;
constexpr int kMoeQuantGatedMats = 2;
constexpr int kMoeQuantGatedUnroll = 2;
constexpr int kMoeQuantDownMats = 2;
constexpr int kMoeQuantDownUnroll = 1;
constexpr int kMoeQuantDownInFlight = 4;

// Output features one block of a stage covers.
__host__ __device__ constexpr int moe_quant_gated_features_per_block() {
  return kMoeQuantPairWarps * kMoeQuantGatedMats / 2;
}
__host__ __device__ constexpr int moe_quant_down_features_per_block() {
  return kMoeQuantPairWarps * kMoeQuantDownMats;
}

// The quantized GEMV's view of one expert matrix: `rows` weight rows of `expert` applied to the one fp16
// row at `x`, n output features (the bias and out are unused here: the stages store themselves).
template <int KIND>
__device__ __forceinline__ QuantGemvParams expert_gemv_view(const MoeQuantPairParams& p, long long expert, int rows,
                                                            const void* x) {
  const long long chunks = p.k / QuantTraits<KIND>::kChunk;
  QuantGemvParams q{};
  q.x = x;
  q.weight = p.weight + expert * rows * chunks;
  q.group_params = p.group_params + expert * rows * p.num_groups;
  q.bias = nullptr;
  q.x_stride = p.a_stride;
  q.rows = 1;
  q.n = p.n;
  q.k = p.k;
  q.num_groups = p.num_groups;
  q.chunk_group_shift = p.chunk_group_shift;
  return q;
}

// grid: (pairs, ceil(n / moe_quant_gated_features_per_block())), block: 32 * kMoeQuantPairWarps.
template <int KIND>
__global__ void __launch_bounds__(32 * kMoeQuantPairWarps) moe_quant_pair_gated_kernel(MoeQuantPairParams p) {
  constexpr int kMats = kMoeQuantGatedMats, kUnroll = kMoeQuantGatedUnroll;
  const int lane = threadIdx.x & 31;
  const int pair = blockIdx.x;
  const int group = blockIdx.y * kMoeQuantPairWarps + (threadIdx.x >> 5);  // features group * kMats / 2 ..
  begin_dependent_grid();  // the routing and x come from the kernels before this one
  if (group * (kMats / 2) >= p.n) return;
  const long long row = p.a_rows_per_pair ? pair : pair / p.top_k;
  const __half* x = static_cast<const __half*>(p.a) + row * p.a_stride;
  QuantGemvParams q = expert_gemv_view<KIND>(p, p.topk_ids[pair], 2 * p.n, x);
  q.out = static_cast<__half*>(p.out) + static_cast<long long>(pair) * p.n;
  q.out_stride = p.n;
  float acc[kMats][1];
#pragma unroll
  for (int m = 0; m < kMats; ++m) acc[m][0] = 0.f;
  const int chunks = p.k / QuantTraits<KIND>::kChunk;
  for (int step = 0; step < chunks; step += 32 * kUnroll) {
    GemvStepRegs<kMats, kUnroll> s;
    load_gemv_step<KIND, true, kMats, kUnroll>(q, group, step, lane, s);
    gemv_step_dot<KIND, 1, kMats, kUnroll>(q, x, p.a_stride, s, step, lane, acc);
  }
  store_gemv_group<1, true, kMats>(q, group, lane, acc);
}

// grid: (tokens, ceil(n / moe_quant_down_features_per_block())), block: 32 * kMoeQuantPairWarps.
template <int KIND>
__global__ void __launch_bounds__(32 * kMoeQuantPairWarps) moe_quant_pair_down_kernel(MoeQuantPairParams p) {
  constexpr int kMats = kMoeQuantDownMats, kUnroll = kMoeQuantDownUnroll, kInFlight = kMoeQuantDownInFlight;
  const int lane = threadIdx.x & 31;
  const int token = blockIdx.x;
  const int group = blockIdx.y * kMoeQuantPairWarps + (threadIdx.x >> 5);  // features group * kMats ..
  begin_dependent_grid();  // act comes from the kernel before this one
  if (group * kMats >= p.n) return;
  const int chunks = p.k / QuantTraits<KIND>::kChunk;
  const __half* act = static_cast<const __half*>(p.a);
  float sum[kMats];  // this lane's share of the weighted sum over the token's pairs
#pragma unroll
  for (int m = 0; m < kMats; ++m) sum[m] = 0.f;
  for (int j0 = 0; j0 < p.top_k; j0 += kInFlight) {
    const int live = min(kInFlight, p.top_k - j0);  // pairs of this round (warp-uniform)
    QuantGemvParams q[kInFlight];
    float acc[kInFlight][kMats][1];
#pragma unroll
    for (int i = 0; i < kInFlight; ++i) {
      const int pair = token * p.top_k + j0 + min(i, live - 1);  // past-the-end rounds repeat, never add
      q[i] = expert_gemv_view<KIND>(p, p.topk_ids[pair], p.n, act + static_cast<long long>(pair) * p.a_stride);
#pragma unroll
      for (int m = 0; m < kMats; ++m) acc[i][m][0] = 0.f;
    }
    for (int step = 0; step < chunks; step += 32 * kUnroll) {
      GemvStepRegs<kMats, kUnroll> s[kInFlight];
#pragma unroll
      for (int i = 0; i < kInFlight; ++i) {
        if (i < live) load_gemv_step<KIND, false, kMats, kUnroll>(q[i], group, step, lane, s[i]);
      }
#pragma unroll
      for (int i = 0; i < kInFlight; ++i) {
        if (i < live) {
          gemv_step_dot<KIND, 1, kMats, kUnroll>(q[i], static_cast<const __half*>(q[i].x), p.a_stride, s[i], step,
                                                 lane, acc[i]);
        }
      }
    }
#pragma unroll
    for (int i = 0; i < kInFlight; ++i) {
      if (i >= live) continue;
      const float scale = p.topk_weights[token * p.top_k + j0 + i];
#pragma unroll
      for (int m = 0; m < kMats; ++m) sum[m] = fmaf(scale, acc[i][m][0], sum[m]);
    }
  }
  __half* out = static_cast<__half*>(p.out) + static_cast<long long>(token) * p.out_stride;
#pragma unroll
  for (int m = 0; m < kMats; ++m) {
    const float total = warp_sum(sum[m]);
    const int feature = group * kMats + m;
    if (lane == 0 && feature < p.n) out[feature] = __float2half_rn(total);
  }
}

}  // namespace voltllm
