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
  // The add + RMSNorm epilogue (ADD_NORM): out then receives rms_norm(residual_in + the projection) *
  // norm_weight, the normalized input of the next projection, and residual_out the sum.
  const void* residual_in;  // [rows, n], rows n apart
  void* residual_out;       // [rows, n], rows n apart (may be residual_in: each element is read, then written, by one thread)
  const void* norm_weight;  // [n]
  float* block_squares;     // [rows, gridDim.x]: each block's sum of squares of its residual_out features
  unsigned* arrivals;       // 0 at launch; the last block to arrive normalizes the rows and sets it to 0 again
  float eps;
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
// step_start + l + 32 u); NO_L1: without allocating in L1 (load_no_l1). Weights and group words are
// never written by a kernel: this may run before the wait for the previous kernel.
template <int KIND, bool SWIGLU, int MATS, int UNROLL, bool NO_L1 = false>
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
        s.w[m][u] = load_once<NO_L1>(w + c);
        s.g[m][u] = load_once<NO_L1>(g + group_of_chunk(c, p.chunk_group_shift, p.num_groups));
      }
    }
  }
}

// acc[m][r] += the step's products with x's rows.
// x: the rows, x_stride apart.
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

// Stores row r of a row group's warp-reduced sums (called by one lane): bias added, rounded to fp16 as an
// unfused projection stores it; SWIGLU then writes silu(gate) * up. ADD_NORM instead adds the rounded
// projection to the residual, stores the sum rounded to fp16 in residual_out (fused_add_rms_norm's
// arithmetic) and returns the sum of its squares (0 without ADD_NORM).
template <bool SWIGLU, int MATS, bool ADD_NORM = false>
__device__ __forceinline__ float store_gemv_row(const QuantGemvParams& p, int group, int r, const float (&sum)[MATS]) {
  constexpr int kFeats = SWIGLU ? MATS / 2 : MATS;
  __half* out = static_cast<__half*>(p.out);
  const __half* bias = static_cast<const __half*>(p.bias);
  float value[MATS];
#pragma unroll
  for (int m = 0; m < MATS; ++m) {
    const float b = bias ? __half2float(bias[gemv_row_of<SWIGLU, MATS>(group, m, p.n)]) : 0.f;
    value[m] = __half2float(__float2half_rn(sum[m] + b));
  }
  float squares = 0.f;
#pragma unroll
  for (int f = 0; f < kFeats; ++f) {
    const int feature = group * kFeats + f;
    if (feature >= p.n) break;
    if constexpr (ADD_NORM) {
      const long long at = static_cast<long long>(r) * p.n + feature;
      const __half sum_h = __float2half_rn(value[f] + __half2float(static_cast<const __half*>(p.residual_in)[at]));
      static_cast<__half*>(p.residual_out)[at] = sum_h;
      const float rounded = __half2float(sum_h);
      squares += rounded * rounded;
    } else if constexpr (SWIGLU) {
      out[r * p.out_stride + feature] = __float2half_rn(silu(value[f]) * value[f + kFeats]);
    } else {
      out[r * p.out_stride + feature] = __float2half_rn(value[f]);
    }
  }
  return squares;
}

// Reduces a row group's sums over the warp and stores them (store_gemv_row), adding each row's squares
// (ADD_NORM) into lane 0's `squares`. Leaves acc zeroed for the next group.
template <int ROWS, bool SWIGLU, int MATS, bool ADD_NORM = false>
__device__ __forceinline__ void store_gemv_group(const QuantGemvParams& p, int group, int lane,
                                                 float (&acc)[MATS][ROWS], float (&squares)[ROWS]) {
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    float sum[MATS];
#pragma unroll
    for (int m = 0; m < MATS; ++m) {
      sum[m] = warp_sum(acc[m][r]);
      acc[m][r] = 0.f;
    }
    if (lane == 0 && r < p.rows) squares[r] += store_gemv_row<SWIGLU, MATS, ADD_NORM>(p, group, r, sum);
  }
}

