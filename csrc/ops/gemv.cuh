// Skinny matrix product for decode: out[m, n] = sum_k x[m, k] * weight[n, k] (+ bias[n]) for one or two
// rows m; optionally with the gated MLP's SiLU-and-mul as its epilogue, and (gemv_norm_kernel) with the
// pre-norm block's residual add + RMSNorm as its prologue.
//
// At batch sizes of a token or two a linear layer is a matrix-vector product bound by reading the
// weight once; general GEMM kernels tile for reuse that is not there. Here each warp owns one output
// feature n: its lanes issue all the 16-byte loads of a chunk of the weight row and of the matching x
// slices before using any (one memory round trip per chunk), accumulate in fp32, and reduce across the
// warp. x is small and read by every warp, so it is served from cache. Plain CUDA cores: the same code
// on Volta. (Folding SiLU-and-mul into the down projection's x loads instead was tried and dropped:
// every warp recomputed the activation of the whole row, and Llama-3-8B's down projection ran 3x
// slower. As the gate/up projection's epilogue it costs one activation per output.)
#pragma once

#include "ops/activation.cuh"
#include "common.cuh"

namespace voltllm {

struct GemvParams {
  void* out;           // [rows, n], rows out_stride apart
  const void* x;       // [rows, k], rows x_stride apart
  const void* weight;  // [n, k] ([2n, k] for SWIGLU), contiguous
  const void* bias;    // [n] ([2n] for SWIGLU) or nullptr
  long long out_stride;
  long long x_stride;
  int rows;  // 1..ROWS
  int n;  // output features
  int k;  // a multiple of 8
};

constexpr int kGemvWarps = 4;  // output features per thread block

// How a warp walks its weight row(s): the same for the plain and the norm-fused kernel, so that both
// add the products in the same order.
template <int ROWS, bool SWIGLU>
struct GemvTile {
  static constexpr int kMats = SWIGLU ? 2 : 1;  // weight rows per warp
  static constexpr int kUnroll = ROWS == 1 && !SWIGLU ? 8 : 4;  // 16-byte loads per weight row in flight
  static constexpr int kStep = 32 * 8 * kUnroll;  // elements of k one round trip covers
};

template <typename T>
__device__ __forceinline__ uint4 load16(const T* ptr) {
  return *reinterpret_cast<const uint4*>(ptr);
}

template <typename T>
__device__ __forceinline__ void to_floats(uint4 raw, float (&v)[8]) {
  Vec8<T> vec;
  vec.raw = raw;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = DType<T>::to_float2(vec.pair[i]);
    v[2 * i] = f.x;
    v[2 * i + 1] = f.y;
  }
}

// Asks L2 for the lane's part of the first chunk of each weight row (elements lane * 8 + 256 u).
template <typename T, int MATS, int UNROLL>
__device__ __forceinline__ void prefetch_first_chunk(const T* const (&w_rows)[MATS], int lane, int k) {
#pragma unroll
  for (int m = 0; m < MATS; ++m) {
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      if (lane * 8 + u * 256 < k) prefetch_l2(w_rows[m] + lane * 8 + u * 256);
    }
  }
}

// acc[m][r] += the 8 products of chunk u of weight row m with the matching 8 elements x of row r, in
// element order (both GEMV kernels add in this order, so they agree bit for bit).
template <typename T, int MATS, int ROWS, int UNROLL>
__device__ __forceinline__ void fma_chunk(float (&acc)[MATS][ROWS], const uint4 (&w_raw)[MATS][UNROLL], int u, int r,
                                          uint4 x) {
  float xv[8];
  to_floats<T>(x, xv);
#pragma unroll
  for (int m = 0; m < MATS; ++m) {
    float w[8];
    to_floats<T>(w_raw[m][u], w);
#pragma unroll
    for (int j = 0; j < 8; ++j) acc[m][r] = fmaf(w[j], xv[j], acc[m][r]);
  }
}

// Issues a lane's 16-byte loads of one chunk of each of its weight rows (elements base + 256 u).
template <typename T, int MATS, int UNROLL>
__device__ __forceinline__ void load_weight_chunk(uint4 (&w_raw)[MATS][UNROLL], const T* const (&w_rows)[MATS],
                                                  int base, int k) {
#pragma unroll
  for (int m = 0; m < MATS; ++m)
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      if (base + u * 256 < k) w_raw[m][u] = load16(w_rows[m] + base + u * 256);
    }
}

