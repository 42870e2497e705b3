// The prefill path of the experts: one expert stage as a grouped GEMM over tiles of routed pairs, on
// tensor cores through WMMA m16n16k16 (fp16 on Volta; bf16 needs SM80).
//
// Block (tile, column block): kBlockM slots of one expert times kBlockN output features, four warps of
// 32 x 32 each. Each kBlockK step stages the tile's rows of A (gated: gathered token rows of x; down: the
// tile's rows of act) and the expert's weight rows through registers into shared memory (no cp.async on
// Volta: the next step's loads are issued before the current step's MMAs, so they overlap), then every
// warp multiplies. The epilogue goes through shared memory: gated, silu(gate) * up of the two
// accumulators (each rounded to T first, as the unfused projection stores them) written to the slot's
// row of act; down, the fp32 result times the pair's routing weight written to the pair's row of y.
// Padding slots compute zeros and are never stored by the down stage; tiles past the device-side count
// exit at once.
#pragma once

#include <mma.h>

#include "moe/moe_params.cuh"
#include "ops/activation.cuh"

namespace voltllm {

template <bool GATED>
struct MoeGemmTraits {
  static constexpr int kMats = GATED ? 2 : 1;  // weight matrices per tile: gate and up
  static constexpr int kBlockM = 64, kBlockN = 64, kBlockK = 32;
  static constexpr int kWarps = 4;  // 2 x 2, each 32 x 32 of every matrix
  static constexpr int kWarpM = 32, kWarpN = 32;
  static constexpr int kLdAB = kBlockK + 8;  // staged rows padded by 16 bytes (bank conflicts)
  static constexpr int kLdC = kBlockN + 4;
  static constexpr int kStageBytes = (kBlockM + kMats * kBlockN) * kLdAB * 2;
  static constexpr int kEpilogueBytes = kMats * kBlockM * kLdC * 4;
  static constexpr int kSmemBytes = kStageBytes > kEpilogueBytes ? kStageBytes : kEpilogueBytes;
  // 16-byte chunks of A and of all weight rows per kBlockK step, per thread.
  static constexpr int kChunksA = kBlockM * kBlockK / 8 / (32 * kWarps);
  static constexpr int kChunksB = kMats * kBlockN * kBlockK / 8 / (32 * kWarps);
  static_assert(kBlockM * kBlockK / 8 % (32 * kWarps) == 0, "A chunks divide over the threads");
  static_assert(kBlockM == 2 * kWarpM && kBlockN == 2 * kWarpN, "2 x 2 warps");
  static_assert(kLdAB % 8 == 0 && kLdC % 4 == 0, "WMMA ldm is a multiple of 16 bytes");
};

template <bool GATED>
__device__ const int moe_gemm_wmma_smem_bytes = MoeGemmTraits<GATED>::kSmemBytes;  // for the gate's report

// One thread's 16-byte chunks of the next kBlockK step: where they come from and go.
template <typename T, bool GATED>
struct MoeGemmLoads {
  using Traits = MoeGemmTraits<GATED>;
  const T* a_src[Traits::kChunksA];  // nullptr: a padding slot (zeros)
  const T* b_src[Traits::kChunksB];  // nullptr: a feature past n (zeros)
  uint4 a[Traits::kChunksA];
  uint4 b[Traits::kChunksB];
};

template <typename T, bool GATED>
__device__ __forceinline__ void moe_gemm_fetch(MoeGemmLoads<T, GATED>& l, int k0, int k) {
  using Traits = MoeGemmTraits<GATED>;
  const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
  for (int i = 0; i < Traits::kChunksA; ++i) {
    const int col = k0 + ((threadIdx.x + i * 32 * Traits::kWarps) % (Traits::kBlockK / 8)) * 8;
    l.a[i] = l.a_src[i] != nullptr && col < k ? *reinterpret_cast<const uint4*>(l.a_src[i] + col) : zero;
  }
#pragma unroll
  for (int i = 0; i < Traits::kChunksB; ++i) {
    const int col = k0 + ((threadIdx.x + i * 32 * Traits::kWarps) % (Traits::kBlockK / 8)) * 8;
    l.b[i] = l.b_src[i] != nullptr && col < k ? *reinterpret_cast<const uint4*>(l.b_src[i] + col) : zero;
  }
}

template <typename T, bool GATED>
__device__ __forceinline__ void moe_gemm_stage(const MoeGemmLoads<T, GATED>& l, T* a_s, T* b_s) {
  using Traits = MoeGemmTraits<GATED>;
  constexpr int kPerRow = Traits::kBlockK / 8;
#pragma unroll
  for (int i = 0; i < Traits::kChunksA; ++i) {
    const int chunk = threadIdx.x + i * 32 * Traits::kWarps;
    *reinterpret_cast<uint4*>(a_s + (chunk / kPerRow) * Traits::kLdAB + (chunk % kPerRow) * 8) = l.a[i];
  }
#pragma unroll
  for (int i = 0; i < Traits::kChunksB; ++i) {
    const int chunk = threadIdx.x + i * 32 * Traits::kWarps;  // row (chunk / kPerRow) of [kMats * kBlockN]
    *reinterpret_cast<uint4*>(b_s + (chunk / kPerRow) * Traits::kLdAB + (chunk % kPerRow) * 8) = l.b[i];
  }
}

// grid: (max_tiles, ceil(n / kBlockN)), block: 32 * kWarps, dynamic shared memory: kSmemBytes.
template <typename T, bool GATED>
__global__ void __launch_bounds__(128) moe_grouped_gemm_wmma_kernel(MoeExpertParams p) {
  using namespace nvcuda;
  using Traits = MoeGemmTraits<GATED>;
  constexpr int kMats = Traits::kMats, kBM = Traits::kBlockM, kBN = Traits::kBlockN, kBK = Traits::kBlockK;
  constexpr int kPerRow = kBK / 8;
  VOLTLLM_DYNAMIC_SMEM(smem);
  T* a_s = reinterpret_cast<T*>(smem);             // [kBM][kLdAB]
  T* b_s = a_s + kBM * Traits::kLdAB;              // [kMats * kBN][kLdAB]: row m * kBN + c is feature n0 + c of matrix m
  float* c_s = reinterpret_cast<float*>(smem);     // [kMats][kBM][kLdC], after the main loop
  const int tile = blockIdx.x, n0 = blockIdx.y * kBN;
  const int warp = threadIdx.x >> 5;
  const int warp_m = (warp / 2) * Traits::kWarpM, warp_n = (warp % 2) * Traits::kWarpN;
  begin_dependent_grid();  // the routing comes from the kernels before this one
  if (tile >= *p.num_tiles) return;
  const long long expert = p.tile_experts[tile];
  const T* weight = static_cast<const T*>(p.weight) + expert * kMats * p.n * static_cast<long long>(p.k);
  const T* a = static_cast<const T*>(p.a);
  MoeGemmLoads<T, GATED> loads;
#pragma unroll
  for (int i = 0; i < Traits::kChunksA; ++i) {
    const int row = (threadIdx.x + i * 32 * Traits::kWarps) / kPerRow;
    const int slot = tile * kBM + row;
    const int pair = p.sorted_pair_ids[slot];
    const long long a_row = GATED ? pair / p.top_k : slot;
    loads.a_src[i] = pair >= 0 ? a + a_row * p.a_stride : nullptr;
  }
#pragma unroll
  for (int i = 0; i < Traits::kChunksB; ++i) {
    const int row = (threadIdx.x + i * 32 * Traits::kWarps) / kPerRow;  // of [kMats * kBN]
    const int m = row / kBN, feature = n0 + row % kBN;
    loads.b_src[i] = feature < p.n ? weight + (static_cast<long long>(m) * p.n + feature) * p.k : nullptr;
  }
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[kMats][2][2];
#pragma unroll
  for (int m = 0; m < kMats; ++m)
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
      for (int j = 0; j < 2; ++j) wmma::fill_fragment(acc[m][i][j], 0.f);
  moe_gemm_fetch(loads, 0, p.k);
  for (int k0 = 0; k0 < p.k; k0 += kBK) {
    __syncthreads();  // every warp is done with the last step's tiles
    moe_gemm_stage(loads, a_s, b_s);
    __syncthreads();
    if (k0 + kBK < p.k) moe_gemm_fetch(loads, k0 + kBK, p.k);  // in flight during the MMAs
#pragma unroll
    for (int kk = 0; kk < kBK; kk += 16) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> a_frag[2];
#pragma unroll
      for (int i = 0; i < 2; ++i) wmma::load_matrix_sync(a_frag[i], a_s + (warp_m + 16 * i) * Traits::kLdAB + kk, Traits::kLdAB);
#pragma unroll
      for (int m = 0; m < kMats; ++m) {
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          // B[kk.., c] = weight row c: the staged rows read column-major.
          wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> b_frag;
          wmma::load_matrix_sync(b_frag, b_s + (m * kBN + warp_n + 16 * j) * Traits::kLdAB + kk, Traits::kLdAB);
#pragma unroll
          for (int i = 0; i < 2; ++i) wmma::mma_sync(acc[m][i][j], a_frag[i], b_frag, acc[m][i][j]);
        }
      }
    }
  }
  __syncthreads();  // the staging buffers become the epilogue's
