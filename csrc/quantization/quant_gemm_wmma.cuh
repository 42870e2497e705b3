// Weight-only quantized GEMM for prefill and larger batches on tensor cores (WMMA m16n16k16, fp16
// operands, fp32 accumulation; Volta-legal: no cp.async, ldmatrix or mma.sync): out[m, n] =
// sum_k x[m, k] * W[n, k] (+ bias[n]) for fp16 x [m, k] and a packed 4-bit / 8-bit / fp8 weight
// (quant_common.cuh's layout).
//
// A thread block computes a BM x 128 tile of out over a range of k (its split). Per 64-column k-tile it
// loads the x tile and the packed weight tile into registers, dequantizes the weight codes to fp16 (the
// same rounding as the reference) and stores both into shared memory, then its 8 warps run WMMA on
// them. Two shared-memory stages, fed by a ring of k-tiles in registers (up to 4 tiles' global loads
// in flight; each is stored into the free stage after the MMAs of the tile before it), so one barrier
// per k-tile suffices.
// Small m leaves few output tiles, so the host splits k over gridDim.z: each split then adds its fp32
// partial tile into a zeroed fp32 buffer (atomics), and quant_gemm_finalize_kernel adds the bias and
// rounds to fp16. quant_dequantize_kernel writes the whole fp16 weight, for a GEMM library to use at
// sizes where that wins (see voltllm/ops/quantized_linear.py).
#pragma once

#include <mma.h>

#include "quantization/quant_common.cuh"