// Reduces a warp's partial products of `feature` and lane 0 stores them: bias added, rounded to T as
// an unfused projection would store it, then for SWIGLU silu(gate) * up. Out = float stores that rounded
// value widened (what a cast of the T result gives: the lm_head's fp32 logits without a cast kernel).
template <typename T, int ROWS, bool SWIGLU, typename Out = T>
__device__ __forceinline__ void store_feature(float (&acc)[GemvTile<ROWS, SWIGLU>::kMats][ROWS], Out* out,
                                              long long out_stride, const T* bias, int rows, int n, int feature,
                                              int lane) {
  static_assert(is_same<Out, T>::value || (is_same<Out, float>::value && !SWIGLU), "float out: plain GEMV only");
  constexpr int kMats = GemvTile<ROWS, SWIGLU>::kMats;
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    float value[kMats];
#pragma unroll
    for (int m = 0; m < kMats; ++m) {
      const float b = bias ? DType<T>::to_float(bias[feature + m * n]) : 0.f;
      value[m] = DType<T>::to_float(DType<T>::from_float(warp_sum(acc[m][r]) + b));
    }
    const float result = SWIGLU ? silu(value[0]) * value[kMats - 1] : value[0];
    if (lane == 0 && r < rows) {
      if constexpr (is_same<Out, float>::value) {
        out[r * out_stride + feature] = result;
      } else {
        out[r * out_stride + feature] = DType<T>::from_float(result);
      }
    }
  }
}

// grid: ceil(n / kGemvWarps), block: 32 * kGemvWarps. ROWS is the most x rows handled (1 or 2).
// SWIGLU: the weight is a gate/up projection [gate; up] of 2n rows, and the warp of feature f computes
// both f and n + f and writes silu(gate) * up, so the gated MLP's activation needs no kernel of its
// own. Both products are rounded to T first, as the unfused projection would store them. Out: the
// output's element type, T or (plain GEMV) float.
template <typename T, int ROWS, bool SWIGLU, typename Out = T>
__global__ void __launch_bounds__(32 * kGemvWarps) gemv_kernel(GemvParams p) {
  using Tile = GemvTile<ROWS, SWIGLU>;
  constexpr int kMats = Tile::kMats, kUnroll = Tile::kUnroll;
  const int lane = threadIdx.x & 31;
  const int feature = blockIdx.x * kGemvWarps + (threadIdx.x >> 5);
  if (feature >= p.n) return;
  const T* weight = static_cast<const T*>(p.weight);
  const T* w_rows[kMats];
#pragma unroll
  for (int m = 0; m < kMats; ++m) w_rows[m] = weight + static_cast<long long>(feature + m * p.n) * p.k;
  // Weights are never written by a kernel: their first chunk can be on its way to L2 while the kernel
  // before this one (whose output is x) still runs. (Asking L2 for whole rows there, or loading the first
  // chunk into registers, measured no gain: benches/RESULTS.md, "Batch-1 decode (issue 21)".)
  prefetch_first_chunk<T, kMats, kUnroll>(w_rows, lane, p.k);
  begin_dependent_grid();
  const T* x = static_cast<const T*>(p.x);
  float acc[kMats][ROWS];
#pragma unroll
  for (int m = 0; m < kMats; ++m)
#pragma unroll
    for (int r = 0; r < ROWS; ++r) acc[m][r] = 0.f;
  for (int base = lane * 8; base < p.k; base += Tile::kStep) {
    uint4 w_raw[kMats][kUnroll];
    uint4 x_raw[ROWS][kUnroll];
    load_weight_chunk<T>(w_raw, w_rows, base, p.k);
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int k = base + u * 256;
        if (k < p.k && r < p.rows) x_raw[r][u] = load16(x + r * p.x_stride + k);
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int k = base + u * 256;
      if (k >= p.k) break;
#pragma unroll
      for (int r = 0; r < ROWS; ++r) {
        if (r < p.rows) fma_chunk<T>(acc, w_raw, u, r, x_raw[r][u]);
      }
    }
  }
  store_feature<T, ROWS, SWIGLU, Out>(acc, static_cast<Out*>(p.out), p.out_stride, static_cast<const T*>(p.bias),
                                      p.rows, p.n, feature, lane);
}

