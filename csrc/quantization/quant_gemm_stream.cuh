// Weight-streaming quantized GEMM for 4-128 rows on tensor cores (WMMA m16n16k16, fp16 operands, fp32
// accumulation; Volta-legal): out[m, f] = sum_k x[m, k] * W[f, k] (+ bias[f]) for fp16 x and a packed
// 4-bit / 8-bit / fp8 weight (quant_common.cuh's layout).
//
// At tens of rows the product reads far more weight bytes than it computes on, so the kernel is organised
// around keeping enough packed-weight loads in flight (about 100 KB per SM, as the GEMV) rather than
// around tile reuse:
// - a block is 8 warps over one range of k (its split, gridDim.z) and 16 rows of x per fragment (MF of
//   them, gridDim.x row blocks); every warp owns 16 * NF output features (gridDim.y blocks of features);
// - each warp streams its features' packed rows through a ring of kDepth 64-column k-chunks in
//   registers (128 bytes per lane in flight; the first ones issued before waiting for the previous
//   kernel: weights are never a kernel's output), dequantizes each chunk into its own shared-memory tile
//   (no block barrier: a warp only waits for itself) and multiplies it (WMMA matrix_b) with the MF
//   fragments of x;
// - x comes through shared memory in windows of kXWindow k-chunks, double-buffered: the block loads the
//   next window into registers while it multiplies the current one, with one barrier per window (a
//   fragment read from global memory touches 16 rows' cache lines per load: session 9's first version
//   was L1-bound on it; staging a split's whole x at once cost session 9's second version its occupancy);
// - splits write fp32 partial tiles to a workspace and count themselves on a per-tile counter; the last
//   split of a tile adds the partials in split order (deterministic), adds the bias, writes fp16 and
//   resets the counter for the next call. One kernel, no zeroed buffer, no atomics on the output.
#pragma once

#include <mma.h>

#include "quantization/quant_common.cuh"

