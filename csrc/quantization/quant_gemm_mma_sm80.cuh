// Register-dequantizing 4-bit GEMM for 16-128 rows on SM80+ tensor cores (mma.sync m16n8k16, fp16
// operands, fp32 accumulation): out[m, f] = sum_k x[m, k] * W[f, k] (+ bias[f]) for fp16 x and a packed
// 4-bit weight in quant_common.cuh's layout, the one the GEMV reads. No second copy of the weight and no
// shared-memory tile of it: each lane dequantizes the codes it loaded straight into its B fragments.
//
// Why the row layout serves the MMA as it is. A product sums over k, so any one-to-one map of "logical"
// k positions (where the MMA's fragment layout puts an operand element) to physical columns gives the
// same result, provided x and W use the same map. Here, per 128-column stretch of a weight row (4 chunks
// of 32 codes, 64 bytes), lane (g = lane / 4, q = lane % 4) of a warp's 8-row n-tile loads chunk q of
// row g: 16 contiguous bytes, the 4 lanes of a row 64 contiguous bytes. The stretch is 8 MMA k-steps of
// 16; at step t = 2s + h the lane's 4 B-fragment elements (logical k 2q, 2q+1, 2q+8, 2q+9) are the
// codes 4h .. 4h+3 of word (s ^ q) of its chunk: physical columns 32q + 8(s ^ q) + 4h + {0, 1, 2, 3}.
// So one dequantized word (quant_common.cuh: pairs 0..3 = codes 0-1, 2-3, 4-5, 6-7) is the B fragment
// of two steps, and the A fragment's matching elements of x are 8 contiguous halves of a row: one
// 16-byte shared-memory load per row of x per two steps. The XOR with q (the lane's words rotated once
// per stretch) is only there for the banks: with rows of x 32 halves past a multiple of 64 apart, the 8
// lanes of each quarter warp then read 8 different 16-byte bank groups.
//
// Around that the block is the streaming GEMM's (quant_gemm_stream.cuh): 8 warps over one range of k
// (its split, gridDim.z), 16 MF rows of x (gridDim.x) staged in double-buffered shared-memory windows,
// 32 output features per warp (4 n-tiles, gridDim.y blocks of 256), a ring of kDepth stretches of
// packed loads in registers (the first issued before the wait for the previous kernel), and the same
// split-k epilogue: partial tiles in split order, summed by the last split of each tile.
//
// mma.sync m16n8k16 does not exist on Volta: the body compiles from SM80 on (VOLTLLM_SM80_PATH), and
// to a trap for sm_70, where the Python layer runs the streaming WMMA GEMM instead.
#pragma once

#include "attention/mma_sm80.cuh"
#include "quantization/quant_gemm_stream.cuh"

