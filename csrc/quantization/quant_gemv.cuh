// Weight-only quantized GEMV for decode batches: out[r, f] = sum_k x[r, k] * W[f, k] (+ bias[f]) for 1..8
// rows of fp16 x and a packed 4-bit / 8-bit / fp8 weight (quant_common.cuh's layout); optionally with
// the gated MLP's SiLU-and-mul as its epilogue, as ops/gemv.cuh does for fp16 weights.
//
// At a few rows the product is bound by reading the packed weight once, so the work is organised as in
// the fp16 GEMV: each warp owns two weight rows (two neighbouring output features, or for SWIGLU the
// gate and up rows of one feature), its lanes issue all the 16-byte loads of a stretch of both rows (and
// the group parameter words beside them) before using any, dequantize in registers and reduce across
// the warp at the end. A 16-byte chunk holds 32 (4-bit) or 16 (8-bit) codes of one group.
//
// Arithmetic, per chunk and row: the chunk's weights are dequantized to fp16 exactly as the reference
// rounds them (int: (code - zero) * scale; fp8: the exact value / 256, its scale applied afterwards),
// multiplied with x in fp16 pairs (HFMA2) over runs of 8 products (4-bit: 16, in two accumulators of
// 8 per fp16 half), and each run is converted to fp32 and added to the fp32 accumulator (fp8: times
// its fp32 scale). So products are fp16 and at most 8 are summed per fp16 value; everything beyond is
// fp32. Two weight rows per warp halve the x traffic from L1,
// which is what bounds the kernel from two rows on (x is re-read by every warp).
#pragma once

#include "ops/activation.cuh"
#include "ops/gemv.cuh"  // add_rms_norm_to_smem: the norm prologue, as the fp16 GEMV runs it
#include "quantization/quant_common.cuh"

namespace voltllm {

struct QuantGemvParams {
  void* out;                   // [rows, n] fp16, rows out_stride apart
  const void* x;               // [rows, k] fp16, rows x_stride apart; columns in the packed order
  const uint4* weight;         // [n, k / kChunk] packed chunks ([2n, ...] for SWIGLU: gate rows, then up)
  const unsigned* group_params;  // [n, num_groups] ([2n, ...] for SWIGLU)
  const void* bias;            // [n] ([2n] for SWIGLU) fp16, or nullptr
  long long out_stride;
  long long x_stride;
  int rows;               // 1..ROWS
  int n;                  // output features
  int k;                  // a multiple of kChunk
  int num_groups;         // groups per weight row
  int chunk_group_shift;  // log2(chunks per group); unused when num_groups == 1
};

// The default shape: warps per thread block, weight rows per warp, 16-byte chunks per weight row in
// flight per lane. Kernels take them as template arguments so that a benchmark can time others.
constexpr int kQuantGemvWarps = 4;
constexpr int kQuantGemvMats = 2;
constexpr int kQuantGemvUnroll = 4;

// Output features one block covers: MATS per warp, or MATS / 2 with SWIGLU (a gate and an up row each).
template <bool SWIGLU, int MATS = kQuantGemvMats, int WARPS = kQuantGemvWarps>
__host__ __device__ constexpr int quant_gemv_features_per_block() {
  return WARPS * (SWIGLU ? MATS / 2 : MATS);
}

// acc + the chunk's products with x (its kChunk fp16 values, as 16-byte vectors).
// int: x * (code - zero) / 2^bits in fp16 pairs (HFMA2; exact offsets from int_offset_terms, so one
// conversion instruction per pair), summed 8 per fp16 half in two accumulators, then converted to fp32
// and scaled once: acc + 2^bits scale * sum. fp8: x * value / 256 the same way, times 256 scale.
template <int KIND>
__device__ __forceinline__ float chunk_dot(const uint4& raw, const GroupParams<KIND>& g,
                                           const uint4 (&x_chunk)[QuantTraits<KIND>::kChunk / 8], float acc) {
  const unsigned words[4] = {raw.x, raw.y, raw.z, raw.w};
  __half2 sum[2] = {__float2half2_rn(0.f), __float2half2_rn(0.f)};
  if constexpr (KIND == kQuantInt4) {
    const IntOffsetTerms t = int_offset_terms<KIND>(g.zero2);
    const __half2 sixteenth = __float2half2_rn(0.0625f), s256 = __float2half2_rn(0.00390625f);
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      unsigned bits[4];
      int4_word_bits(words[w], bits);
      const unsigned xw[4] = {x_chunk[w].x, x_chunk[w].y, x_chunk[w].z, x_chunk[w].w};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const __half2 h = half2_of_bits(bits[j]);
        const __half2 offset = (j & 1) ? __hfma2(h, s256, __hneg2(t.hi)) : __hfma2(h, sixteenth, __hneg2(t.lo));
        sum[j & 1] = __hfma2(offset, half2_of_bits(xw[j]), sum[j & 1]);
      }
    }
  } else {
    // 8-bit: word w holds columns 4w .. 4w + 3, pairs (0, 1) and (2, 3); x vector v covers words 2v, 2v + 1.
    [[maybe_unused]] IntOffsetTerms t;
    if constexpr (KIND == kQuantInt8) t = int_offset_terms<KIND>(g.zero2);
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      const uint4& xv = x_chunk[w / 2];
      const unsigned xw[2] = {(w & 1) ? xv.z : xv.x, (w & 1) ? xv.w : xv.y};
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const __half2 h = half2_of_bits(code_pair_bits<KIND>(words[w], j));
        __half2 value;
        if constexpr (KIND == kQuantInt8) {
          value = __hfma2(h, __float2half2_rn(0.00390625f), __hneg2(t.lo));
        } else {
          value = h;
        }
        sum[w / 2] = __hfma2(value, half2_of_bits(xw[j]), sum[w / 2]);
      }
    }
  }
  const float2 a = __half22float2(sum[0]), b = __half22float2(sum[1]);
  const float scale = KIND == kQuantFp8 ? g.scale : int_offset_scale<KIND>(g);
  return fmaf((a.x + a.y) + (b.x + b.y), scale, acc);
}

