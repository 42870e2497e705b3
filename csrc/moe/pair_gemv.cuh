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
//
// The staged down stage (moe_pair_down_staged_kernel) is the same sum laid out for fewer memory round
// trips: a warp's feature is one flat run of top_k * k / 8 16-byte chunks (pair j's row, then pair j + 1's),
// each lane takes every 32nd, CHUNKS of them in flight at once, and the token's act rows are staged once
// per block in shared memory, in the same flat order, so no register holds act. Its first CHUNKS loads are
// issued before the wait for the gated stage: the weights and the routing (two kernels back) are final by
// then, so on the Qwen3-30B-A3B shape (768 chunks a feature, CHUNKS 12: two rounds) the first half of the
// down stage's weight traffic overlaps the gated stage's tail. voltllm.ops.moe runs it up to 16 tokens
// (PAIR_DOWN_STAGED_MAX_TOKENS; H100, issue 17: a layer's down stage 11.0 vs 12.9 us at 1 token, 100.6 vs
// 103.0 at 16, but 369.9 vs 311.9 at 64) and moe_pair_down_kernel past that.
#pragma once

#include "moe/moe_params.cuh"
#include "ops/activation.cuh"
#include "ops/gemv.cuh"

namespace voltllm {

constexpr int kMoePairWarps = 4;          // output features per thread block
constexpr int kMoePairGatedUnroll = 4;    // 16-byte loads per weight row in flight (gate and up: 8)
constexpr int kMoePairDownUnroll = 2;     // 16-byte loads per weight row in flight, per pair
constexpr int kMoePairDownInFlight = 4;   // pairs whose rows the down stage loads together
constexpr int kMoePairStagedWarps = 8;    // output features per thread block of the staged down stage
// Most bytes (moe_pair_staged_smem_bytes) the staged down stage stages without opting in to more shared
// memory; larger shapes (Mixtral's top-2 of 14,336) run moe_pair_down_kernel.
constexpr int kMoePairStagedMaxSmem = 48 * 1024;

// Dynamic shared memory of moe_pair_down_staged_kernel: the token's top_k act rows of k elements (k / 8
// chunks of 16 bytes each) and a routing weight per chunk.
__host__ __device__ constexpr int moe_pair_staged_smem_bytes(int top_k, int k) {
  return top_k * (k / 8) * (16 + 4);
}
__device__ const int moe_pair_staged_max_smem_bytes = kMoePairStagedMaxSmem;  // for the sm70 gate's report

// grid: (pairs, ceil(n / kMoePairWarps)), block: 32 * kMoePairWarps. Each warp's feature: act[pair, f] =
// silu(x[token] . gate_f) * (x[token] . up_f) of the pair's expert.
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

// Where flat chunk c of a feature's run lies: pair j = c / row_chunks of the token, chunk o of its row.
// Walked 32 chunks at a time (a lane's next chunk) without a division. (The loop, rather than one
// compare for rows of 32 chunks or more, also keeps ptxas from computing every address of a round ahead
// of its first load: that spilled at CHUNKS 24, an instantiation since dropped.)
struct MoeFlatChunk {
  int j, o;
  __device__ __forceinline__ MoeFlatChunk(int first, int row_chunks) : j(first / row_chunks) {
    o = first - j * row_chunks;
  }
  __device__ __forceinline__ void advance(int row_chunks) {
    o += 32;
    while (o >= row_chunks) {
      o -= row_chunks;
      ++j;
    }
  }
};

// Issues the lane's CHUNKS 16-byte weight loads of one round, chunks round_base + lane + 32 i of the
// feature's flat run; lane q (< top_k) holds where pair q's weight row starts, in 16-byte chunks of the
// stack, in `row`. Chunks past the run load the last pair's row again (inside it, never added:
// add_staged_round weighs them 0), so the loads need no branch. Called by whole warps (the shuffles).
template <int CHUNKS>
__device__ __forceinline__ void load_staged_round(uint4 (&w_raw)[CHUNKS], const uint4* weight, unsigned row, int top_k,
                                                  int round_base, int lane, int row_chunks) {
  MoeFlatChunk at(round_base + lane, row_chunks);
#pragma unroll
  for (int i = 0; i < CHUNKS; ++i) {
    w_raw[i] = weight[__shfl_sync(0xffffffffu, row, min(at.j, top_k - 1)) + at.o];
    at.advance(row_chunks);
  }
}

// sum += weight_j * (the round's weight chunks . the matching act chunks) for the lane's chunks of the
// round: act_s holds the run's act chunks in the same flat order and scale_s each chunk's routing weight;
// chunks past the run weigh 0.
template <typename T, int CHUNKS>
__device__ __forceinline__ void add_staged_round(float& sum, const uint4 (&w_raw)[CHUNKS], const uint4* act_s,
                                                 const float* scale_s, int round_base, int lane, int chunks) {
#pragma unroll
  for (int i = 0; i < CHUNKS; ++i) {
    const int c = round_base + lane + 32 * i;
    float w[8], a[8];
    to_floats<T>(w_raw[i], w);
    to_floats<T>(act_s[min(c, chunks - 1)], a);
    float dot = 0.f;
#pragma unroll
    for (int e = 0; e < 8; ++e) dot = fmaf(w[e], a[e], dot);
    sum = fmaf(c < chunks ? scale_s[min(c, chunks - 1)] : 0.f, dot, sum);
  }
}

// grid: (tokens, ceil(n / kMoePairStagedWarps)), block: 32 * kMoePairStagedWarps, dynamic shared memory:
// moe_pair_staged_smem_bytes(top_k, k) (at most kMoePairStagedMaxSmem). CHUNKS: 16-byte weight
// loads per lane in flight (a round); the same sum as moe_pair_down_kernel, out[token, f] = sum_j weight_j *
// (act[pair_j] . down_{e_j}[f]) in fp32, rounded once.
template <typename T, int CHUNKS>
__global__ void __launch_bounds__(32 * kMoePairStagedWarps, 2) moe_pair_down_staged_kernel(MoePairParams p) {
  VOLTLLM_DYNAMIC_SMEM(smem);
  const int row_chunks = p.k / 8, chunks = p.top_k * row_chunks;
  uint4* act_s = reinterpret_cast<uint4*>(smem);                      // [chunks]: the flat run's act chunks
  float* scale_s = reinterpret_cast<float*>(smem + chunks * 16);      // [chunks]: their pairs' routing weights
  const int lane = threadIdx.x & 31;
  const int token = blockIdx.x;
  const int feature = blockIdx.y * kMoePairStagedWarps + (threadIdx.x >> 5);
  const bool live = feature < p.n;  // a warp past n still stages act and meets the barriers
  const int first_pair = token * p.top_k;
  // The routing is two kernels back (the gated stage is between), so it is final even before the wait
  // (common.cuh), and weights are never written: the first round's loads go out while the gated stage ends.
  const int* ids = p.topk_ids + first_pair;
  const float* weights = p.topk_weights + first_pair;
  const uint4* weight = static_cast<const uint4*>(p.weight);  // the glue checks it has < 2^32 chunks
  const unsigned row = lane < p.top_k ? (static_cast<unsigned>(ids[lane]) * p.n + feature) * row_chunks : 0u;
  uint4 w_raw[CHUNKS];
  if (live) load_staged_round<CHUNKS>(w_raw, weight, row, p.top_k, 0, lane, row_chunks);
  begin_dependent_grid();  // act comes from the kernel before this one
  const T* act = static_cast<const T*>(p.a);
  for (int c = threadIdx.x; c < chunks; c += blockDim.x) {
    const int j = c / row_chunks;
    act_s[c] = load16(act + static_cast<long long>(first_pair + j) * p.a_stride + (c - j * row_chunks) * 8);
    scale_s[c] = weights[j];
  }
  __syncthreads();
  float sum = 0.f;  // this lane's share of the weighted sum over the token's pairs
  for (int round_base = 0; live && round_base < chunks; round_base += 32 * CHUNKS) {
    if (round_base > 0) load_staged_round<CHUNKS>(w_raw, weight, row, p.top_k, round_base, lane, row_chunks);
    add_staged_round<T, CHUNKS>(sum, w_raw, act_s, scale_s, round_base, lane, chunks);
  }
  sum = warp_sum(sum);
  if (live && lane == 0) static_cast<T*>(p.out)[token * p.out_stride + feature] = DType<T>::from_float(sum);
}

}  // namespace voltllm
