// The router's choice on the GPU: softmax over a token's expert logits in fp32, its top k, optionally
// renormalised (the definition is voltllm/ops/moe.py `topk_softmax_ref`, as transformers computes it).
//
// One warp per token: lane l holds the logits of experts l, l + 32, ... in registers, the max and the
// sum of the exponentials are warp reductions, and each of the k choices is a warp argmax (ties go to
// the lower expert index) whose winner drops out. Lane j keeps the j-th choice, so renormalising is one
// more warp sum and the stores are coalesced.
#pragma once

#include "moe/moe_params.cuh"

namespace voltllm {

constexpr int kMoeTopkWarps = 4;  // tokens per thread block
constexpr int kMoeExpertsPerLane = kMoeMaxExperts / 32;

// One warp's work: the choices of one token from its logits `row` (every lane of the warp calls it).
// Lane j < top_k gets the j-th choice, its id and its weight (renormalised when asked); the other lanes
// get nothing meaningful.
template <typename T>
__device__ __forceinline__ void moe_topk_softmax_choices(const T* row, int num_experts, int top_k, bool renormalize,
                                                         int lane, float& my_weight, int& my_id) {
  float prob[kMoeExpertsPerLane];
  float row_max = neg_inf();
#pragma unroll
  for (int i = 0; i < kMoeExpertsPerLane; ++i) {
    const int e = lane + 32 * i;
    prob[i] = e < num_experts ? DType<T>::to_float(row[e]) : neg_inf();
    row_max = fmaxf(row_max, prob[i]);
  }
  row_max = warp_max(row_max);
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < kMoeExpertsPerLane; ++i) {
    // Experts past num_experts get -1: below every probability, so never chosen.
    prob[i] = lane + 32 * i < num_experts ? expf(prob[i] - row_max) : -1.f;
    sum += prob[i] > 0.f ? prob[i] : 0.f;
  }
  sum = warp_sum(sum);
  my_weight = 0.f;
  my_id = 0;
  for (int j = 0; j < top_k; ++j) {
    float best = -2.f;
    int best_id = 0x7fffffff;
#pragma unroll
    for (int i = 0; i < kMoeExpertsPerLane; ++i) {
      if (prob[i] > best) {  // strictly: the lane's lowest index wins a tie
        best = prob[i];
        best_id = lane + 32 * i;
      }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float other = __shfl_xor_sync(0xffffffffu, best, o);
      const int other_id = __shfl_xor_sync(0xffffffffu, best_id, o);
      if (other > best || (other == best && other_id < best_id)) {
        best = other;
        best_id = other_id;
      }
    }
#pragma unroll
    for (int i = 0; i < kMoeExpertsPerLane; ++i) {
      if (lane + 32 * i == best_id) prob[i] = -2.f;  // taken: below even the padding
    }
    if (lane == j) {
      my_weight = best / sum;
      my_id = best_id;
    }
  }
  if (renormalize) my_weight /= warp_sum(lane < top_k ? my_weight : 0.f);
}

// One warp's work: the choices of `token`, stored (every lane of the warp calls it).
template <typename T>
__device__ __forceinline__ void moe_topk_softmax_token(const MoeTopkParams& p, int token, int lane) {
  const T* row = static_cast<const T*>(p.logits) + token * p.logits_stride;
  float my_weight;
  int my_id;
  moe_topk_softmax_choices<T>(row, p.num_experts, p.top_k, p.renormalize != 0, lane, my_weight, my_id);
  if (lane < p.top_k) {
    p.topk_weights[token * p.top_k + lane] = my_weight;
    p.topk_ids[token * p.top_k + lane] = my_id;
  }
}

// grid: ceil(tokens / kMoeTopkWarps), block: 32 * kMoeTopkWarps.
template <typename T>
__global__ void __launch_bounds__(32 * kMoeTopkWarps) moe_topk_softmax_kernel(MoeTopkParams p) {
  begin_dependent_grid();
  const int token = blockIdx.x * kMoeTopkWarps + (threadIdx.x >> 5);
  if (token >= p.num_tokens) return;  // the whole warp
  moe_topk_softmax_token<T>(p, token, threadIdx.x & 31);
}

}  // namespace voltllm