namespace voltllm {

// The register-dequantizing GEMM's tiling, in the streaming GEMM's terms (so that its x windows, split
// planning and split reduction serve it): a k-chunk (kBlockK) here is a 128-column stretch.
template <int MF, bool ASYNC = false>
struct QuantMmaTiles {
  static_assert(MF >= 1 && MF <= 4, "1-4 fragments of 16 rows of x per block");
  // x staging: ASYNC, cp.async straight into a ring of kXBuffers windows (no registers, issued two
  // windows ahead); else the streaming GEMM's register double buffer.
  static constexpr int kXBuffers = ASYNC ? 3 : 2;
  static constexpr int kNTiles = 4;                     // 8-feature n-tiles per warp
  static constexpr int kWarps = 8;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kRows = 8 * kNTiles;             // output features per warp
  static constexpr int kBlockFeatures = kWarps * kRows;
  static constexpr int kXRows = 16 * MF;
  static constexpr int kBlockK = 128;                   // one stretch: 4 chunks of 32 codes per row
  // Stretches of packed loads in flight per lane (64 bytes each): fewer as the accumulators grow.
  static constexpr int kDepth = MF == 1 ? 4 : MF == 2 ? 3 : 2;
  // x windows of stretches (16 KB of x up to 2 fragments, 12 and 16 KB at 3 and 4), two buffers; rows
  // 32 halves past a multiple of 64 apart (see the bank note above).
  static constexpr int kXWindow = MF == 1 ? 4 : MF == 2 ? 2 : 1;
  static constexpr int kXLd = kXWindow * kBlockK + 32;
  static constexpr int kXBufHalves = kXRows * kXLd;
  static constexpr int kXVectors = kXRows * kXWindow * kBlockK / 8;  // 16-byte vectors per window
  static constexpr int kXLoads = (kXVectors + kThreads - 1) / kThreads;
  static constexpr int kSmemBytes = kXBuffers * kXBufHalves * 2;
  static constexpr int kTileFloats = kXRows * kBlockFeatures;       // one block's fp32 partial tile
  static_assert(kXLd % 64 == 32, "conflict-free A loads");
  static_assert(kSmemBytes <= 96 * 1024, "shared memory");
};

#ifdef __CUDACC_RTC__
// The dynamic shared memory each variant launches with, for the sm70 gate (ptxas sees only static).
template <int MF, bool ASYNC>
__device__ const int quant_gemm_mma_smem_bytes_probe = QuantMmaTiles<MF, ASYNC>::kSmemBytes;
#endif

// The staged form's tiling (quant_gemm_mma_staged_kernel): 8 warps as 2 row halves x 4 feature groups
// of 32, MFW row fragments per warp (the block's rows: 32 MFW), 128 features per block; per 128-column
// stretch one shared-memory stage holds the block's packed weights (128 rows x 64 bytes) and its x
// (rows kXLd apart), kStages of them in a ring filled by cp.async.
template <int MFW>
struct QuantMmaStagedTiles {
  static_assert(MFW == 1 || MFW == 2, "1 or 2 row fragments per warp");
  static constexpr int kWarps = 8;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kRows = 32;                      // output features per warp
  static constexpr int kBlockFeatures = 4 * kRows;
  static constexpr int kXRows = 2 * 16 * MFW;
  static constexpr int kBlockK = 128;
  static constexpr int kStages = 3;
  static constexpr int kXWindow = 1;                    // stretches of x a stage (copy_x_window_async)
  static constexpr int kXLd = kBlockK + 32;             // ≡ 32 mod 64 halves: conflict-free A loads
  static constexpr int kWVectors = kBlockFeatures * 4;  // 16-byte chunks of weights a stage
  static constexpr int kXVectors = kXRows * kBlockK / 8;
  static constexpr int kXLoads = kXVectors / kThreads;
  static constexpr int kStageBytes = kWVectors * 16 + kXRows * kXLd * 2;
  static constexpr int kSmemBytes = kStages * kStageBytes;
  static constexpr int kTileFloats = kXRows * kBlockFeatures;
  static_assert(kWVectors % kThreads == 0 && kXVectors % kThreads == 0, "every thread copies alike");
  static_assert(kSmemBytes <= 99 * 1024, "every SM80+ GPU's opt-in shared memory");
};

#ifdef __CUDACC_RTC__
template <int MFW>
__device__ const int quant_gemm_mma_staged_smem_bytes_probe = QuantMmaStagedTiles<MFW>::kSmemBytes;
#endif

#ifdef VOLTLLM_SM80_PATH

// One stretch of a warp's weights in a lane's registers: its chunk of each n-tile's row and the group
// word of that chunk (a chunk never spans two groups).
struct QuantMmaRegs {
  uint4 w[4];
  unsigned g[4];
};

// The group parameter word of chunk `chunk` of weight row `row` (a chunk never spans two groups).
__device__ __forceinline__ unsigned load_group_word(const QuantStreamParams& p, long long row, int chunk) {
  return load_no_l1(p.group_params + row * p.num_groups + group_of_chunk(chunk, p.chunk_group_shift, p.num_groups));
}

// acc = 0 for the MF x 4 accumulators of a warp's tile.
template <int MF>
__device__ __forceinline__ void zero_mma_acc(float (&acc)[MF][4][4]) {
#pragma unroll
  for (int i = 0; i < MF; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.f;
}

// Lane (g, q)'s loads of stretch `st` (relative to the row's start) for the warp's features f0 ..
// f0 + 31: chunk 4 st + q of rows f0 + 8 j + g. Rows past n load zeros (a zero scale: weights of 0).
__device__ __forceinline__ void load_mma_stretch(const QuantStreamParams& p, int f0, int st, int lane,
                                                 QuantMmaRegs& regs) {
  const int chunks = p.k / 32;
  const int chunk = 4 * st + (lane & 3);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int row = f0 + 8 * j + (lane >> 2);
    regs.w[j] = make_uint4(0, 0, 0, 0);
    regs.g[j] = 0;
    if (row < p.n) {
      regs.w[j] = load_no_l1(p.weight + static_cast<long long>(row) * chunks + chunk);
      regs.g[j] = load_group_word(p, row, chunk);
    }
  }
}

// The chunk's words in the order the lane's steps use them: word s of the result is word s ^ q.
__device__ __forceinline__ void rotate_words(const uint4& raw, int q, unsigned (&words)[4]) {
  const bool odd = q & 1, high = q & 2;
  const unsigned a = odd ? raw.y : raw.x, b = odd ? raw.x : raw.y;
  const unsigned c = odd ? raw.w : raw.z, d = odd ? raw.z : raw.w;
  words[0] = high ? c : a;
  words[1] = high ? d : b;
  words[2] = high ? a : c;
  words[3] = high ? b : d;
}

// acc[i][j] += one stretch: 8 k-steps over the MF row fragments of x (its [kXRows][kBlockK] window
// slice `xs`, rows kXLd apart) and the warp's 4 n-tiles of dequantized weights.
template <typename Tr, int MF>
__device__ __forceinline__ void mma_stretch(const QuantMmaRegs& regs, const __half* xs, int lane,
                                            float (&acc)[MF][4][4]) {
  // xs: the warp's first row of x in the stretch's window (rows Tr::kXLd apart).
  const int g = lane >> 2, q = lane & 3;
  unsigned words[4][4];
  GroupParams<kQuantInt4> params[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    rotate_words(regs.w[j], q, words[j]);
    params[j] = unpack_group_params<kQuantInt4>(regs.g[j]);
  }
#pragma unroll
  for (int s = 0; s < 4; ++s) {
    // Steps 2s and 2s + 1 of every n-tile: pairs 0, 1 are step 2s's b[0], b[1]; pairs 2, 3 step 2s + 1's.
    __half2 b[4][4];
#pragma unroll
    for (int j = 0; j < 4; ++j) dequant_int4_word(words[j][s], params[j], b[j]);
    const int col = 32 * q + 8 * (s ^ q);
#pragma unroll
    for (int i = 0; i < MF; ++i) {
      const uint4 lo = *reinterpret_cast<const uint4*>(xs + (16 * i + g) * Tr::kXLd + col);
      const uint4 hi = *reinterpret_cast<const uint4*>(xs + (16 * i + g + 8) * Tr::kXLd + col);
      const unsigned a[2][4] = {{lo.x, hi.x, lo.y, hi.y}, {lo.z, hi.z, lo.w, hi.w}};
      // Step 2s over the 4 n-tiles, then step 2s + 1, so that an MMA never waits for the one issued just
      // before it (the asm is volatile: this order is the issue order).
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int j = 0; j < 4; ++j)
          sm80::mma<__half>(acc[i][j], a[h], bits_of_half2(b[j][2 * h]), bits_of_half2(b[j][2 * h + 1]));
    }
  }
}