namespace voltllm {

struct QuantGemmParams {
  void* out;                     // [m, n] fp16, rows out_stride apart (splits == 1)
  float* partial;                // [m, n] fp32, zeroed, contiguous: summed over splits (splits > 1)
  const void* x;                 // [m, k] fp16, rows x_stride apart (16-byte aligned); packed column order
  const uint4* weight;           // [n, k / kChunk] packed chunks
  const unsigned* group_params;  // [n, num_groups]
  const void* bias;              // [n] fp16 or nullptr (added here when splits == 1, else when finalizing)
  long long out_stride;
  long long x_stride;
  int m;                  // rows of x
  int n;                  // output features
  int k;                  // a multiple of kBlockK
  int num_groups;         // groups per weight row
  int chunk_group_shift;  // log2(chunks per group); unused when num_groups == 1
  int k_tiles_per_split;  // k-tiles of kBlockK columns each split (blockIdx.z) covers
};

template <int KIND, int BM>
struct QuantGemmTraits {
  static_assert(BM == 16 || BM == 64 || BM == 128, "BM is 16, 64 or 128 rows");
  static constexpr int kBlockM = BM;
  static constexpr int kBlockN = 128;
  static constexpr int kBlockK = 64;
  static constexpr int kWarps = 8;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kWarpsM = BM >= 64 ? 2 : 1;
  static constexpr int kWarpsN = kWarps / kWarpsM;
  static constexpr int kWarpM = BM / kWarpsM;           // rows of out per warp
  static constexpr int kWarpN = kBlockN / kWarpsN;      // columns of out per warp
  static constexpr int kFragsM = kWarpM / 16;
  static constexpr int kFragsN = kWarpN / 16;
  static constexpr int kLd = kBlockK + 8;               // padded fp16 row of a staged tile
  static constexpr int kStageHalves = (BM + kBlockN) * kLd;  // x tile, then weight tile
  static constexpr int kSmemBytes = 2 * kStageHalves * 2;
  static constexpr int kChunk = QuantTraits<KIND>::kChunk;
  static constexpr int kChunksPerRow = kBlockK / kChunk;      // packed chunks of one weight row per k-tile
  static constexpr int kWLoads = kBlockN * kChunksPerRow / kThreads;  // per thread per k-tile
  static constexpr int kXLoads = (BM * kBlockK / 8 + kThreads - 1) / kThreads;
  // k-tiles in flight in registers: deep where the block computes little per tile.
  static constexpr int kPrefetch = BM == 16 ? 4 : BM == 64 ? 2 : 1;
  static_assert(kWarpM % 16 == 0 && kWarpN % 16 == 0, "warp tiles are whole fragments");
  static_assert(kBlockN * kChunksPerRow % kThreads == 0, "every thread loads the same number of chunks");
  static_assert(kSmemBytes <= 96 * 1024, "Volta's shared memory");
  static_assert(kWarps * 256 * 4 <= kSmemBytes, "the epilogue's per-warp fp32 tiles fit the stages");
};

template <int KIND, int BM>
__host__ __device__ constexpr int quant_gemm_smem_bytes() {
  return QuantGemmTraits<KIND, BM>::kSmemBytes;
}

// The dynamic shared memory each variant launches with, emitted into the PTX so the sm70 gate can
// report it (ptxas only sees static shared memory). Only the gate (NVRTC) needs it.
#ifdef __CUDACC_RTC__
template <int KIND, int BM>
__device__ const int quant_gemm_wmma_smem_bytes = QuantGemmTraits<KIND, BM>::kSmemBytes;
#endif

// The registers one k-tile passes through between its global loads and its shared-memory stores.
template <int KIND, int BM>
struct QuantGemmTileRegs {
  uint4 x[QuantGemmTraits<KIND, BM>::kXLoads];
  uint4 w[QuantGemmTraits<KIND, BM>::kWLoads];
  unsigned g[QuantGemmTraits<KIND, BM>::kWLoads];
};

template <int KIND, int BM>
__device__ __forceinline__ void load_gemm_tile(const QuantGemmParams& p, int m0, int n0, int kt,
                                               QuantGemmTileRegs<KIND, BM>& regs) {
  using Tr = QuantGemmTraits<KIND, BM>;
  const __half* x = static_cast<const __half*>(p.x);
#pragma unroll
  for (int i = 0; i < Tr::kXLoads; ++i) {
    const int idx = threadIdx.x + i * Tr::kThreads;  // (row, 8-column vector) of the x tile
    const int row = idx / (Tr::kBlockK / 8), col = (idx % (Tr::kBlockK / 8)) * 8;
    regs.x[i] = make_uint4(0, 0, 0, 0);
    if (idx < BM * Tr::kBlockK / 8 && m0 + row < p.m)
      regs.x[i] = *reinterpret_cast<const uint4*>(x + (m0 + row) * p.x_stride + kt * Tr::kBlockK + col);
  }
  const int chunks = p.k / Tr::kChunk;
#pragma unroll
  for (int i = 0; i < Tr::kWLoads; ++i) {
    const int idx = threadIdx.x + i * Tr::kThreads;  // (weight row, chunk) of the tile
    const int row = idx / Tr::kChunksPerRow;
    const int chunk = kt * Tr::kChunksPerRow + idx % Tr::kChunksPerRow;
    regs.w[i] = make_uint4(0, 0, 0, 0);
    regs.g[i] = 0;  // zero scale: a missing row dequantizes to 0
    if (n0 + row < p.n) {
      const long long r = n0 + row;
      regs.w[i] = p.weight[r * chunks + chunk];
      regs.g[i] = p.group_params[r * p.num_groups + group_of_chunk(chunk, p.chunk_group_shift, p.num_groups)];
    }
  }
}

// Stores a loaded k-tile into a stage: x as it is, the weight dequantized, both [row][kLd].
template <int KIND, int BM>
__device__ __forceinline__ void store_gemm_tile(const QuantGemmTileRegs<KIND, BM>& regs, __half* stage) {
  using Tr = QuantGemmTraits<KIND, BM>;
  __half* x_s = stage;
  __half* w_s = stage + BM * Tr::kLd;
#pragma unroll
  for (int i = 0; i < Tr::kXLoads; ++i) {
    const int idx = threadIdx.x + i * Tr::kThreads;
    const int row = idx / (Tr::kBlockK / 8), col = (idx % (Tr::kBlockK / 8)) * 8;
    if (idx < BM * Tr::kBlockK / 8) *reinterpret_cast<uint4*>(x_s + row * Tr::kLd + col) = regs.x[i];
  }
#pragma unroll
  for (int i = 0; i < Tr::kWLoads; ++i) {
    const int idx = threadIdx.x + i * Tr::kThreads;
    const int row = idx / Tr::kChunksPerRow, col = (idx % Tr::kChunksPerRow) * Tr::kChunk;
    uint4 halves[Tr::kChunk / 8];
    dequant_chunk<KIND>(regs.w[i], unpack_group_params<KIND>(regs.g[i]), halves);
#pragma unroll
    for (int v = 0; v < Tr::kChunk / 8; ++v)
      *reinterpret_cast<uint4*>(w_s + row * Tr::kLd + col + 8 * v) = halves[v];
  }
}

// grid: (ceil(n / 128), ceil(m / BM), splits), block: 256, dynamic shared memory:
// quant_gemm_smem_bytes<KIND, BM>(). Split z covers k-tiles [z, z + 1) * k_tiles_per_split.
template <int KIND, int BM>
__global__ void __launch_bounds__(256) quant_gemm_wmma_kernel(QuantGemmParams p) {
  using namespace nvcuda;
  using Tr = QuantGemmTraits<KIND, BM>;
  VOLTLLM_DYNAMIC_SMEM(smem);
  __half* stages = reinterpret_cast<__half*>(smem);  // [2][kStageHalves]
  const int n0 = blockIdx.x * Tr::kBlockN, m0 = blockIdx.y * BM;
  const int k_tiles = p.k / Tr::kBlockK;
  const int kt_begin = blockIdx.z * p.k_tiles_per_split;
  const int kt_end = min(k_tiles, kt_begin + p.k_tiles_per_split);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int warp_m = warp / Tr::kWarpsN, warp_n = warp % Tr::kWarpsN;
  begin_dependent_grid();
  if (kt_begin >= kt_end) return;  // an empty split (the host sizes splits so that none is)

  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[Tr::kFragsM][Tr::kFragsN];
#pragma unroll
  for (int i = 0; i < Tr::kFragsM; ++i)
#pragma unroll
    for (int j = 0; j < Tr::kFragsN; ++j) wmma::fill_fragment(acc[i][j], 0.f);

  // A ring of kPrefetch k-tiles in registers: ring slot r holds the tiles t with t % kPrefetch == r,
  // loaded kPrefetch tiles ahead of their use, so that kPrefetch tiles' global loads are in flight
  // while a tile is multiplied (at a few rows of x the block does little else than wait for memory).
  constexpr int kPrefetch = Tr::kPrefetch;
  const int num_tiles = kt_end - kt_begin;
  QuantGemmTileRegs<KIND, BM> ring[kPrefetch];
#pragma unroll
  for (int r = 0; r < kPrefetch; ++r)
    if (r < num_tiles) load_gemm_tile<KIND, BM>(p, m0, n0, kt_begin + r, ring[r]);
  store_gemm_tile<KIND, BM>(ring[0], stages);
  if (kPrefetch < num_tiles) load_gemm_tile<KIND, BM>(p, m0, n0, kt_begin + kPrefetch, ring[0]);
  __syncthreads();
  for (int t0 = 0; t0 < num_tiles; t0 += kPrefetch) {
#pragma unroll
    for (int d = 0; d < kPrefetch; ++d) {
      const int t = t0 + d;  // the tile multiplied now, from stage t & 1
      if (t >= num_tiles) break;
      const __half* x_s = stages + (t & 1) * Tr::kStageHalves;
      const __half* w_s = x_s + BM * Tr::kLd;
#pragma unroll
      for (int kk = 0; kk < Tr::kBlockK; kk += 16) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, __half, wmma::row_major> a[Tr::kFragsM];
        wmma::fragment<wmma::matrix_b, 16, 16, 16, __half, wmma::col_major> b[Tr::kFragsN];
#pragma unroll
        for (int i = 0; i < Tr::kFragsM; ++i)
          wmma::load_matrix_sync(a[i], x_s + (warp_m * Tr::kWarpM + 16 * i) * Tr::kLd + kk, Tr::kLd);
#pragma unroll
        for (int j = 0; j < Tr::kFragsN; ++j)
          wmma::load_matrix_sync(b[j], w_s + (warp_n * Tr::kWarpN + 16 * j) * Tr::kLd + kk, Tr::kLd);
#pragma unroll
        for (int i = 0; i < Tr::kFragsM; ++i)
#pragma unroll
          for (int j = 0; j < Tr::kFragsN; ++j) wmma::mma_sync(acc[i][j], a[i], b[j], acc[i][j]);
      }
      // Tile t + 1 (ring slot (d + 1) % kPrefetch) into the other stage, last read in the previous
      // iteration, before the barrier that ended it; then that slot takes tile t + 1 + kPrefetch.
      const int next = (d + 1) % kPrefetch;
      if (t + 1 < num_tiles) {
        store_gemm_tile<KIND, BM>(ring[next], stages + ((t + 1) & 1) * Tr::kStageHalves);
        if (t + 1 + kPrefetch < num_tiles)
          load_gemm_tile<KIND, BM>(p, m0, n0, kt_begin + t + 1 + kPrefetch, ring[next]);
      }
      __syncthreads();
    }
  }