// The warp's weight rows: for SWIGLU the gate rows of features f0 .. f0 + MATS / 2 - 1 and then their up
// rows (n rows further), else MATS neighbouring rows. A row past n repeats the warp's first row (its
// result is not stored).
template <bool SWIGLU, int MATS>
__device__ __forceinline__ int gemv_row_of(int warp, int m, int n) {
  constexpr int kFeats = SWIGLU ? MATS / 2 : MATS;
  const int feature = warp * kFeats + m % kFeats;
  if (feature >= n) return SWIGLU ? warp * kFeats + (m / kFeats) * n : warp * kFeats;
  return SWIGLU ? feature + (m / kFeats) * n : feature;
}

// One step of a warp: UNROLL chunks (32 apart, lane by lane) of each of its MATS weight rows, with the
// group parameter words beside them.
template <int MATS, int UNROLL>
struct GemvStepRegs {
  uint4 w[MATS][UNROLL];
  unsigned g[MATS][UNROLL];
};

// Loads the step of row group `group` that starts at chunk `step_start` (lane l takes chunks
// step_start + l + 32 u). Weights and group words are never written by a kernel: this may run before
// the wait for the previous kernel.
template <int KIND, bool SWIGLU, int MATS, int UNROLL>
__device__ __forceinline__ void load_gemv_step(const QuantGemvParams& p, int group, int step_start, int lane,
                                               GemvStepRegs<MATS, UNROLL>& s) {
  const int chunks = p.k / QuantTraits<KIND>::kChunk;
#pragma unroll
  for (int m = 0; m < MATS; ++m) {
    const long long row = gemv_row_of<SWIGLU, MATS>(group, m, p.n);
    const uint4* w = p.weight + row * chunks;
    const unsigned* g = p.group_params + row * p.num_groups;
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int c = step_start + lane + 32 * u;
      if (c < chunks) {
        s.w[m][u] = w[c];
        s.g[m][u] = g[group_of_chunk(c, p.chunk_group_shift, p.num_groups)];
      }
    }
  }
}