#pragma unroll
  for (int m = 0; m < kMats; ++m)
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        float* dst = c_s + (m * kBM + warp_m + 16 * i) * Traits::kLdC + warp_n + 16 * j;
        wmma::store_matrix_sync(dst, acc[m][i][j], Traits::kLdC, wmma::mem_row_major);
      }
  __syncthreads();
  // Each thread finishes 8 consecutive features of a row at a time.
  for (int chunk = threadIdx.x; chunk < kBM * kBN / 8; chunk += 32 * Traits::kWarps) {
    const int row = chunk / (kBN / 8), col = (chunk % (kBN / 8)) * 8;
    const int slot = tile * kBM + row;
    if (n0 + col >= p.n) continue;
    const float* c_row = c_s + row * Traits::kLdC + col;
    float v[8];
    if (GATED) {
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        const float gate = DType<T>::to_float(DType<T>::from_float(c_row[e]));
        const float up = DType<T>::to_float(DType<T>::from_float(c_row[kBM * Traits::kLdC + e]));
        v[e] = silu(gate) * up;
      }
      store_floats(static_cast<T*>(p.out) + static_cast<long long>(slot) * p.n + n0 + col, v);
    } else {
      const int pair = p.sorted_pair_ids[slot];
      if (pair < 0) continue;
      const float w = p.topk_weights[pair];
      float* y = static_cast<float*>(p.out) + static_cast<long long>(pair) * p.n + n0 + col;
#pragma unroll
      for (int e = 0; e < 8; ++e) v[e] = w * c_row[e];
      reinterpret_cast<float4*>(y)[0] = make_float4(v[0], v[1], v[2], v[3]);
      reinterpret_cast<float4*>(y)[1] = make_float4(v[4], v[5], v[6], v[7]);
    }
  }
}

}  // namespace voltllm
