// Weight-streaming quantized GEMM for 4-64 rows on tensor cores (WMMA m16n16k16, fp16 operands, fp32
// accumulation; Volta-legal): out[m, f] = sum_k x[m, k] * W[f, k] (+ bias[f]) for fp16 x and a packed
// 4-bit / 8-bit / fp8 weight (quant_common.cuh's layout).
//
// At tens of rows the product still reads far more weight bytes than it computes on, so the kernel is
// organised like the GEMV rather than like a tiled GEMM: every warp owns 16 * NF output features and
// streams their packed rows through a ring of DEPTH k-chunks of 64 columns in registers. Per k-chunk a
// warp dequantizes its chunks into its own shared-memory tile and multiplies it (WMMA matrix_b) with MF
// fragments of 16 rows of x. The block's rows of x over its whole k range are staged in shared memory
// once, before the single barrier (rows past m as zeros), so the warps never wait for each other after
// it, and the x fragments come from shared memory (a fragment read from global memory touches 16 rows'
// cache lines per load: that made the first version L1-bound).
// k is split over gridDim.z, for enough streaming warps and so that a split's x fits shared memory;
// splits add their fp32 partial sums into a zeroed buffer (atomics) that quant_gemm_finalize_kernel
// (quant_gemm_wmma.cuh) rounds.
#pragma once

#include <mma.h>

#include "quantization/quant_gemm_wmma.cuh"