template <int ROWS, bool SWIGLU, int MATS>
__device__ __forceinline__ void store_gemv_group(const QuantGemvParams& p, int group, int lane,
                                                 float (&acc)[MATS][ROWS]) {
  float squares[ROWS] = {};
  store_gemv_group<ROWS, SWIGLU, MATS, false>(p, group, lane, acc, squares);
}

// Asks L2 for the 128-byte lines holding bytes [begin, end) past `base`, spread over the warp's lanes.
__device__ __forceinline__ void prefetch_lines_l2(const void* base, long long begin, long long end, int lane) {
  const char* bytes = static_cast<const char*>(base);
  for (long long at = (begin & ~127ll) + 128ll * lane; at < end; at += 128ll * 32) prefetch_l2(bytes + at);
}

// Before the wait for the previous kernel (weights and group words are never written by a kernel): asks
// L2 for the first `steps` steps this warp will load (part `part` of the KSPLIT warps sharing a row group
// takes steps part, part + KSPLIT, ...; a step is 32 * UNROLL chunks of each of its rows) and for its
// rows' group words from its first step to the last one asked for. A prefetch holds no register, so a
// warp can ask for more than it keeps in flight: with `steps` covering its whole share, a small
// projection's weight streams into L2 while the kernel before it finishes.
template <int KIND, bool SWIGLU, int MATS, int UNROLL, int KSPLIT>
__device__ __forceinline__ void prefetch_gemv_steps(const QuantGemvParams& p, int group, int part, int lane,
                                                    int steps) {
  constexpr int kStep = 32 * UNROLL, kChunkBytes = 16;
  const int chunks = p.k / QuantTraits<KIND>::kChunk;
  const int first = part * kStep;
  if (first >= chunks) return;
  const long long reach = static_cast<long long>(first) + static_cast<long long>(steps - 1) * KSPLIT * kStep + kStep;
  const int last = static_cast<int>(min(static_cast<long long>(chunks), reach)) - 1;  // last chunk asked for
  const int g0 = group_of_chunk(first, p.chunk_group_shift, p.num_groups);
  const int g1 = group_of_chunk(last, p.chunk_group_shift, p.num_groups);
#pragma unroll
  for (int m = 0; m < MATS; ++m) {
    const long long row = gemv_row_of<SWIGLU, MATS>(group, m, p.n);
    const uint4* w = p.weight + row * chunks;
    for (int start = first; start <= last; start += KSPLIT * kStep)
      prefetch_lines_l2(w, static_cast<long long>(start) * kChunkBytes,
                        static_cast<long long>(min(chunks, start + kStep)) * kChunkBytes, lane);
    prefetch_lines_l2(p.group_params + row * p.num_groups, 4ll * g0, 4ll * (g1 + 1), lane);
  }
}

// A PREFETCH of quant_gemv_kernel that covers every step of any row.
constexpr int kQuantGemvPrefetchAll = 1 << 16;

// Shared memory of quant_gemv_kernel: the KSPLIT warps of a row group hand their warp sums to its first
// warp (none without a k split); then, with ADD_NORM, the norm epilogue's (quant_gemv_norm_smem_floats).
template <int ROWS, int WARPS>
__host__ __device__ constexpr int quant_gemv_norm_smem_floats() {
  return WARPS * ROWS + WARPS + 1;  // the warps' sums of squares, block_sum's scratch, the last-block flag
}
template <int ROWS, int MATS, int WARPS, int KSPLIT>
__host__ __device__ constexpr int quant_gemv_split_smem_bytes() {
  return KSPLIT == 1 ? 0 : WARPS * MATS * ROWS * 4;
}
template <int ROWS, int MATS, int WARPS, int KSPLIT, bool ADD_NORM = false>
__host__ __device__ constexpr int quant_gemv_smem_bytes() {
  return quant_gemv_split_smem_bytes<ROWS, MATS, WARPS, KSPLIT>() +
         (ADD_NORM ? quant_gemv_norm_smem_floats<ROWS, WARPS>() * 4 : 0);
}