// acc[m][r] += the step's products with x's rows.
// x: the rows (global memory, or the normalized rows in shared memory), x_stride apart.
template <int KIND, int ROWS, int MATS, int UNROLL>
__device__ __forceinline__ void gemv_step_dot(const QuantGemvParams& p, const __half* x, long long x_stride,
                                              const GemvStepRegs<MATS, UNROLL>& s, int step_start, int lane,
                                              float (&acc)[MATS][ROWS]) {
  using Traits = QuantTraits<KIND>;
  const int chunks = p.k / Traits::kChunk;
#pragma unroll
  for (int u = 0; u < UNROLL; ++u) {
    const int c = step_start + lane + 32 * u;
    if (c >= chunks) break;
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      if (r >= p.rows) break;
      // x is loaded once per row and chunk and serves every weight row of the warp.
      uint4 x_chunk[Traits::kChunk / 8];
      const uint4* x_src = reinterpret_cast<const uint4*>(x + r * x_stride + c * Traits::kChunk);
#pragma unroll
      for (int v = 0; v < Traits::kChunk / 8; ++v) x_chunk[v] = x_src[v];
#pragma unroll
      for (int m = 0; m < MATS; ++m)
        acc[m][r] = chunk_dot<KIND>(s.w[m][u], unpack_group_params<KIND>(s.g[m][u]), x_chunk, acc[m][r]);
    }
  }
}

// Reduces a row group's sums over the warp and stores them: bias added, rounded to fp16 as an unfused
// projection stores it; SWIGLU then writes silu(gate) * up. Leaves acc zeroed for the next group.
template <int ROWS, bool SWIGLU, int MATS>
__device__ __forceinline__ void store_gemv_group(const QuantGemvParams& p, int group, int lane,
                                                 float (&acc)[MATS][ROWS]) {
  constexpr int kFeats = SWIGLU ? MATS / 2 : MATS;
  __half* out = static_cast<__half*>(p.out);
  const __half* bias = static_cast<const __half*>(p.bias);
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    float value[MATS];
#pragma unroll
    for (int m = 0; m < MATS; ++m) {
      const float b = bias ? __half2float(bias[gemv_row_of<SWIGLU, MATS>(group, m, p.n)]) : 0.f;
      value[m] = __half2float(__float2half_rn(warp_sum(acc[m][r]) + b));
      acc[m][r] = 0.f;
    }
    if (lane != 0 || r >= p.rows) continue;
#pragma unroll
    for (int f = 0; f < kFeats; ++f) {
      const int feature = group * kFeats + f;
      if (feature >= p.n) break;
      if constexpr (SWIGLU) {
        out[r * p.out_stride + feature] = __float2half_rn(silu(value[f]) * value[f + kFeats]);
      } else {
        out[r * p.out_stride + feature] = __float2half_rn(value[f]);
      }
    }
  }
}

// grid: ceil(n / quant_gemv_features_per_block<SWIGLU, MATS, WARPS>()), block: 32 * WARPS. Each warp
// one row group (MATS rows) over all of k, UNROLL chunks per row per lane in flight at a time.
template <int KIND, int ROWS, bool SWIGLU, int MATS = kQuantGemvMats, int UNROLL = kQuantGemvUnroll,
          int WARPS = kQuantGemvWarps>
__global__ void __launch_bounds__(32 * WARPS) quant_gemv_kernel(QuantGemvParams p) {
  static_assert(!SWIGLU || MATS % 2 == 0, "SWIGLU pairs gate and up rows");
  constexpr int kFeats = SWIGLU ? MATS / 2 : MATS;
  const int lane = threadIdx.x & 31;
  const int group = blockIdx.x * WARPS + (threadIdx.x >> 5);
  if (group * kFeats >= p.n) return;
  const int chunks = p.k / QuantTraits<KIND>::kChunk;
  // Weights are never written by a kernel: their first chunks can be on the way to L2 while the kernel
  // before this one (whose output is x) still runs.
#pragma unroll
  for (int m = 0; m < MATS; ++m) {
    const uint4* w = p.weight + static_cast<long long>(gemv_row_of<SWIGLU, MATS>(group, m, p.n)) * chunks;
#pragma unroll
    for (int u = 0; u < UNROLL; ++u)
      if (lane + 32 * u < chunks) prefetch_l2(w + lane + 32 * u);
  }
  begin_dependent_grid();
  float acc[MATS][ROWS];
#pragma unroll
  for (int m = 0; m < MATS; ++m)
#pragma unroll
    for (int r = 0; r < ROWS; ++r) acc[m][r] = 0.f;
  for (int step = 0; step < chunks; step += 32 * UNROLL) {
    GemvStepRegs<MATS, UNROLL> s;
    load_gemv_step<KIND, SWIGLU, MATS, UNROLL>(p, group, step, lane, s);
    gemv_step_dot<KIND, ROWS, MATS, UNROLL>(p, static_cast<const __half*>(p.x), p.x_stride, s, step, lane, acc);
  }
  store_gemv_group<ROWS, SWIGLU, MATS>(p, group, lane, acc);
}

