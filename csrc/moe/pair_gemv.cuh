// The decode path of a few tokens: the two expert stages pair by pair, with no align and no combine
// launch.
//
// At a few tokens per step the pairs share few experts (a token's top-k are distinct), so sorting them
// into expert tiles saves few weight bytes, while the align launch and the combine launch each cost more
// than their work (H200, Qwen3-30B-A3B experts: 26 vs 41 us at 1 token, 131 vs 183 us at 8, where 64
// pairs touch 54 experts). Here the gated stage's block (pair, feature group) takes its expert straight from
// the router's choice, and the down stage's block (token, feature group) walks the token's pairs and sums
// their weighted products itself, rounding once: three launches a layer with the routing, not five.
//
// Each warp owns one output feature, as in ops/gemv.cuh, whose chunk loads and fp32 multiply-adds it
// reuses. Gated stage: act[pair] = silu(x[token] . gate_f) * (x[token] . up_f), both products rounded to
// T first, as the unfused projection stores them. Down stage: out[token, f] = sum_j weight_j *
// (act[pair_j] . down_{e_j}[f]) in fp32, the rows of kMoePairDownInFlight pairs loaded together so that a
// short row (k = 768 is three 16-byte loads a lane) still keeps enough bytes in flight.
#pragma once

#include "moe/moe_params.cuh"
#include "ops/activation.cuh"
#include "ops/gemv.cuh"

namespace voltllm {

constexpr int kMoePairWarps = 4;          // output features per thread block
constexpr int kMoePairGatedUnroll = 4;    // 16-byte loads per weight row in flight (gate and up: 8)
constexpr int kMoePairDownUnroll = 2;     // 16-byte loads per weight row in flight, per pair
constexpr int kMoePairDownInFlight = 4;   // pairs whose rows the down stage loads together

// grid: (pairs, ceil(n / kMoePairWarps)), block: 32 * kMoePairWarps.
template <typename T>
__global__ void __launch_bounds__(32 * kMoePairWarps) moe_pair_gated_kernel(MoePairParams p) {
  constexpr int kUnroll = kMoePairGatedUnroll, kStep = 32 * 8 * kUnroll;
  const int lane = threadIdx.x & 31;
  const int pair = blockIdx.x;
  const int feature = blockIdx.y * kMoePairWarps + (threadIdx.x >> 5);
  begin_dependent_grid();  // the routing and x come from the kernels before this one
  if (feature >= p.n) return;
  const long long expert = p.topk_ids[pair];
  const T* weight = static_cast<const T*>(p.weight) + expert * 2 * p.n * static_cast<long long>(p.k);
  const T* const w_rows[2] = {weight + static_cast<long long>(feature) * p.k,
                              weight + static_cast<long long>(feature + p.n) * p.k};
  const T* x = static_cast<const T*>(p.a) + static_cast<long long>(pair / p.top_k) * p.a_stride;
  float acc[2][1] = {{0.f}, {0.f}};
  for (int base = lane * 8; base < p.k; base += kStep) {
    uint4 w_raw[2][kUnroll];
    uint4 x_raw[kUnroll];
    load_weight_chunk<T>(w_raw, w_rows, base, p.k);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (base + u * 256 < p.k) x_raw[u] = load16(x + base + u * 256);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (base + u * 256 >= p.k) break;
      fma_chunk<T>(acc, w_raw, u, 0, x_raw[u]);
    }
  }
  const float gate = DType<T>::to_float(DType<T>::from_float(warp_sum(acc[0][0])));
  const float up = DType<T>::to_float(DType<T>::from_float(warp_sum(acc[1][0])));
  if (lane == 0) {
    static_cast<T*>(p.out)[static_cast<long long>(pair) * p.n + feature] = DType<T>::from_float(silu(gate) * up);
  }
}

// grid: (tokens, ceil(n / kMoePairWarps)), block: 32 * kMoePairWarps.
template <typename T>
__global__ void __launch_bounds__(32 * kMoePairWarps) moe_pair_down_kernel(MoePairParams p) {
  constexpr int kUnroll = kMoePairDownUnroll, kStep = 32 * 8 * kUnroll, kInFlight = kMoePairDownInFlight;
  const int lane = threadIdx.x & 31;
  const int token = blockIdx.x;
  const int feature = blockIdx.y * kMoePairWarps + (threadIdx.x >> 5);
  const T* weight = static_cast<const T*>(p.weight);
  if (feature < p.n) {
    // The routing is two kernels back (the gated stage is between), so it is final even before the
    // wait (common.cuh): ask L2 for the first chunks of the token's rows while the gated stage ends.
    for (int j = 0; j < p.top_k; ++j) {
      const long long expert = p.topk_ids[token * p.top_k + j];
      const T* row = weight + (expert * p.n + feature) * static_cast<long long>(p.k);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (lane * 8 + u * 256 < p.k) prefetch_l2(row + lane * 8 + u * 256);
      }
    }
  }
  begin_dependent_grid();  // act comes from the kernel before this one
  if (feature >= p.n) return;
  const T* act = static_cast<const T*>(p.a);
  float sum = 0.f;  // this lane's share of the weighted sum over the token's pairs
  for (int j0 = 0; j0 < p.top_k; j0 += kInFlight) {
    const int live = min(kInFlight, p.top_k - j0);  // pairs of this round (warp-uniform)
    const T* w_rows[kInFlight];
    const T* a_rows[kInFlight];
    float scale[kInFlight];
#pragma unroll
    for (int q = 0; q < kInFlight; ++q) {
      const int pair = token * p.top_k + j0 + min(q, live - 1);  // past-the-end rounds repeat, never add
      const long long expert = p.topk_ids[pair];
      w_rows[q] = weight + (expert * p.n + feature) * static_cast<long long>(p.k);
      a_rows[q] = act + static_cast<long long>(pair) * p.a_stride;
      scale[q] = p.topk_weights[pair];
    }
    float dot[kInFlight];
#pragma unroll
    for (int q = 0; q < kInFlight; ++q) dot[q] = 0.f;
    for (int base = lane * 8; base < p.k; base += kStep) {
      uint4 w_raw[kInFlight][kUnroll];
      uint4 a_raw[kInFlight][kUnroll];
#pragma unroll
      for (int q = 0; q < kInFlight; ++q) {
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          if (q < live && base + u * 256 < p.k) {
            w_raw[q][u] = load16(w_rows[q] + base + u * 256);
            a_raw[q][u] = load16(a_rows[q] + base + u * 256);
          }
        }
      }
#pragma unroll
      for (int q = 0; q < kInFlight; ++q) {
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          if (q >= live || base + u * 256 >= p.k) continue;
          float w[8], a[8];
          to_floats<T>(w_raw[q][u], w);
          to_floats<T>(a_raw[q][u], a);
#pragma unroll
          for (int e = 0; e < 8; ++e) dot[q] = fmaf(w[e], a[e], dot[q]);
        }
      }
    }
#pragma unroll
    for (int q = 0; q < kInFlight; ++q) {
      if (q < live) sum = fmaf(scale[q], dot[q], sum);
    }
  }
  sum = warp_sum(sum);
  if (lane == 0) static_cast<T*>(p.out)[token * p.out_stride + feature] = DType<T>::from_float(sum);
}

}  // namespace voltllm