// After the k loop, every thread of the block: the warp's accumulators go to out (one split) or to its
// split's partial tile, then the last split of the tile sums the partials (reduce_if_last_split).
// Accumulator (i, j) holds rows 16 i + g, 16 i + g + 8 and features 8 j + 2q, 8 j + 2q + 1 of the warp's.
// `warp_row0`: the warp's first row in the block's tile; `warp_slot`: its 32 features' place among the
// block's.
template <typename Tr, int MF>
__device__ __forceinline__ void finish_mma_tile(const QuantStreamParams& p, const float (&acc)[MF][4][4], int* flag,
                                                int m0, int block_f0, bool active, int warp_row0, int warp_slot) {
  const int lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
  const bool split = gridDim.z > 1;
  const int tile_index = blockIdx.y * gridDim.x + blockIdx.x;
  float* partial = split ? p.partial + (static_cast<long long>(blockIdx.z) * gridDim.x * gridDim.y + tile_index) *
                               Tr::kTileFloats
                         : nullptr;
  const __half* bias = static_cast<const __half*>(p.bias);
  if (active) {
#pragma unroll
    for (int i = 0; i < MF; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int r = warp_row0 + 16 * i + g + 8 * half, f = warp_slot * Tr::kRows + 8 * j + 2 * q;
          const float v0 = acc[i][j][2 * half], v1 = acc[i][j][2 * half + 1];
          if (split) {
            *reinterpret_cast<float2*>(partial + r * Tr::kBlockFeatures + f) = make_float2(v0, v1);
          } else if (m0 + r < p.m) {
            __half* dst = static_cast<__half*>(p.out) + (m0 + r) * p.out_stride + block_f0 + f;
            const int gn = block_f0 + f;
            if (gn < p.n) dst[0] = __float2half_rn(v0 + (bias ? __half2float(bias[gn]) : 0.f));
            if (gn + 1 < p.n) dst[1] = __float2half_rn(v1 + (bias ? __half2float(bias[gn + 1]) : 0.f));
          }
        }
  }
  if (split) reduce_if_last_split<Tr>(p, flag, m0, block_f0);
}