  // Epilogue: each warp stages one 16x16 fp32 tile at a time in its own scratch (the stages are free:
  // the loop ended on a barrier); each lane then handles 8 consecutive columns of one row.
  float* scratch = reinterpret_cast<float*>(smem) + warp * 256;
  const __half* bias = static_cast<const __half*>(p.bias);
  const int r = lane >> 1, c0 = (lane & 1) * 8;
#pragma unroll
  for (int i = 0; i < Tr::kFragsM; ++i)
#pragma unroll
    for (int j = 0; j < Tr::kFragsN; ++j) {
      wmma::store_matrix_sync(scratch, acc[i][j], 16, wmma::mem_row_major);
      __syncwarp();
      const int gm = m0 + warp_m * Tr::kWarpM + 16 * i + r;
      const int gn = n0 + warp_n * Tr::kWarpN + 16 * j + c0;
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

struct QuantGemmFinalizeParams {
  void* out;             // [m, n] fp16, rows out_stride apart
  const float* partial;  // [m, n] fp32, contiguous
  const void* bias;      // [n] fp16 or nullptr
  long long out_stride;
  int m;
  int n;
};

// grid: (m), block: 256. out = round(partial + bias): the split-k sum, rounded once.
__global__ void __launch_bounds__(256) quant_gemm_finalize_kernel(QuantGemmFinalizeParams p) {
  begin_dependent_grid();
  const int row = blockIdx.x;
  const float* src = p.partial + static_cast<long long>(row) * p.n;
  __half* dst = static_cast<__half*>(p.out) + row * p.out_stride;
  const __half* bias = static_cast<const __half*>(p.bias);
  for (int c = threadIdx.x; c < p.n; c += blockDim.x)
    dst[c] = __float2half_rn(src[c] + (bias ? __half2float(bias[c]) : 0.f));
}

struct QuantDequantizeParams {
  void* out;                     // [n, k] fp16, contiguous: the dense weight (packed column order)
  const uint4* weight;           // [n, k / kChunk] packed chunks
  const unsigned* group_params;  // [n, num_groups]
  int n;
  int k;
  int num_groups;
  int chunk_group_shift;
};

// grid: ceil(n * k / kChunk / 256), block: 256; a thread per packed chunk.
template <int KIND>
__global__ void __launch_bounds__(256) quant_dequantize_kernel(QuantDequantizeParams p) {
  constexpr int kChunk = QuantTraits<KIND>::kChunk;
  begin_dependent_grid();
  const int chunks = p.k / kChunk;
  const long long idx = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= static_cast<long long>(p.n) * chunks) return;
  const long long row = idx / chunks;
  const int chunk = static_cast<int>(idx % chunks);
  const unsigned g = p.group_params[row * p.num_groups + group_of_chunk(chunk, p.chunk_group_shift, p.num_groups)];
  uint4 halves[kChunk / 8];
  dequant_chunk<KIND>(p.weight[idx], unpack_group_params<KIND>(g), halves);
  uint4* dst = reinterpret_cast<uint4*>(static_cast<__half*>(p.out) + idx * kChunk);
#pragma unroll
  for (int v = 0; v < kChunk / 8; ++v) dst[v] = halves[v];
}

}  // namespace voltllm
