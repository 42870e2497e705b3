// A sparse block's front at decode sizes in one launch: the residual add and RMSNorm after attention,
// the router's logits and each token's top-k softmax (ops/gemv.cuh's norm prologue, a GEMV over the
// experts, then topk_softmax.cuh's warp top-k).
//
// Unfused these are three launches a layer (fused_add_rms_norm, the router GEMV, the top-k), each a few
// microseconds of launch and ramp for a microsecond of work at one token. Every block computes the
// normalized rows itself from hidden and residual_in into shared memory (as gemv_norm_kernel does; the
// same code, so the same bits as fused_add_rms_norm_kernel), block 0 also stores them (the experts' x)
// and the new residual. Each warp then computes one expert's logit per row, rounded to T as the router
// linear stores it, into `logits`. The block that finishes last (a ticket from an atomic counter, after
// a fence: every other block's logits are visible to it) runs the top-k of each row, one warp per row,
// and puts the counter back to 0 for the next launch (so a CUDA graph replays it as it was captured).
#pragma once

#include "moe/moe_params.cuh"
#include "moe/topk_softmax.cuh"
#include "ops/gemv.cuh"

namespace voltllm {

constexpr int kMoeRouteMaxRows = 2;  // the norm prologue's 256-thread groups: two rows per block
__device__ const int moe_route_max_smem_bytes = gemv_norm_smem_bytes(kMoeRouteMaxRows, kGemvNormMaxK);  // for the gate

struct MoeRouteParams {
  GemvNormParams norm;  // hidden, residual_in, residual_out, norm_weight, eps, rows, k; weight = the
                        // router [num_experts, k]; out = the logits [rows, num_experts] of T; n = experts
  void* normed_out;     // [rows, k] of T, contiguous: the normalized rows (the experts' input)
  MoeTopkParams topk;   // its logits are norm.out; num_tokens = rows
  int* counter;         // [1], 0 between launches
};

// grid: ceil(num_experts / kGemvNormWarps), block: 32 * kGemvNormWarps, dynamic shared memory:
// gemv_norm_smem_bytes(ROWS, k).
template <typename T, int ROWS>
__global__ void __launch_bounds__(32 * kGemvNormWarps) moe_route_kernel(MoeRouteParams p) {
  static_assert(ROWS <= kMoeRouteMaxRows, "the norm prologue takes two rows per block");
  using Tile = GemvTile<ROWS, false>;
  constexpr int kUnroll = Tile::kUnroll;
  VOLTLLM_DYNAMIC_SMEM(smem);
  float* scratch = reinterpret_cast<float*>(smem);                // [kGemvNormWarps]
  T* x_s = reinterpret_cast<T*>(smem + kGemvNormScratchBytes);     // [ROWS][k]
  const GemvNormParams& g = p.norm;
  const int lane = threadIdx.x & 31;
  const int expert = blockIdx.x * kGemvNormWarps + (threadIdx.x >> 5);
  const T* const w_rows[1] = {static_cast<const T*>(g.weight) + static_cast<long long>(expert) * g.k};
  if (expert < g.n) prefetch_first_chunk<T, 1, kUnroll>(w_rows, lane, g.k);  // weights: never written
  begin_dependent_grid();  // hidden and residual_in come from the kernels before this one
  add_rms_norm_to_smem<T, ROWS>(g, x_s, scratch);
  __syncthreads();
  if (blockIdx.x == 0) {
    for (int i = threadIdx.x * 8; i < g.rows * g.k; i += blockDim.x * 8) {
      *reinterpret_cast<uint4*>(static_cast<T*>(p.normed_out) + i) = *reinterpret_cast<const uint4*>(x_s + i);
    }
  }
  if (expert < g.n) {
    float acc[1][ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) acc[0][r] = 0.f;
    for (int base = lane * 8; base < g.k; base += Tile::kStep) {
      uint4 w_raw[1][kUnroll];
      load_weight_chunk<T>(w_raw, w_rows, base, g.k);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int k = base + u * 256;
        if (k >= g.k) break;
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
          if (r < g.rows) fma_chunk<T>(acc, w_raw, u, r, load16(x_s + r * g.k + k));
        }
      }
    }
    store_feature<T, ROWS, false>(acc, static_cast<T*>(g.out), g.out_stride, nullptr, g.rows, g.n, expert, lane);
  }
  // Publish this block's logits, then take a ticket: the last block sees every block's logits. The
  // flag reuses the norm's scratch, which nobody reads after the barrier that ended the prologue.
  int* is_last = reinterpret_cast<int*>(scratch);
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) *is_last = atomicAdd(p.counter, 1) == static_cast<int>(gridDim.x) - 1;
  __syncthreads();
  if (!*is_last) return;
  __threadfence();
  const int warp = threadIdx.x >> 5;
  if (warp < g.rows) moe_topk_softmax_token<T>(p.topk, warp, lane);
  if (threadIdx.x == 0) *p.counter = 0;
}

}  // namespace voltllm