// Window `window` of the block's x (rows [m0, m0 + kXRows) over the window's stretches of the split) by
// cp.async into `buffer` (rows kXLd apart); nothing past the split's last window. Rows past m copy row
// m - 1: their products are never stored. The caller commits the group.
template <typename Tr>
__device__ __forceinline__ void copy_x_window_async(const QuantStreamParams& p, int m0, int st_begin, int num_st,
                                                    int window, __half* buffer) {
  constexpr int kRowVectors = Tr::kXWindow * Tr::kBlockK / 8;
  const int first = window * Tr::kXWindow;
  if (first < num_st) {
    const int width = min(Tr::kXWindow, num_st - first) * (Tr::kBlockK / 8);  // vectors per row copied
    const __half* x = static_cast<const __half*>(p.x) + static_cast<long long>(st_begin + first) * Tr::kBlockK;
#pragma unroll
    for (int i = 0; i < Tr::kXLoads; ++i) {
      const int idx = threadIdx.x + i * Tr::kThreads;
      const int row = idx / kRowVectors, v = idx % kRowVectors;
      if (idx < Tr::kXVectors && v < width) {
        const long long src_row = min(m0 + row, p.m - 1);
        sm80::cp_async16(buffer + row * Tr::kXLd + 8 * v, x + src_row * p.x_stride + 8 * v);
      }
    }
  }
}

// copy_x_window_async as one commit group (empty past the split's last window, so that every thread
// commits a group per window and the waits count alike).
template <typename Tr>
__device__ __forceinline__ void issue_x_window_async(const QuantStreamParams& p, int m0, int st_begin, int num_st,
                                                     int window, __half* buffer) {
  copy_x_window_async<Tr>(p, m0, st_begin, num_st, window, buffer);
  sm80::cp_async_commit();
}

// Before stretch t (block-uniform, as advance_x_window): at the start of window w, wait for its copies
// (window w + 1's may still fly), meet the barrier (after which every warp is done with window w - 1's
// buffer) and issue window w + 2 into that buffer.
template <typename Tr>
__device__ __forceinline__ void advance_x_window_async(const QuantStreamParams& p, int t, int m0, int st_begin,
                                                       int num_st, __half* x_buffers) {
  if (t % Tr::kXWindow != 0) return;
  const int w = t / Tr::kXWindow;
  sm80::cp_async_wait<1>();
  __syncthreads();
  issue_x_window_async<Tr>(p, m0, st_begin, num_st, w + 2, x_buffers + ((w + 2) % Tr::kXBuffers) * Tr::kXBufHalves);
}