// ---------------------------------------------------------------------------------------------------
// Residual add + RMSNorm + GEMV in one kernel, for the projection right after a pre-norm block's norm
// (qkv; gate/up with the SwiGLU epilogue). At batch 1 the separate fused_add_rms_norm launch costs more
// than its work.
//
// Every block needs the whole normalized row, and the norm needs a reduction over the whole row, so
// each block computes it itself from hidden and residual_in (no grid-wide step) and stages it in shared
// memory; block 0 also stores the new residual. To keep those redundant reads small next to the weight
// bytes the grid is persistent: at most kGemvNormBlocksPerSm blocks per SM, each warp looping over
// output features kGemvNormWarps * gridDim.x apart, so the prologue runs once per block, not once per
// four features.

struct GemvNormParams {
  void* out;                // [rows, n], rows out_stride apart
  void* residual_out;       // [rows, k], rows residual_out_stride apart: hidden + residual_in, rounded to T;
                            // must alias neither hidden nor residual_in (other blocks still read them)
  const void* hidden;       // [rows, k], rows hidden_stride apart: the sublayer output to add
  const void* residual_in;  // [rows, k], rows residual_in_stride apart
  const void* norm_weight;  // [k]
  const void* weight;       // [n, k] ([2n, k] for SWIGLU), contiguous
  const void* bias;         // [n] ([2n] for SWIGLU) or nullptr
  long long out_stride;
  long long residual_out_stride;
  long long hidden_stride;
  long long residual_in_stride;
  float eps;  // added to the mean square
  int rows;   // 1..ROWS
  int n;      // output features
  int k;      // hidden size: a multiple of 8, at most kGemvNormMaxK
};

constexpr int kGemvNormWarps = 16;       // warps per block: few blocks, so few redundant norms
// 32 warps per SM (so at most 64 registers each): at Qwen3-0.6B sizes about one warp per feature, and
// more weight loads in flight than the memory latency needs.
constexpr int kGemvNormBlocksPerSm = 2;
constexpr int kGemvNormMaxK = 8192;      // 2 rows of normalized x take 32 KB of shared memory
// The norm runs with the thread layout of fused_add_rms_norm_kernel<T, 8> (256 threads per row), so
// that it adds the squares in the same order and the two agree bit for bit.
constexpr int kNormThreads = 256;

// Shared memory of gemv_norm_kernel: per-warp partial sums, then the normalized rows.
constexpr int kGemvNormScratchBytes = kGemvNormWarps * 4;
__host__ __device__ constexpr int gemv_norm_smem_bytes(int rows, int k) {
  return kGemvNormScratchBytes + rows * k * 2;
}

// x_s[r] = round(rms_norm(round(hidden[r] + residual_in[r])) * norm_weight) for every row, exactly as
// fused_add_rms_norm_kernel<T, 8> computes it: row r is threads [256 r, 256 r + 256), thread t sums the
// squares of elements 8 t + 2048 i in order, the warp sums are added in warp order. Block 0 also stores
// the rounded sums to residual_out. Ends before the barrier that publishes x_s.
template <typename T, int ROWS>
__device__ __forceinline__ void add_rms_norm_to_smem(const GemvNormParams& p, T* x_s, float* scratch) {
  static_assert(ROWS * kNormThreads <= 32 * kGemvNormWarps, "one 256-thread group per row");
  const int row = threadIdx.x / kNormThreads;
  const int t = threadIdx.x % kNormThreads;
  const bool active = row < p.rows;
  T* row_s = x_s + row * p.k;
  float sq = 0.f;
  if (active) {
    const T* h = static_cast<const T*>(p.hidden) + row * p.hidden_stride;
    const T* res = static_cast<const T*>(p.residual_in) + row * p.residual_in_stride;
    T* res_out = static_cast<T*>(p.residual_out) + row * p.residual_out_stride;
    for (int i = t * 8; i < p.k; i += kNormThreads * 8) {
      const uint4 sum = add_rounded_and_square(h + i, res + i, sq);
      *reinterpret_cast<uint4*>(row_s + i) = sum;
      if (blockIdx.x == 0) *reinterpret_cast<uint4*>(res_out + i) = sum;
    }
  }
  sq = warp_sum(sq);
  if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = sq;
  __syncthreads();
  if (!active) return;
  constexpr int kRowWarps = kNormThreads / 32;
  float total = 0.f;
  for (int w = 0; w < kRowWarps; ++w) total += scratch[row * kRowWarps + w];
  const float inv_rms = rsqrtf(total / p.k + p.eps);
  // Each thread rescales only the elements it staged itself: no barrier needed in between.
  const T* norm_weight = static_cast<const T*>(p.norm_weight);
  for (int i = t * 8; i < p.k; i += kNormThreads * 8) {
    float r[8], wv[8];
    load_floats(row_s + i, r);
    load_floats(norm_weight + i, wv);
#pragma unroll
    for (int j = 0; j < 8; ++j) r[j] = r[j] * inv_rms * wv[j];
    store_floats(row_s + i, r);
  }
}