// The KSPLIT warps' sums of each row group (acc of every warp) added in part order into its first warp's
// lane 0, which stores them (and adds each row's squares into `squares`, ADD_NORM). Every warp of the
// block calls this (it holds a barrier); `partial` is shared memory of WARPS * MATS * ROWS floats.
template <int ROWS, bool SWIGLU, int MATS, int KSPLIT, bool ADD_NORM = false>
__device__ __forceinline__ void store_split_gemv_group(const QuantGemvParams& p, int group, bool active, int warp,
                                                       int lane, const float (&acc)[MATS][ROWS], float* partial,
                                                       float (&squares)[ROWS]) {
#pragma unroll
  for (int m = 0; m < MATS; ++m)
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      const float v = warp_sum(acc[m][r]);
      if (lane == 0) partial[(warp * MATS + m) * ROWS + r] = v;
    }
  __syncthreads();
  if (!active || warp % KSPLIT != 0 || lane != 0) return;
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    if (r >= p.rows) break;
    float sum[MATS];
#pragma unroll
    for (int m = 0; m < MATS; ++m) {
      sum[m] = 0.f;
#pragma unroll
      for (int s = 0; s < KSPLIT; ++s) sum[m] += partial[((warp + s) * MATS + m) * ROWS + r];
    }
    squares[r] += store_gemv_row<SWIGLU, MATS, ADD_NORM>(p, group, r, sum);
  }
}

// The add + RMSNorm epilogue, after the block stored its features' sums (every thread calls it; `squares`
// holds lane 0's sums of squares per row, 0 elsewhere). Each block writes its per-row sum of squares to
// block_squares and takes a ticket; the last block adds them up in block order (so the result does not
// depend on which block finishes last), then writes out = residual_out * rsqrt(mean square + eps) *
// norm_weight for every row, reading residual_out from L2 (other blocks wrote it), and resets the
// counter. The next projection reads the normalized rows as they are: at decode batch sizes this costs
// one block's pass over a few rows where a separate add + RMSNorm kernel cost a launch.
// `smem`: quant_gemv_norm_smem_floats<ROWS, WARPS>() floats of shared memory.
template <int ROWS, int WARPS>
__device__ __forceinline__ void finish_add_rms_norm(const QuantGemvParams& p, const float (&squares)[ROWS],
                                                    float* smem) {
  float* warp_squares = smem;                 // [WARPS][ROWS]
  float* scratch = smem + WARPS * ROWS;       // [WARPS]
  float* last = scratch + WARPS;              // 1 in the last block to arrive
  const int warp = threadIdx.x >> 5;
  if ((threadIdx.x & 31) == 0) {
#pragma unroll
    for (int r = 0; r < ROWS; ++r) warp_squares[warp * ROWS + r] = squares[r];
    __threadfence();  // this lane's residual_out stores, device-wide, before the block's ticket
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int r = 0; r < p.rows; ++r) {
      float block_total = 0.f;
      for (int w = 0; w < WARPS; ++w) block_total += warp_squares[w * ROWS + r];
      p.block_squares[static_cast<long long>(r) * gridDim.x + blockIdx.x] = block_total;
    }
    __threadfence();  // the block's sums of squares before its ticket
    *last = atomicAdd(p.arrivals, 1u) == gridDim.x - 1 ? 1.f : 0.f;
  }
  __syncthreads();
  if (*last == 0.f) return;
  __threadfence();
  const __half* weight = static_cast<const __half*>(p.norm_weight);
  for (int r = 0; r < p.rows; ++r) {
    float total = 0.f;
    for (int b = threadIdx.x; b < gridDim.x; b += blockDim.x)
      total += __ldcg(p.block_squares + static_cast<long long>(r) * gridDim.x + b);
    const float inv_rms = rsqrtf(block_sum(total, scratch) / p.n + p.eps);
    const __half* sum_row = static_cast<const __half*>(p.residual_out) + static_cast<long long>(r) * p.n;
    __half* out_row = static_cast<__half*>(p.out) + r * p.out_stride;
    for (int i = threadIdx.x * 8; i < p.n; i += blockDim.x * 8) {
      float v[8], w[8];
      const uint4 sums = __ldcg(reinterpret_cast<const uint4*>(sum_row + i));
      load_floats(reinterpret_cast<const __half*>(&sums), v);
      load_floats(weight + i, w);
#pragma unroll
      for (int j = 0; j < 8; ++j) v[j] = v[j] * inv_rms * w[j];
      store_floats(out_row + i, v);
    }
  }
  if (threadIdx.x == 0) *p.arrivals = 0;
}