namespace voltllm {

template <int KIND, int MF, int NF, int DEPTH>
struct QuantStreamTraits {
  static_assert(MF >= 1 && MF <= 4 && NF >= 1 && NF <= 2 && DEPTH >= 1, "shape");
  static constexpr int kWarps = 8;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kRows = 16 * NF;             // weight rows (output features) per warp
  static constexpr int kBlockK = 64;                // columns per k-chunk
  static constexpr int kChunk = QuantTraits<KIND>::kChunk;
  static constexpr int kChunksPerRow = kBlockK / kChunk;             // 2 (4-bit) or 4 (8-bit)
  static constexpr int kLoads = kRows * kChunksPerRow / 32;          // 16-byte chunks per lane per k-chunk
  static constexpr int kLd = kBlockK + 8;                            // padded fp16 row of the warp's tile
  static constexpr int kWarpSmemBytes = kRows * kLd * 2;
  static constexpr int kFixedSmemBytes = kWarps * kWarpSmemBytes;    // then x: 16 MF rows of the split
  static constexpr int kXRows = 16 * MF;
  static_assert(kRows * kChunksPerRow % 32 == 0, "every lane loads the same number of chunks");
  static_assert(kWarpSmemBytes >= 16 * 16 * 4, "the epilogue's fp32 fragment fits the warp's tile");
};

// The shape the extension builds for each kind and number of 16-row fragments of x (1..4): weight
// fragments per warp (NF) and k-chunks in flight (DEPTH). 8-bit chunks hold half the columns of 4-bit
// ones, so the same bytes in flight take half the depth. Every shape fits sm_70's registers unspilled.
template <int KIND, int MF>
struct QuantStreamShape {
  static constexpr int kNF = 1;
  static constexpr int kDepth = (KIND == kQuantInt4 ? 8 : 4) / (MF > 2 ? 2 : 1);
};

// Padded fp16 row of the staged x for a split of `k_chunks` 64-column chunks (16 bytes of padding keep
// the fragment loads free of bank conflicts).
__host__ __device__ constexpr int quant_stream_x_ld(int k_chunks) { return k_chunks * 64 + 8; }

// Dynamic shared memory of a launch whose splits cover `k_chunks` k-chunks each.
template <int KIND, int MF, int NF, int DEPTH>
__host__ __device__ constexpr int quant_gemm_stream_smem_bytes(int k_chunks) {
  using Tr = QuantStreamTraits<KIND, MF, NF, DEPTH>;
  return Tr::kFixedSmemBytes + Tr::kXRows * quant_stream_x_ld(k_chunks) * 2;
}

// The most k-chunks a split may cover within `smem_limit` bytes of shared memory per block.
template <int KIND, int MF, int NF, int DEPTH>
__host__ __device__ constexpr int quant_gemm_stream_max_chunks(int smem_limit) {
  using Tr = QuantStreamTraits<KIND, MF, NF, DEPTH>;
  return ((smem_limit - Tr::kFixedSmemBytes) / (Tr::kXRows * 2) - 8) / 64;
}

#ifdef __CUDACC_RTC__
// What a launch at Volta's most k-chunks per split takes (the sm70 gate checks it against 96 KB).
template <int KIND, int MF, int NF, int DEPTH>
__device__ const int quant_gemm_stream_smem_bytes_probe = quant_gemm_stream_smem_bytes<KIND, MF, NF, DEPTH>(
    quant_gemm_stream_max_chunks<KIND, MF, NF, DEPTH>(96 * 1024));
#endif

// One k-chunk of a warp's weight rows in registers: kLoads packed chunks and their group words.
template <int KIND, int MF, int NF, int DEPTH>
struct QuantStreamRegs {
  uint4 w[QuantStreamTraits<KIND, MF, NF, DEPTH>::kLoads];
  unsigned g[QuantStreamTraits<KIND, MF, NF, DEPTH>::kLoads];
};

// Lane `lane`'s load i of a k-chunk: chunk q = lane + 32 i of the warp's [kRows][kChunksPerRow] block,
// so that neighbouring lanes read the neighbouring 16-byte chunks of one row.
template <int KIND, int MF, int NF, int DEPTH>
__device__ __forceinline__ void load_stream_chunk(const QuantGemmParams& p, int f0, int kt, int lane,
                                                  QuantStreamRegs<KIND, MF, NF, DEPTH>& regs) {
  using Tr = QuantStreamTraits<KIND, MF, NF, DEPTH>;
  const int chunks = p.k / Tr::kChunk;
#pragma unroll
  for (int i = 0; i < Tr::kLoads; ++i) {
    const int q = lane + 32 * i;
    const int row = f0 + q / Tr::kChunksPerRow;
    const int chunk = kt * Tr::kChunksPerRow + q % Tr::kChunksPerRow;
    regs.w[i] = make_uint4(0, 0, 0, 0);
    regs.g[i] = 0;  // zero scale: a row past n dequantizes to 0
    if (row < p.n) {
      regs.w[i] = p.weight[static_cast<long long>(row) * chunks + chunk];
      regs.g[i] = p.group_params[static_cast<long long>(row) * p.num_groups +
                                 group_of_chunk(chunk, p.chunk_group_shift, p.num_groups)];
    }
  }
}

template <int KIND, int MF, int NF, int DEPTH>
__device__ __forceinline__ void store_stream_chunk(const QuantStreamRegs<KIND, MF, NF, DEPTH>& regs, int lane,
                                                   __half* tile) {
  using Tr = QuantStreamTraits<KIND, MF, NF, DEPTH>;
#pragma unroll
  for (int i = 0; i < Tr::kLoads; ++i) {
    const int q = lane + 32 * i;
    uint4 halves[Tr::kChunk / 8];
    dequant_chunk<KIND>(regs.w[i], unpack_group_params<KIND>(regs.g[i]), halves);
    __half* dst = tile + (q / Tr::kChunksPerRow) * Tr::kLd + (q % Tr::kChunksPerRow) * Tr::kChunk;
#pragma unroll
    for (int v = 0; v < Tr::kChunk / 8; ++v) *reinterpret_cast<uint4*>(dst + 8 * v) = halves[v];
  }
}

// The block's x rows [m0, m0 + 16 MF) over columns [col0, col0 + 64 k_chunks) into x_s (row stride
// quant_stream_x_ld(k_chunks)), zeros for rows past m.
template <int KIND, int MF, int NF, int DEPTH>
__device__ __forceinline__ void stage_stream_x(const QuantGemmParams& p, int m0, int col0, int k_chunks,
                                               __half* x_s) {
  using Tr = QuantStreamTraits<KIND, MF, NF, DEPTH>;
  const __half* x = static_cast<const __half*>(p.x);
  const int vectors = k_chunks * 8;  // 16-byte vectors per row
  const int ld = quant_stream_x_ld(k_chunks);
  for (int idx = threadIdx.x; idx < Tr::kXRows * vectors; idx += Tr::kThreads) {
    const int row = idx / vectors, v = idx % vectors;
    uint4 value = make_uint4(0, 0, 0, 0);
    if (m0 + row < p.m)
      value = *reinterpret_cast<const uint4*>(x + static_cast<long long>(m0 + row) * p.x_stride + col0 + 8 * v);
    *reinterpret_cast<uint4*>(x_s + row * ld + 8 * v) = value;
  }
}

// grid: (ceil(n / (8 * 16 * NF)), ceil(m / (16 * MF)), splits), block: 256, dynamic shared memory
// quant_gemm_stream_smem_bytes(p.k_tiles_per_split). p.k_tiles_per_split counts 64-column k-chunks.
template <int KIND, int MF, int NF, int DEPTH>
__global__ void __launch_bounds__(256) quant_gemm_stream_kernel(QuantGemmParams p) {
  using namespace nvcuda;
  using Tr = QuantStreamTraits<KIND, MF, NF, DEPTH>;
  VOLTLLM_DYNAMIC_SMEM(smem);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  __half* tile = reinterpret_cast<__half*>(smem + warp * Tr::kWarpSmemBytes);
  __half* x_s = reinterpret_cast<__half*>(smem + Tr::kFixedSmemBytes);
  const int f0 = (blockIdx.x * Tr::kWarps + warp) * Tr::kRows;
  const int m0 = blockIdx.y * Tr::kXRows;
  const int k_tiles = p.k / Tr::kBlockK;
  const int kt_begin = blockIdx.z * p.k_tiles_per_split;
  const int num_tiles = min(k_tiles, kt_begin + p.k_tiles_per_split) - kt_begin;  // block-uniform
  if (num_tiles <= 0) {  // an empty split (the host sizes splits so that none is)
    begin_dependent_grid();
    return;
  }
  const bool active = f0 < p.n;  // a warp past n only helps stage x
  QuantStreamRegs<KIND, MF, NF, DEPTH> ring[DEPTH];
  if (active) {
#pragma unroll
    for (int d = 0; d < DEPTH; ++d)
      if (d < num_tiles) load_stream_chunk<KIND, MF, NF, DEPTH>(p, f0, kt_begin + d, lane, ring[d]);
  }
  begin_dependent_grid();  // x is the previous kernel's output: read only from here on
  stage_stream_x<KIND, MF, NF, DEPTH>(p, m0, kt_begin * Tr::kBlockK, num_tiles, x_s);
  __syncthreads();  // the only block-wide barrier
  if (!active) return;
  const int x_ld = quant_stream_x_ld(num_tiles);

  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[MF][NF];
#pragma unroll
  for (int i = 0; i < MF; ++i)
#pragma unroll
    for (int j = 0; j < NF; ++j) wmma::fill_fragment(acc[i][j], 0.f);
  for (int t0 = 0; t0 < num_tiles; t0 += DEPTH) {
#pragma unroll
    for (int d = 0; d < DEPTH; ++d) {
      const int t = t0 + d;
      if (t >= num_tiles) break;
      store_stream_chunk<KIND, MF, NF, DEPTH>(ring[d], lane, tile);
      if (t + DEPTH < num_tiles) load_stream_chunk<KIND, MF, NF, DEPTH>(p, f0, kt_begin + t + DEPTH, lane, ring[d]);
      __syncwarp();
#pragma unroll
      for (int kk = 0; kk < Tr::kBlockK; kk += 16) {
        wmma::fragment<wmma::matrix_b, 16, 16, 16, __half, wmma::col_major> b[NF];
#pragma unroll
        for (int j = 0; j < NF; ++j) wmma::load_matrix_sync(b[j], tile + 16 * j * Tr::kLd + kk, Tr::kLd);
#pragma unroll
        for (int i = 0; i < MF; ++i) {
          wmma::fragment<wmma::matrix_a, 16, 16, 16, __half, wmma::row_major> a;
          wmma::load_matrix_sync(a, x_s + 16 * i * x_ld + t * Tr::kBlockK + kk, x_ld);
#pragma unroll
          for (int j = 0; j < NF; ++j) wmma::mma_sync(acc[i][j], a, b[j], acc[i][j]);
        }
      }
      __syncwarp();  // the tile is rewritten by the next k-chunk
    }
  }

  // Epilogue through the warp's tile (free now): one 16x16 fp32 fragment at a time, each lane 8 columns
  // of one row.
  float* scratch = reinterpret_cast<float*>(tile);
  const __half* bias = static_cast<const __half*>(p.bias);
  const int r = lane >> 1, c0 = (lane & 1) * 8;
#pragma unroll
  for (int i = 0; i < MF; ++i)
#pragma unroll
    for (int j = 0; j < NF; ++j) {
      wmma::store_matrix_sync(scratch, acc[i][j], 16, wmma::mem_row_major);
      __syncwarp();
      const int gm = m0 + 16 * i + r;
      const int gn = f0 + 16 * j + c0;
      if (gm < p.m) {
        if (gridDim.z > 1) {
          float* dst = p.partial + static_cast<long long>(gm) * p.n;
          for (int e = 0; e < 8; ++e)
            if (gn + e < p.n) atomicAdd(dst + gn + e, scratch[r * 16 + c0 + e]);
        } else {
          __half* dst = static_cast<__half*>(p.out) + gm * p.out_stride;
          for (int e = 0; e < 8; ++e)
            if (gn + e < p.n) {
              const float b = bias ? __half2float(bias[gn + e]) : 0.f;
              dst[gn + e] = __float2half_rn(scratch[r * 16 + c0 + e] + b);
            }
        }
      }
      __syncwarp();
    }
}

}  // namespace voltllm