// The persistent form: a grid of at most a few blocks per SM whose warps walk row groups group,
// group + gridDim.x * WARPS, ... Each step's loads are issued before the previous step is multiplied
// (two register sets, used in turn), so a warp's loads stay in flight across the ends of its row
// groups, and the first step is loaded before the wait for the previous kernel: with few enough
// registers and warps (a block per SM at most half the register file) the grid is resident beside the
// kernel before it, and its first weights arrive while that kernel finishes.
template <int KIND, int ROWS, bool SWIGLU, int MATS, int UNROLL>
struct GemvPipeline {
  const QuantGemvParams& p;
  const __half* x;  // p.x, or the normalized rows in shared memory
  long long x_stride;
  int lane, groups, stride, chunks;
  float acc[MATS][ROWS];

  // The first step of this warp's first row group, before the wait for the previous kernel.
  __device__ __forceinline__ void start(int group, GemvStepRegs<MATS, UNROLL>& first) {
    if (group < groups) load_gemv_step<KIND, SWIGLU, MATS, UNROLL>(p, group, 0, lane, first);
#pragma unroll
    for (int m = 0; m < MATS; ++m)
#pragma unroll
      for (int r = 0; r < ROWS; ++r) acc[m][r] = 0.f;
  }

  // Every step of the warp's row groups, the register sets a and b in turn (a holds the first).
  __device__ __forceinline__ void run(int group, GemvStepRegs<MATS, UNROLL>& a, GemvStepRegs<MATS, UNROLL>& b) {
    int step_start = 0;
    if (group >= groups) return;
    while (step(group, step_start, a, b) && step(group, step_start, b, a)) {
    }
  }

  // Multiplies the step (group, step_start) held in `cur` while the next one loads into `next`;
  // advances (group, step_start) and returns false when this warp has no step left.
  __device__ __forceinline__ bool step(int& group, int& step_start, const GemvStepRegs<MATS, UNROLL>& cur,
                                       GemvStepRegs<MATS, UNROLL>& next) {
    int next_group = group, next_start = step_start + 32 * UNROLL;
    if (next_start >= chunks) {
      next_group += stride;
      next_start = 0;
    }
    const bool more = next_group < groups;
    if (more) load_gemv_step<KIND, SWIGLU, MATS, UNROLL>(p, next_group, next_start, lane, next);
    gemv_step_dot<KIND, ROWS, MATS, UNROLL>(p, x, x_stride, cur, step_start, lane, acc);
    if (next_group != group) store_gemv_group<ROWS, SWIGLU, MATS>(p, group, lane, acc);
    group = next_group;
    step_start = next_start;
    return more;
  }
};

// The persistent GEMV the extension builds, by rows of x: weight rows per warp and chunks per row in
// flight per lane, kQuantGemvPersistentWarps warps per block and kQuantGemvBlocksPerSm blocks per SM.
// At most 128 registers (the launch bounds ask for two blocks' worth), so that a block takes at most
// half of an SM's registers and the grid fits beside the kernel before it.
template <int ROWS>
struct QuantGemvPersistentShape {
  static constexpr int kMats = ROWS == 1 ? 4 : 2;
  static constexpr int kUnroll = 2;
};
constexpr int kQuantGemvPersistentWarps = 8;
constexpr int kQuantGemvBlocksPerSm = 1;