// Where a warp of the one-shot GEMV works: its row group (MATS weight rows) and its part of k (the KSPLIT
// warps of a row group are neighbours in the block).
template <bool SWIGLU, int MATS, int WARPS, int KSPLIT>
struct OneShotWarp {
  static_assert(WARPS % KSPLIT == 0, "a block holds whole row groups");
  int lane, warp, group, part;
  bool active;  // the row group has a feature below n (one past it still joins the k split's barrier)

  __device__ __forceinline__ explicit OneShotWarp(int n)
      : lane(threadIdx.x & 31),
        warp(threadIdx.x >> 5),
        group(blockIdx.x * (WARPS / KSPLIT) + warp / KSPLIT),
        part(warp % KSPLIT),
        active(group * (SWIGLU ? MATS / 2 : MATS) < n) {}
};

// The one-shot GEMV after its prefetch and the wait: every step of the warp's part of its rows against x,
// the k split's sums meeting in `partial` (shared memory, see store_split_gemv_group; unused without a
// split), the result stored.
template <int KIND, int ROWS, bool SWIGLU, int MATS, int UNROLL, int WARPS, int KSPLIT, bool NO_L1,
          bool ADD_NORM = false>
__device__ __forceinline__ void one_shot_gemv(const QuantGemvParams& p, const OneShotWarp<SWIGLU, MATS, WARPS, KSPLIT>& w,
                                              const __half* x, long long x_stride, float* partial) {
  constexpr int kStep = 32 * UNROLL;
  const int chunks = p.k / QuantTraits<KIND>::kChunk;
  float acc[MATS][ROWS];
#pragma unroll
  for (int m = 0; m < MATS; ++m)
#pragma unroll
    for (int r = 0; r < ROWS; ++r) acc[m][r] = 0.f;
  if (w.active) {
    for (int step = w.part * kStep; step < chunks; step += KSPLIT * kStep) {
      GemvStepRegs<MATS, UNROLL> s;
      load_gemv_step<KIND, SWIGLU, MATS, UNROLL, NO_L1>(p, w.group, step, w.lane, s);
      gemv_step_dot<KIND, ROWS, MATS, UNROLL>(p, x, x_stride, s, step, w.lane, acc);
    }
  }
  float squares[ROWS] = {};
  if constexpr (KSPLIT == 1) {
    if (w.active) store_gemv_group<ROWS, SWIGLU, MATS, ADD_NORM>(p, w.group, w.lane, acc, squares);
  } else {
    store_split_gemv_group<ROWS, SWIGLU, MATS, KSPLIT, ADD_NORM>(p, w.group, w.active, w.warp, w.lane, acc, partial,
                                                                 squares);
  }
  if constexpr (ADD_NORM)
    finish_add_rms_norm<ROWS, WARPS>(p, squares, partial + quant_gemv_split_smem_bytes<ROWS, MATS, WARPS, KSPLIT>() / 4);
}