template <int MF, bool ASYNC>
__device__ __forceinline__ void quant_gemm_mma_block(const QuantStreamParams& p) {
  using Tr = QuantMmaTiles<MF, ASYNC>;
  constexpr int kDepth = Tr::kDepth;
  VOLTLLM_DYNAMIC_SMEM(smem);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  __half* x_buffers = reinterpret_cast<__half*>(smem);  // [kXBuffers][kXBufHalves]
  const int m0 = blockIdx.x * Tr::kXRows;
  const int block_f0 = blockIdx.y * Tr::kBlockFeatures;
  const int f0 = block_f0 + warp * Tr::kRows;
  const int st_begin = blockIdx.z * p.chunks_per_split;
  const int num_st = min(p.k / Tr::kBlockK, st_begin + p.chunks_per_split) - st_begin;  // >= 1 (host)
  const bool active = f0 < p.n;  // a warp past n only helps stage x
  QuantMmaRegs ring[kDepth];
  if (active) {
#pragma unroll
    for (int d = 0; d < kDepth; ++d)
      if (d < num_st) load_mma_stretch(p, f0, st_begin + d, lane, ring[d]);
  }
  begin_dependent_grid();  // x is the previous kernel's output, and the counters its last writes
  uint4 x_regs[ASYNC ? 1 : Tr::kXLoads];
  if constexpr (ASYNC) {
    issue_x_window_async<Tr>(p, m0, st_begin, num_st, 0, x_buffers);
    issue_x_window_async<Tr>(p, m0, st_begin, num_st, 1, x_buffers + Tr::kXBufHalves);
  } else {
    begin_x_windows<Tr>(p, m0, st_begin, num_st, x_buffers, x_regs);
  }
  float acc[MF][4][4];
  zero_mma_acc(acc);
  for (int t0 = 0; t0 < num_st; t0 += kDepth) {
#pragma unroll
    for (int d = 0; d < kDepth; ++d) {
      const int t = t0 + d;  // block-uniform: every warp, active or not, meets the same barriers
      if (t >= num_st) break;
      if constexpr (ASYNC) {
        advance_x_window_async<Tr>(p, t, m0, st_begin, num_st, x_buffers);
      } else {
        advance_x_window<Tr>(p, t, m0, st_begin, num_st, x_buffers, x_regs);
      }
      if (!active) continue;
      const QuantMmaRegs regs = ring[d];
      if (t + kDepth < num_st) load_mma_stretch(p, f0, st_begin + t + kDepth, lane, ring[d]);
      mma_stretch<Tr, MF>(regs, x_window_chunk<Tr>(x_buffers, t), lane, acc);
    }
  }
  if constexpr (ASYNC) sm80::cp_async_wait<0>();  // the trailing (empty) groups, before the smem is reused
  // x is no longer read once every warp has passed the epilogue's first barrier: its buffer holds the
  // last-split flag.
  finish_mma_tile<Tr, MF>(p, acc, reinterpret_cast<int*>(x_buffers), m0, block_f0, active, 0, warp);
}


// The staged form's stage `stage` filled with stretch `st` (relative to the split's first) by cp.async,
// one commit group (empty past the split): the block's 128 weight rows' 4 chunks, and its x rows. Rows
// past n or m copy the last row: their products are never stored.
template <int MFW>
__device__ __forceinline__ void issue_staged_stretch(const QuantStreamParams& p, int block_f0, int m0, int st_begin,
                                                     int num_st, int st, unsigned char* stage) {
  using Tr = QuantMmaStagedTiles<MFW>;
  if (st < num_st) {
    const int chunks = p.k / 32, chunk0 = 4 * (st_begin + st);
    uint4* w = reinterpret_cast<uint4*>(stage);
#pragma unroll
    for (int i = 0; i < Tr::kWVectors / Tr::kThreads; ++i) {
      const int v = threadIdx.x + i * Tr::kThreads, row = v / 4, c = v % 4;
      const long long src_row = min(block_f0 + row, p.n - 1);
      sm80::cp_async16(w + v, p.weight + src_row * chunks + chunk0 + c);
    }
    copy_x_window_async<Tr>(p, m0, st_begin, num_st, st, reinterpret_cast<__half*>(stage + Tr::kWVectors * 16));
  }
  sm80::cp_async_commit();
}

// Lane (g, q)'s group words of stretch `st` for its 4 n-tiles' rows (rows past n: the last row's).
__device__ __forceinline__ void load_staged_groups(const QuantStreamParams& p, int f0, int st, int lane,
                                                   unsigned (&g)[4]) {
  const int chunk = 4 * st + (lane & 3);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    g[j] = load_group_word(p, min(f0 + 8 * j + (lane >> 2), p.n - 1), chunk);
  }
}