namespace voltllm {

struct QuantStreamParams {
  void* out;                     // [m, n] fp16, rows out_stride apart
  float* partial;                // splits > 1: [splits][tiles][kTileFloats] fp32 (any contents)
  unsigned* split_counters;      // splits > 1: [tiles], zero between calls (the last split resets its own)
  const void* x;                 // [m, k] fp16, rows x_stride apart (16-byte aligned); packed column order
  const uint4* weight;           // [n, k / kChunk] packed chunks
  const unsigned* group_params;  // [n, num_groups]
  const void* bias;              // [n] fp16 or nullptr
  long long out_stride;
  long long x_stride;
  int m;                  // rows of x
  int n;                  // output features
  int k;                  // a multiple of kBlockK
  int num_groups;         // groups per weight row
  int chunk_group_shift;  // log2(chunks per group); unused when num_groups == 1
  int chunks_per_split;   // 64-column k-chunks each split (blockIdx.z) covers
};

// The weight-streaming GEMM's tiling (once shared with the removed register-dequantizing GEMM,
// docs/quantization.md): a block of 8 warps, 16 MF rows of x, 16 NF output features per warp,
// 64-column k-chunks, x staged in double-buffered windows and the split-k partial tiles.
template <int MF, int NF>
struct QuantStreamTiles {
  static_assert(MF >= 1 && MF <= 4 && (NF == 1 || NF == 2), "1-4 fragments of x, 1-2 of weights per warp");
  static constexpr int kMFrags = MF, kNFrags = NF;
  static constexpr int kWarps = 8;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kRows = 16 * NF;                 // weight rows (output features) per warp
  static constexpr int kBlockFeatures = kWarps * kRows;
  static constexpr int kXRows = 16 * MF;                // rows of x per block
  static constexpr int kBlockK = 64;                    // columns per k-chunk
  // k-chunks' packed weights in flight per lane: 128 bytes while the accumulators are few, less as they
  // grow, so that two blocks fit an SM's registers unspilled (128 per thread).
  static constexpr int kLaneBytesInFlight = MF * NF <= 2 ? 128 : MF * NF <= 4 ? 64 : 32;
  // x windows of k-chunks (16 KB of x up to 2 fragments, 12 and 8 KB at 3 and 4), two buffers.
  static constexpr int kXBuffers = 2;
  static constexpr int kXWindow = MF == 1 ? 8 : MF == 2 ? 4 : MF == 3 ? 2 : 1;
  static constexpr int kXLd = kXWindow * kBlockK + 8;               // 16 bytes of padding: no bank conflicts
  static constexpr int kXBufHalves = kXRows * kXLd;
  static constexpr int kXVectors = kXRows * kXWindow * kBlockK / 8;  // 16-byte vectors per window
  static constexpr int kXLoads = (kXVectors + kThreads - 1) / kThreads;
  static constexpr int kXSmemBytes = kXBuffers * kXBufHalves * 2;
  static constexpr int kTileFloats = kXRows * kBlockFeatures;       // one block's fp32 partial tile
};

template <int KIND, int MF, int NF>
struct QuantStreamTraits : QuantStreamTiles<MF, NF> {
  using Tiles = QuantStreamTiles<MF, NF>;
  static constexpr int kRows = Tiles::kRows, kBlockK = Tiles::kBlockK;
  static constexpr int kChunk = QuantTraits<KIND>::kChunk;
  static constexpr int kChunksPerRow = kBlockK / kChunk;             // 2 (4-bit) or 4 (8-bit)
  static constexpr int kLoads = kRows * kChunksPerRow / 32;          // 16-byte chunks per lane per k-chunk
  static constexpr int kDepth =
      Tiles::kLaneBytesInFlight / 16 / kLoads > 1 ? Tiles::kLaneBytesInFlight / 16 / kLoads : 1;
  static constexpr int kLd = kBlockK + 8;                            // padded fp16 row of the warp's tile
  static constexpr int kWarpSmemBytes = kRows * kLd * 2;
  static constexpr int kSmemBytes = Tiles::kWarps * kWarpSmemBytes + Tiles::kXSmemBytes;
  static_assert(kRows * kChunksPerRow % 32 == 0, "every lane loads the same number of chunks");
  static_assert(kWarpSmemBytes >= 16 * 16 * 4, "the epilogue's fp32 fragment fits the warp's tile");
  static_assert(kSmemBytes <= 96 * 1024, "Volta's shared memory");
};

template <int KIND, int MF, int NF>
__host__ __device__ constexpr int quant_gemm_stream_smem_bytes() {
  return QuantStreamTraits<KIND, MF, NF>::kSmemBytes;
}

#ifdef __CUDACC_RTC__
// The dynamic shared memory each variant launches with, for the sm70 gate (ptxas sees only static).
template <int KIND, int MF, int NF>
__device__ const int quant_gemm_stream_smem_bytes_probe = QuantStreamTraits<KIND, MF, NF>::kSmemBytes;
#endif

// One k-chunk of a warp's weight rows in registers: kLoads packed chunks and their group words.
template <int KIND, int MF, int NF>
struct QuantStreamRegs {
  uint4 w[QuantStreamTraits<KIND, MF, NF>::kLoads];
  unsigned g[QuantStreamTraits<KIND, MF, NF>::kLoads];
};

// Lane `lane`'s load i of k-chunk kt: chunk q = lane + 32 i of the warp's [kRows][kChunksPerRow] block,
// so that neighbouring lanes read the neighbouring 16-byte chunks of one row.
template <int KIND, int MF, int NF>
__device__ __forceinline__ void load_stream_chunk(const QuantStreamParams& p, int f0, int kt, int lane,
                                                  QuantStreamRegs<KIND, MF, NF>& regs) {
  using Tr = QuantStreamTraits<KIND, MF, NF>;
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

// The chunk's weights dequantized into the warp's [kRows][kLd] fp16 tile.
template <int KIND, int MF, int NF>
__device__ __forceinline__ void store_stream_chunk(const QuantStreamRegs<KIND, MF, NF>& regs, int lane,
                                                   __half* tile) {
  using Tr = QuantStreamTraits<KIND, MF, NF>;
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

// Window `window` of the block's x: rows [m0, m0 + kXRows) over the window's k-chunks of the split
// (which starts at chunk kt_begin and has num_chunks), as this thread's kXLoads 16-byte vectors; zeros
// for rows past m (the window's columns past the split are never read and not loaded).
template <typename Tr>
__device__ __forceinline__ void load_x_window(const QuantStreamParams& p, int m0, int kt_begin, int num_chunks,
                                              int window, uint4 (&regs)[Tr::kXLoads]) {
  constexpr int kRowVectors = Tr::kXWindow * Tr::kBlockK / 8;
  const int first = window * Tr::kXWindow;
  const int width = min(Tr::kXWindow, num_chunks - first) * (Tr::kBlockK / 8);  // vectors per row loaded
  const __half* x = static_cast<const __half*>(p.x) + static_cast<long long>(kt_begin + first) * Tr::kBlockK;
#pragma unroll
  for (int i = 0; i < Tr::kXLoads; ++i) {
    const int idx = threadIdx.x + i * Tr::kThreads;
    const int row = idx / kRowVectors, v = idx % kRowVectors;
    regs[i] = make_uint4(0, 0, 0, 0);
    if (idx < Tr::kXVectors && v < width && m0 + row < p.m)
      regs[i] = *reinterpret_cast<const uint4*>(x + static_cast<long long>(m0 + row) * p.x_stride + 8 * v);
  }
}

template <typename Tr>
__device__ __forceinline__ void store_x_window(const uint4 (&regs)[Tr::kXLoads], __half* buffer) {
  constexpr int kRowVectors = Tr::kXWindow * Tr::kBlockK / 8;
#pragma unroll
  for (int i = 0; i < Tr::kXLoads; ++i) {
    const int idx = threadIdx.x + i * Tr::kThreads;
    if (idx < Tr::kXVectors)
      *reinterpret_cast<uint4*>(buffer + (idx / kRowVectors) * Tr::kXLd + 8 * (idx % kRowVectors)) = regs[i];
  }
}

// A load of 16 bytes another block wrote (the split partials): through L2, never a stale L1 line.
__device__ __forceinline__ float4 load_from_l2(const float* ptr) {
#ifdef VOLTLLM_EMULATE
  return *reinterpret_cast<const float4*>(ptr);
#else
  return __ldcg(reinterpret_cast<const float4*>(ptr));
#endif
}

// The last split of a tile: out = sum of the splits' partial tiles in split order (+ bias), in fp16.
template <typename Tr>
__device__ __forceinline__ void reduce_split_tiles(const QuantStreamParams& p, int tile, int tiles, int m0,
                                                   int block_f0) {
  const __half* bias = static_cast<const __half*>(p.bias);
  for (int e = 4 * threadIdx.x; e < Tr::kTileFloats; e += 4 * Tr::kThreads) {
    const int gm = m0 + e / Tr::kBlockFeatures, gn = block_f0 + e % Tr::kBlockFeatures;
    if (gm >= p.m || gn >= p.n) continue;
    float sum[4] = {0.f, 0.f, 0.f, 0.f};
    for (int z = 0; z < static_cast<int>(gridDim.z); ++z) {
      const float4 v = load_from_l2(p.partial + (static_cast<long long>(z) * tiles + tile) * Tr::kTileFloats + e);
      sum[0] += v.x;
      sum[1] += v.y;
      sum[2] += v.z;
      sum[3] += v.w;
    }
    __half* dst = static_cast<__half*>(p.out) + gm * p.out_stride + gn;
    for (int q = 0; q < 4 && gn + q < p.n; ++q)
      dst[q] = __float2half_rn(sum[q] + (bias ? __half2float(bias[gn + q]) : 0.f));
  }
}

// After a block of a k split has stored its partial tile (every thread of the block calls this: it has
// barriers): the last split of the tile to finish sums the partial tiles into out (reduce_split_tiles)
// and resets the tile's counter. The partial stores are made visible before the count (fence, then the
// barrier that orders every thread's stores before thread 0's increment). `flag`: 4 bytes of shared
// memory no thread reads any more.
template <typename Tr>
__device__ __forceinline__ void reduce_if_last_split(const QuantStreamParams& p, int* flag, int m0, int block_f0) {
  const int tile_index = blockIdx.y * gridDim.x + blockIdx.x;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    const unsigned done = atomicAdd(p.split_counters + tile_index, 1u);
    *flag = done == gridDim.z - 1;
  }
  __syncthreads();
  if (!*flag) return;
  __threadfence();
  reduce_split_tiles<Tr>(p, tile_index, gridDim.x * gridDim.y, m0, block_f0);
  if (threadIdx.x == 0) p.split_counters[tile_index] = 0;  // ready for the next call (or graph replay)
}

// The first x window staged and the second's loads issued, then the barrier before the k loop.
template <typename Tr>
__device__ __forceinline__ void begin_x_windows(const QuantStreamParams& p, int m0, int kt_begin, int num_chunks,
                                                __half* x_buffers, uint4 (&x_regs)[Tr::kXLoads]) {
  load_x_window<Tr>(p, m0, kt_begin, num_chunks, 0, x_regs);
  store_x_window<Tr>(x_regs, x_buffers);
  if (num_chunks > Tr::kXWindow) load_x_window<Tr>(p, m0, kt_begin, num_chunks, 1, x_regs);
  __syncthreads();
}

// Before k-chunk t (block-uniform: every warp, active or not, calls it for every t, so that all meet the
// same barriers): at the start of window w > 0 the registers' window w goes into buffer w & 1, last read
// in window w - 2 (before the barrier that began w - 1), and window w + 1's loads are issued.
template <typename Tr>
__device__ __forceinline__ void advance_x_window(const QuantStreamParams& p, int t, int m0, int kt_begin,
                                                 int num_chunks, __half* x_buffers, uint4 (&x_regs)[Tr::kXLoads]) {
  if (t > 0 && t % Tr::kXWindow == 0) {
    const int w = t / Tr::kXWindow;
    store_x_window<Tr>(x_regs, x_buffers + (w & 1) * Tr::kXBufHalves);
    __syncthreads();
    if ((w + 1) * Tr::kXWindow < num_chunks) load_x_window<Tr>(p, m0, kt_begin, num_chunks, w + 1, x_regs);
  }
}

// The staged x of k-chunk t: [kXRows][kBlockK] halves, rows kXLd apart, in the ring of Tr::kXBuffers
// windows.
template <typename Tr>
__device__ __forceinline__ const __half* x_window_chunk(const __half* x_buffers, int t) {
  return x_buffers + ((t / Tr::kXWindow) % Tr::kXBuffers) * Tr::kXBufHalves + (t % Tr::kXWindow) * Tr::kBlockK;
}

template <typename Tr>
using QuantStreamAcc = nvcuda::wmma::fragment<nvcuda::wmma::accumulator, 16, 16, 16, float>[Tr::kMFrags][Tr::kNFrags];

// After the k loop, called by every thread of the block (it has barriers): the warp's accumulators go
// to out (one split) or to its split's partial tile through `scratch` (the warp's own 1 KB of shared
// memory), one 16x16 fp32 fragment at a time, each lane 8 columns of one row; then the last split of the
// tile to finish sums the partial tiles. `flag`: 4 bytes of shared memory no warp reads any more.
template <typename Tr>
__device__ __forceinline__ void finish_stream_tile(const QuantStreamParams& p, const QuantStreamAcc<Tr>& acc,
                                                   float* scratch, int* flag, int m0, int block_f0, int f0,
                                                   bool active) {
  using namespace nvcuda;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int tile_index = blockIdx.y * gridDim.x + blockIdx.x;
  const int tiles = gridDim.x * gridDim.y;
  const bool split = gridDim.z > 1;
  float* partial = split ? p.partial + (static_cast<long long>(blockIdx.z) * tiles + tile_index) * Tr::kTileFloats
                         : nullptr;
  const __half* bias = static_cast<const __half*>(p.bias);
  const int r = lane >> 1, c0 = (lane & 1) * 8;
  if (active) {
#pragma unroll
    for (int i = 0; i < Tr::kMFrags; ++i)
#pragma unroll
      for (int j = 0; j < Tr::kNFrags; ++j) {
        wmma::store_matrix_sync(scratch, acc[i][j], 16, wmma::mem_row_major);
        __syncwarp();
        const float* src = scratch + r * 16 + c0;
        if (split) {
          float* dst = partial + (16 * i + r) * Tr::kBlockFeatures + warp * Tr::kRows + 16 * j + c0;
          reinterpret_cast<float4*>(dst)[0] = make_float4(src[0], src[1], src[2], src[3]);
          reinterpret_cast<float4*>(dst)[1] = make_float4(src[4], src[5], src[6], src[7]);
        } else {
          const int gm = m0 + 16 * i + r, gn = f0 + 16 * j + c0;
          if (gm < p.m) {
            __half* dst = static_cast<__half*>(p.out) + gm * p.out_stride;
            for (int e = 0; e < 8 && gn + e < p.n; ++e)
              dst[gn + e] = __float2half_rn(src[e] + (bias ? __half2float(bias[gn + e]) : 0.f));
          }
        }
        __syncwarp();
      }
  }
  if (split) reduce_if_last_split<Tr>(p, flag, m0, block_f0);
}

// Blocks the kernel is compiled to fit per SM: two from SM80 (128 registers per thread: the ring of
// weight loads is sized for it); on Volta, whose WMMA fragments take more registers, one (unspilled).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
constexpr int kQuantStreamMinBlocks = 1;
#else
constexpr int kQuantStreamMinBlocks = 2;
#endif

// grid: (ceil(m / (16 MF)), ceil(n / (128 NF)), splits), block: 256, dynamic shared memory
// quant_gemm_stream_smem_bytes<KIND, MF, NF>(). Row blocks vary fastest, so that the blocks reading the
// same weights run side by side (the second read hits L2).
template <int KIND, int MF, int NF>
__global__ void __launch_bounds__(256, kQuantStreamMinBlocks) quant_gemm_stream_kernel(QuantStreamParams p) {
  using namespace nvcuda;
  using Tr = QuantStreamTraits<KIND, MF, NF>;
  constexpr int kDepth = Tr::kDepth;
  VOLTLLM_DYNAMIC_SMEM(smem);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  __half* tile = reinterpret_cast<__half*>(smem + warp * Tr::kWarpSmemBytes);
  __half* x_buffers = reinterpret_cast<__half*>(smem + Tr::kWarps * Tr::kWarpSmemBytes);  // [2][kXBufHalves]
  const int m0 = blockIdx.x * Tr::kXRows;
  const int block_f0 = blockIdx.y * Tr::kBlockFeatures;
  const int f0 = block_f0 + warp * Tr::kRows;
  const int kt_begin = blockIdx.z * p.chunks_per_split;
  const int num_chunks = min(p.k / Tr::kBlockK, kt_begin + p.chunks_per_split) - kt_begin;  // >= 1 (host)
  const bool active = f0 < p.n;  // a warp past n only helps stage x
  QuantStreamRegs<KIND, MF, NF> ring[kDepth];
  if (active) {
#pragma unroll
    for (int d = 0; d < kDepth; ++d)
      if (d < num_chunks) load_stream_chunk<KIND, MF, NF>(p, f0, kt_begin + d, lane, ring[d]);
  }
  begin_dependent_grid();  // x is the previous kernel's output, and the counters its last writes
  uint4 x_regs[Tr::kXLoads];
  begin_x_windows<Tr>(p, m0, kt_begin, num_chunks, x_buffers, x_regs);

  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[MF][NF];
#pragma unroll
  for (int i = 0; i < MF; ++i)
#pragma unroll
    for (int j = 0; j < NF; ++j) wmma::fill_fragment(acc[i][j], 0.f);
  for (int t0 = 0; t0 < num_chunks; t0 += kDepth) {
#pragma unroll
    for (int d = 0; d < kDepth; ++d) {
      const int t = t0 + d;  // block-uniform: every warp, active or not, meets the same barriers
      if (t >= num_chunks) break;
      advance_x_window<Tr>(p, t, m0, kt_begin, num_chunks, x_buffers, x_regs);
      if (!active) continue;
      store_stream_chunk<KIND, MF, NF>(ring[d], lane, tile);
      if (t + kDepth < num_chunks) load_stream_chunk<KIND, MF, NF>(p, f0, kt_begin + t + kDepth, lane, ring[d]);
      __syncwarp();
      const __half* x_s = x_window_chunk<Tr>(x_buffers, t);
#pragma unroll
      for (int kk = 0; kk < Tr::kBlockK; kk += 16) {
        wmma::fragment<wmma::matrix_b, 16, 16, 16, __half, wmma::col_major> b[NF];
#pragma unroll
        for (int j = 0; j < NF; ++j) wmma::load_matrix_sync(b[j], tile + 16 * j * Tr::kLd + kk, Tr::kLd);
#pragma unroll
        for (int i = 0; i < MF; ++i) {
          wmma::fragment<wmma::matrix_a, 16, 16, 16, __half, wmma::row_major> a;
          wmma::load_matrix_sync(a, x_s + 16 * i * Tr::kXLd + kk, Tr::kXLd);
#pragma unroll
          for (int j = 0; j < NF; ++j) wmma::mma_sync(acc[i][j], a, b[j], acc[i][j]);
        }
      }
      __syncwarp();  // the tile is rewritten by the next k-chunk
    }
  }
  // The epilogue goes through the warp's tile (free now); x is no longer read once every warp has
  // passed the epilogue's barrier, so its buffer holds the last-split flag.
  finish_stream_tile<Tr>(p, acc, reinterpret_cast<float*>(tile), reinterpret_cast<int*>(x_buffers), m0, block_f0,
                         f0, active);
}

}  // namespace voltllm
