// The decode path of the experts: one expert stage as a matrix-vector product per tile of routed pairs,
// on CUDA cores, for batches small enough that an expert gets few tokens.
//
// Block (tile, feature group): the tile's expert and its kMoeGemvRows slots (a token's pairs of one
// expert; padding slots, -1, at the end are skipped). Each warp owns one output feature, as in
// ops/gemv.cuh, whose chunk loads and fp32 multiply-adds it reuses: a chunk of the expert's weight row is
// loaded once and applied to every row of the tile, so an expert that got up to kMoeGemvRows pairs is read
// once per step, and experts that got none are never touched (no tile names them). Tiles past the
// device-side count exit at once: the grid is sized for the worst case, so no routing reaches the host.
//
// Gated stage: act[slot] = silu(x[token] . gate_f) * (x[token] . up_f), both products rounded to T first
// as the unfused projection stores them. Down stage: y[pair] = weight[pair] * (act[slot] . down_f) in
// fp32, summed over the token's pairs by the combine kernel.
#pragma once

#include "moe/moe_params.cuh"
#include "ops/activation.cuh"
#include "ops/gemv.cuh"

namespace voltllm {

constexpr int kMoeGemvRows = 8;   // slots per tile of the decode path
constexpr int kMoeGemvWarps = 4;  // output features per thread block

template <bool GATED>
struct MoeGemvTile {
  static constexpr int kMats = GATED ? 2 : 1;  // weight rows per warp: gate and up
  static constexpr int kUnroll = GATED ? 2 : 4;  // 16-byte loads per weight row in flight
  static constexpr int kStep = 32 * 8 * kUnroll;
};

// grid: (max_tiles, ceil(n / kMoeGemvWarps)), block: 32 * kMoeGemvWarps.
template <typename T, bool GATED>
__global__ void __launch_bounds__(32 * kMoeGemvWarps) moe_expert_gemv_kernel(MoeExpertParams p) {
  using Tile = MoeGemvTile<GATED>;
  constexpr int kMats = Tile::kMats, kUnroll = Tile::kUnroll, kRows = kMoeGemvRows;
  const int lane = threadIdx.x & 31;
  const int tile = blockIdx.x;
  const int feature = blockIdx.y * kMoeGemvWarps + (threadIdx.x >> 5);
  begin_dependent_grid();  // the routing comes from the kernels before this one
  if (tile >= *p.num_tiles || feature >= p.n) return;
  const long long expert = p.tile_experts[tile];
  const T* weight = static_cast<const T*>(p.weight) + expert * kMats * p.n * static_cast<long long>(p.k);
  const T* w_rows[kMats];
#pragma unroll
  for (int m = 0; m < kMats; ++m) w_rows[m] = weight + static_cast<long long>(feature + m * p.n) * p.k;
  int pairs[kRows];
  int rows = 0;  // the tile's pairs come first, its padding after
  const T* a_rows[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int slot = tile * kRows + r;
    pairs[r] = p.sorted_pair_ids[slot];
    rows += pairs[r] >= 0;
    const long long a_row = GATED ? (pairs[r] >= 0 ? pairs[r] / p.top_k : 0) : slot;
    a_rows[r] = static_cast<const T*>(p.a) + a_row * p.a_stride;
  }
  float acc[kMats][kRows];
#pragma unroll
  for (int m = 0; m < kMats; ++m)
#pragma unroll
    for (int r = 0; r < kRows; ++r) acc[m][r] = 0.f;
  for (int base = lane * 8; base < p.k; base += Tile::kStep) {
    uint4 w_raw[kMats][kUnroll];
    load_weight_chunk<T>(w_raw, w_rows, base, p.k);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int k = base + u * 256;
      if (k >= p.k) break;
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        if (r < rows) fma_chunk<T>(acc, w_raw, u, r, load16(a_rows[r] + k));
      }
    }
  }
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    if (r >= rows) break;  // warp-uniform
    if (GATED) {
      const float gate = DType<T>::to_float(DType<T>::from_float(warp_sum(acc[0][r])));
      const float up = DType<T>::to_float(DType<T>::from_float(warp_sum(acc[kMats - 1][r])));
      T* act = static_cast<T*>(p.out) + static_cast<long long>(tile * kRows + r) * p.n;
      if (lane == 0) act[feature] = DType<T>::from_float(silu(gate) * up);
    } else {
      const float sum = warp_sum(acc[0][r]);
      float* y = static_cast<float*>(p.out) + static_cast<long long>(pairs[r]) * p.n;
      if (lane == 0) y[feature] = p.topk_weights[pairs[r]] * sum;
    }
  }
}

}  // namespace voltllm