template <int MFW>
__device__ __forceinline__ void quant_gemm_mma_staged_block(const QuantStreamParams& p) {
  using Tr = QuantMmaStagedTiles<MFW>;
  constexpr int kS = Tr::kStages;
  VOLTLLM_DYNAMIC_SMEM(smem);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int row_half = warp / 4, feature_group = warp % 4;
  const int m0 = blockIdx.x * Tr::kXRows;
  const int block_f0 = blockIdx.y * Tr::kBlockFeatures;
  const int f0 = block_f0 + feature_group * Tr::kRows;
  const int st_begin = blockIdx.z * p.chunks_per_split;
  const int num_st = min(p.k / Tr::kBlockK, st_begin + p.chunks_per_split) - st_begin;  // >= 1 (host)
  const bool active = f0 < p.n;
  // Group words two stretches ahead, in registers (weights are never a kernel's output: before the wait).
  unsigned groups[4], next_groups[4];  // stretches t and t + 1
  load_staged_groups(p, f0, st_begin, lane, groups);
  if (num_st > 1) load_staged_groups(p, f0, st_begin + 1, lane, next_groups);
  begin_dependent_grid();  // x is the previous kernel's output, and the counters its last writes
#pragma unroll
  for (int st = 0; st < kS - 1; ++st)
    issue_staged_stretch<MFW>(p, block_f0, m0, st_begin, num_st, st, smem + st * Tr::kStageBytes);
  float acc[MFW][4][4];
  zero_mma_acc(acc);
  for (int t = 0; t < num_st; ++t) {
    // Stretch t has landed (t + 1 may still fly); after the barrier every warp is done with stage
    // (t - 1) % kS, which takes stretch t + kS - 1.
    sm80::cp_async_wait<kS - 2>();
    __syncthreads();
    const int ahead = t + kS - 1;
    issue_staged_stretch<MFW>(p, block_f0, m0, st_begin, num_st, ahead, smem + (ahead % kS) * Tr::kStageBytes);
    QuantMmaRegs regs;
    const unsigned char* stage = smem + (t % kS) * Tr::kStageBytes;
    const uint4* w = reinterpret_cast<const uint4*>(stage);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      regs.w[j] = w[(feature_group * Tr::kRows + 8 * j + (lane >> 2)) * 4 + (lane & 3)];
      regs.g[j] = groups[j];
      groups[j] = next_groups[j];
    }
    if (t + 2 < num_st) load_staged_groups(p, f0, st_begin + t + 2, lane, next_groups);
    const __half* xs = reinterpret_cast<const __half*>(stage + Tr::kWVectors * 16) + row_half * 16 * MFW * Tr::kXLd;
    mma_stretch<Tr, MFW>(regs, xs, lane, acc);
  }
  sm80::cp_async_wait<0>();  // the trailing (empty) groups, before the shared memory is reused
  // Rows of this warp: row_half * 16 MFW + ...: finish_mma_tile's rows are relative to the warp's first.
  finish_mma_tile<Tr, MFW>(p, acc, reinterpret_cast<int*>(smem), m0, block_f0, active, row_half * 16 * MFW,
                           feature_group);
}

#endif  // VOLTLLM_SM80_PATH

// grid: (ceil(m / (16 MF)), ceil(n / 256), splits), block: 256, dynamic shared memory
// QuantMmaTiles<MF, ASYNC>::kSmemBytes; 4-bit weights, k a multiple of 128. Row blocks vary fastest,
// so that the blocks reading the same weights run side by side (the second read hits L2). ASYNC: x
// staged by cp.async (QuantMmaTiles).
template <int MF, bool ASYNC>
__global__ void __launch_bounds__(256, 1) quant_gemm_mma_sm80_kernel(QuantStreamParams p) {
#ifdef VOLTLLM_SM80_PATH
  quant_gemm_mma_block<MF, ASYNC>(p);
#else
  begin_dependent_grid();
  __trap();  // SM80+ only: the Python layer runs the streaming WMMA GEMM on older GPUs
#endif
}

// The staged form: grid (ceil(m / (32 MFW)), ceil(n / 128), splits), block 256, dynamic shared memory
// QuantMmaStagedTiles<MFW>::kSmemBytes; 4-bit weights, k a multiple of 128. The packed weights pass
// through shared memory (cp.async, no register ring), so a thread holds far fewer registers and two
// blocks share an SM.
template <int MFW>
__global__ void __launch_bounds__(256, 2) quant_gemm_mma_staged_kernel(QuantStreamParams p) {
#ifdef VOLTLLM_SM80_PATH
  quant_gemm_mma_staged_block<MFW>(p);
#else
  begin_dependent_grid();
  __trap();  // SM80+ only, as quant_gemm_mma_sm80_kernel
#endif
}

}  // namespace voltllm