// grid: min(ceil(n / kGemvNormWarps), kGemvNormBlocksPerSm * SMs), block: 32 * kGemvNormWarps, dynamic
// shared memory: gemv_norm_smem_bytes(ROWS, k). out = rms_norm(hidden + residual_in) @ weight^T (+ bias),
// SWIGLU as in gemv_kernel; the products are added in gemv_kernel's order, so given the same normalized
// x both kernels return the same bits.
template <typename T, int ROWS, bool SWIGLU>
__global__ void __launch_bounds__(32 * kGemvNormWarps, kGemvNormBlocksPerSm) gemv_norm_kernel(GemvNormParams p) {
  using Tile = GemvTile<ROWS, SWIGLU>;
  constexpr int kMats = Tile::kMats, kUnroll = Tile::kUnroll;
  VOLTLLM_DYNAMIC_SMEM(smem);
  float* scratch = reinterpret_cast<float*>(smem);                  // [kGemvNormWarps]
  T* x_s = reinterpret_cast<T*>(smem + kGemvNormScratchBytes);       // [ROWS][k]
  const int lane = threadIdx.x & 31;
  const int feature_stride = gridDim.x * kGemvNormWarps;
  int feature = blockIdx.x * kGemvNormWarps + (threadIdx.x >> 5);
  const T* weight = static_cast<const T*>(p.weight);
  // Ask L2 for the first chunk of this warp's first feature now, so that its memory latency overlaps
  // the norm and the end of the kernel before this one (weights are never written by a kernel; holding
  // the chunk in registers instead would spill at this kernel's 64-register budget).
  if (feature < p.n) {
    const T* w_rows[kMats];
#pragma unroll
    for (int m = 0; m < kMats; ++m) w_rows[m] = weight + static_cast<long long>(feature + m * p.n) * p.k;
    prefetch_first_chunk<T, kMats, kUnroll>(w_rows, lane, p.k);
  }
  begin_dependent_grid();  // hidden and residual_in come from the kernels before this one
  add_rms_norm_to_smem<T, ROWS>(p, x_s, scratch);
  __syncthreads();
  for (; feature < p.n; feature += feature_stride) {
    const T* w_rows[kMats];
    float acc[kMats][ROWS];
#pragma unroll
    for (int m = 0; m < kMats; ++m) {
      w_rows[m] = weight + static_cast<long long>(feature + m * p.n) * p.k;
#pragma unroll
      for (int r = 0; r < ROWS; ++r) acc[m][r] = 0.f;
    }
    for (int base = lane * 8; base < p.k; base += Tile::kStep) {
      uint4 w_raw[kMats][kUnroll];
      load_weight_chunk<T>(w_raw, w_rows, base, p.k);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int k = base + u * 256;
        if (k >= p.k) break;
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
          if (r < p.rows) fma_chunk<T>(acc, w_raw, u, r, load16(x_s + r * p.k + k));
        }
      }
    }
    store_feature<T, ROWS, SWIGLU>(acc, static_cast<T*>(p.out), p.out_stride, static_cast<const T*>(p.bias),
                                   p.rows, p.n, feature, lane);
  }
}

}  // namespace voltllm