// grid: ceil(n / quant_gemv_features_per_block<SWIGLU, MATS, WARPS / KSPLIT>()), block: 32 * WARPS,
// dynamic shared memory quant_gemv_smem_bytes<ROWS, MATS, WARPS, KSPLIT>(). Each row group (MATS weight
// rows) is KSPLIT warps of the block: warp `part` takes steps part, part + KSPLIT, ... of k, a step being
// UNROLL chunks per row per lane in flight at once; their sums meet in shared memory. Before the wait for
// the previous kernel every warp asks L2 for its first PREFETCH steps. NO_L1: weights and group words
// are loaded without allocating in L1 (load_no_l1). ADD_NORM: the add + RMSNorm epilogue
// (finish_add_rms_norm; not with SWIGLU).
template <int KIND, int ROWS, bool SWIGLU, int MATS = kQuantGemvMats, int UNROLL = kQuantGemvUnroll,
          int WARPS = kQuantGemvWarps, int KSPLIT = 1, int PREFETCH = 1, bool NO_L1 = false, bool ADD_NORM = false>
__global__ void __launch_bounds__(32 * WARPS) quant_gemv_kernel(QuantGemvParams p) {
  static_assert(!SWIGLU || MATS % 2 == 0, "SWIGLU pairs gate and up rows");
  static_assert(!(SWIGLU && ADD_NORM), "the norm epilogue follows a plain projection");
  const OneShotWarp<SWIGLU, MATS, WARPS, KSPLIT> w(p.n);
  if (KSPLIT == 1 && !ADD_NORM && !w.active) return;  // the norm epilogue's barriers need every warp
  if (w.active) prefetch_gemv_steps<KIND, SWIGLU, MATS, UNROLL, KSPLIT>(p, w.group, w.part, w.lane, PREFETCH);
  begin_dependent_grid();
  VOLTLLM_DYNAMIC_SMEM(smem);
  one_shot_gemv<KIND, ROWS, SWIGLU, MATS, UNROLL, WARPS, KSPLIT, NO_L1, ADD_NORM>(
      p, w, static_cast<const __half*>(p.x), p.x_stride, reinterpret_cast<float*>(smem));
}

// The one-row shapes the extension builds, by index (the glue picks one by the layer's size; tests and
// benches name them): weight rows per warp, chunks per row per lane in flight, warps per block, warps
// per row group (the k split), steps asked of L2 before the wait, weights loaded without L1.
template <int INDEX>
struct QuantGemvOneRowShape;
template <int MATS, int UNROLL, int WARPS, int KSPLIT, int PREFETCH, bool NO_L1>
struct QuantGemvShapeOf {
  static constexpr int kMats = MATS, kUnroll = UNROLL, kWarps = WARPS, kSplit = KSPLIT, kPrefetch = PREFETCH;
  static constexpr bool kNoL1 = NO_L1;
};
// Session 9's shape (H200: 0.59 of copy bandwidth over the Llama-3-8B projections, gate/up 0.77); the
// glue runs it above 32 MiB (gate/up).
template <>
struct QuantGemvOneRowShape<0> : QuantGemvShapeOf<4, 2, 4, 1, 1, false> {};
// 4 rows x 1 chunk per warp (half the registers in flight, so more warps per SM), k split over 2 warps,
// every step asked of L2, weights out of L1. The glue runs it up to 32 MiB (H200, session 10: qkv 7.0 us
// against 8.9 for session 9's). Session 10's five other shapes (weights out of L1 alone, the prefetch
// alone, 4-warp splits, 2 rows x 2 chunks) lost on every projection and were dropped.
template <>
struct QuantGemvOneRowShape<1> : QuantGemvShapeOf<4, 1, 8, 2, kQuantGemvPrefetchAll, true> {};
constexpr int kQuantGemvOneRowShapes = 2;

}  // namespace voltllm