// Row groups (MATS rows, or MATS / 2 features with SWIGLU) of an n-feature output.
template <bool SWIGLU, int MATS>
__host__ __device__ constexpr int quant_gemv_groups(int n) {
  return (n + (SWIGLU ? MATS / 2 : MATS) - 1) / (SWIGLU ? MATS / 2 : MATS);
}

// grid: min(ceil(groups / WARPS), SMs * blocks per SM) with groups = quant_gemv_groups<SWIGLU, MATS>(n),
// block: 32 * WARPS.
template <int KIND, int ROWS, bool SWIGLU, int MATS, int UNROLL, int WARPS>
__global__ void __launch_bounds__(32 * WARPS, 2) quant_gemv_persistent_kernel(QuantGemvParams p) {
  static_assert(!SWIGLU || MATS % 2 == 0, "SWIGLU pairs gate and up rows");
  GemvPipeline<KIND, ROWS, SWIGLU, MATS, UNROLL> pipe{p,
                                                      static_cast<const __half*>(p.x),
                                                      p.x_stride,
                                                      static_cast<int>(threadIdx.x & 31),
                                                      quant_gemv_groups<SWIGLU, MATS>(p.n),
                                                      static_cast<int>(gridDim.x) * WARPS,
                                                      p.k / QuantTraits<KIND>::kChunk};
  const int group = blockIdx.x * WARPS + (threadIdx.x >> 5);
  GemvStepRegs<MATS, UNROLL> a, b;
  pipe.start(group, a);
  begin_dependent_grid();
  pipe.run(group, a, b);
}

// The persistent GEMV of one row with a pre-norm block's residual add and RMSNorm as its prologue:
// out = rms_norm(hidden + residual_in) @ W^T (+ bias), SWIGLU as above; block 0 also stores the sum
// to residual_out. Every block normalizes the row into shared memory (bit for bit what
// fused_add_rms_norm_kernel computes, through ops/gemv.cuh's prologue) after its first weight loads
// were issued, then streams its row groups as quant_gemv_persistent_kernel does.
struct QuantGemvNormParams {
  QuantGemvParams gemv;  // gemv.x and gemv.x_stride unused; gemv.rows is 1
  GemvNormParams norm;   // hidden, residual_in / _out, norm_weight, their strides, eps, rows, k
};

__host__ __device__ constexpr int quant_gemv_norm_smem_bytes(int k) { return kGemvNormScratchBytes + k * 2; }

// grid as quant_gemv_persistent_kernel, block: 32 * WARPS (at least 256 threads: the norm's layout),
// dynamic shared memory quant_gemv_norm_smem_bytes(k).
template <int KIND, bool SWIGLU, int MATS, int UNROLL, int WARPS>
__global__ void __launch_bounds__(32 * WARPS, 2) quant_gemv_norm_kernel(QuantGemvNormParams p) {
  static_assert(32 * WARPS >= kNormThreads, "the norm prologue takes 256 threads per row");
  VOLTLLM_DYNAMIC_SMEM(smem);
  float* scratch = reinterpret_cast<float*>(smem);
  __half* x_s = reinterpret_cast<__half*>(smem + kGemvNormScratchBytes);
  GemvPipeline<KIND, 1, SWIGLU, MATS, UNROLL> pipe{p.gemv,
                                                   x_s,
                                                   p.gemv.k,
                                                   static_cast<int>(threadIdx.x & 31),
                                                   quant_gemv_groups<SWIGLU, MATS>(p.gemv.n),
                                                   static_cast<int>(gridDim.x) * WARPS,
                                                   p.gemv.k / QuantTraits<KIND>::kChunk};
  const int group = blockIdx.x * WARPS + (threadIdx.x >> 5);
  GemvStepRegs<MATS, UNROLL> a, b;
  pipe.start(group, a);
  begin_dependent_grid();  // hidden and residual_in come from the kernels before this one
  add_rms_norm_to_smem<__half, 1>(p.norm, x_s, scratch);
  __syncthreads();
  pipe.run(group, a, b);
}

}  // namespace voltllm
