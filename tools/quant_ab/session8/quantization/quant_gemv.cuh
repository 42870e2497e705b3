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
};

constexpr int kQuantGemvWarps = 4;  // warps per thread block
constexpr int kQuantGemvMats = 2;   // weight rows per warp
constexpr int kQuantGemvUnroll = 4;  // 16-byte chunks per weight row in flight per lane

// Output features one block covers: two per warp, or one per warp with SWIGLU (gate and up rows).
template <bool SWIGLU>
__host__ __device__ constexpr int quant_gemv_features_per_block() {
  return SWIGLU ? kQuantGemvWarps : kQuantGemvWarps * kQuantGemvMats;
}

// fp16 pair j of a word as the GEMV multiplies it: the reference's weights (int), the value / 256 (fp8).
template <int KIND>
__device__ __forceinline__ __half2 gemv_weight_pair(unsigned word, int j, const GroupParams<KIND>& g) {
  if constexpr (KIND == kQuantFp8) {
    return half2_of_bits(code_pair_bits<KIND>(word, j));
  } else {
    return dequant_pair<KIND>(word, j, g);
  }
}

// acc += the chunk's products with x (its kChunk fp16 values, as 16-byte vectors), in runs of 8 fp16
// products.
template <int KIND>
__device__ __forceinline__ float chunk_dot(const uint4& raw, const GroupParams<KIND>& g,
                                           const uint4 (&x_chunk)[QuantTraits<KIND>::kChunk / 8], float acc) {
  constexpr int kPairs = QuantTraits<KIND>::kPairsPerWord;
  constexpr int kWordsPerRun = 4 / kPairs;  // 8 products = 4 pairs: two 8-bit words
  const unsigned words[4] = {raw.x, raw.y, raw.z, raw.w};
  float chunk_sum = 0.f;
#pragma unroll
  for (int run = 0; run < 4 / kWordsPerRun; ++run) {
    const unsigned xw[4] = {x_chunk[run].x, x_chunk[run].y, x_chunk[run].z, x_chunk[run].w};
    __half2 run_sum = __float2half2_rn(0.f);
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const int w = run * kWordsPerRun + q / kPairs;
      run_sum = __hfma2(gemv_weight_pair<KIND>(words[w], q % kPairs, g), half2_of_bits(xw[q]), run_sum);
    }
    const float2 f = __half22float2(run_sum);
    chunk_sum += f.x + f.y;
  }
  if constexpr (KIND == kQuantFp8) return fmaf(chunk_sum, g.scale, acc);
  return acc + chunk_sum;
}

// The 4-bit form, with fewer integer instructions: pairs 0 and 2 of a word are the nibbles at bits 0-3
// (and 16-19) of the word and of the word >> 8, pairs 1 and 3 those at bits 4-7, which OR'd into
// 1024's exponent give 1024 + 16 code: subtracting 1024 + 16 zero and scaling yields 16 times the
// weight, exactly (a power of two). Those products go to a second accumulator, scaled by 1/16 in fp32.
// Each accumulator sums 8 products per fp16 half over the chunk's 4 words.
template <>
__device__ __forceinline__ float chunk_dot<kQuantInt4>(const uint4& raw, const GroupParams<kQuantInt4>& g,
                                                       const uint4 (&x_chunk)[4], float acc) {
  const unsigned words[4] = {raw.x, raw.y, raw.z, raw.w};
  // 1024 + 16 zero = 16 (1024 + zero) - 15360, exact in fp16.
  const __half2 zero16 = __hfma2(g.zero2, __float2half2_rn(16.f), __float2half2_rn(-15360.f));
  __half2 sum_lo = __float2half2_rn(0.f), sum_hi = __float2half2_rn(0.f);
#pragma unroll
  for (int w = 0; w < 4; ++w) {
    const unsigned xw[4] = {x_chunk[w].x, x_chunk[w].y, x_chunk[w].z, x_chunk[w].w};
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const unsigned word = half == 0 ? words[w] : words[w] >> 8;
      const __half2 lo = half2_of_bits(and_or<0x000f000fu, 0x64006400u>(word));  // pair 2 half
      const __half2 hi = half2_of_bits(and_or<0x00f000f0u, 0x64006400u>(word));  // pair 2 half + 1, x16
      sum_lo = __hfma2(__hmul2(__hsub2(lo, g.zero2), g.scale2), half2_of_bits(xw[2 * half]), sum_lo);
      sum_hi = __hfma2(__hmul2(__hsub2(hi, zero16), g.scale2), half2_of_bits(xw[2 * half + 1]), sum_hi);
    }
  }
  const float2 lo = __half22float2(sum_lo), hi = __half22float2(sum_hi);
  return acc + (lo.x + lo.y) + 0.0625f * (hi.x + hi.y);
}

// grid: ceil(n / quant_gemv_features_per_block<SWIGLU>()), block: 32 * kQuantGemvWarps.
template <int KIND, int ROWS, bool SWIGLU>
__global__ void __launch_bounds__(32 * kQuantGemvWarps) quant_gemv_kernel(QuantGemvParams p) {
  using Traits = QuantTraits<KIND>;
  constexpr int kMats = kQuantGemvMats, kUnroll = kQuantGemvUnroll;
  const int lane = threadIdx.x & 31;
  const int warp = blockIdx.x * kQuantGemvWarps + (threadIdx.x >> 5);
  // The warp's weight rows: gate and up of feature `warp` (SWIGLU), else features 2 warp and 2 warp + 1.
  int rows_of[kMats];
#pragma unroll
  for (int m = 0; m < kMats; ++m) rows_of[m] = SWIGLU ? warp + m * p.n : warp * kMats + m;
  if (rows_of[0] >= p.n) return;
  const bool second = SWIGLU || rows_of[1] < p.n;  // an odd n leaves the last warp one row
  const int chunks = p.k / Traits::kChunk;
  const uint4* w_rows[kMats];
  const unsigned* g_rows[kMats];
#pragma unroll
  for (int m = 0; m < kMats; ++m) {
    const int row = (m == 0 || second) ? rows_of[m] : rows_of[0];  // a missing row repeats the first
    w_rows[m] = p.weight + static_cast<long long>(row) * chunks;
    g_rows[m] = p.group_params + static_cast<long long>(row) * p.num_groups;
  }
  // Weights are never written by a kernel: their first chunks can be on the way to L2 while the kernel
  // before this one (whose output is x) still runs.
#pragma unroll
  for (int m = 0; m < kMats; ++m)
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (lane + 32 * u < chunks) prefetch_l2(w_rows[m] + lane + 32 * u);
  begin_dependent_grid();
  const __half* x = static_cast<const __half*>(p.x);
  float acc[kMats][ROWS];
#pragma unroll
  for (int m = 0; m < kMats; ++m)
#pragma unroll
    for (int r = 0; r < ROWS; ++r) acc[m][r] = 0.f;
  for (int base = lane; base < chunks; base += 32 * kUnroll) {
    uint4 w_raw[kMats][kUnroll];
    unsigned g_raw[kMats][kUnroll];
#pragma unroll
    for (int m = 0; m < kMats; ++m)
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int c = base + 32 * u;
        if (c < chunks) {
          w_raw[m][u] = w_rows[m][c];
          g_raw[m][u] = g_rows[m][group_of_chunk(c, p.chunk_group_shift, p.num_groups)];
        }
      }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int c = base + 32 * u;
      if (c >= chunks) break;
      GroupParams<KIND> g[kMats];
#pragma unroll
      for (int m = 0; m < kMats; ++m) g[m] = unpack_group_params<KIND>(g_raw[m][u]);
#pragma unroll
      for (int r = 0; r < ROWS; ++r) {
        if (r >= p.rows) break;
        // x is loaded once per row and chunk and serves both weight rows.
        uint4 x_chunk[Traits::kChunk / 8];
        const uint4* x_src = reinterpret_cast<const uint4*>(x + r * p.x_stride + c * Traits::kChunk);
#pragma unroll
        for (int v = 0; v < Traits::kChunk / 8; ++v) x_chunk[v] = x_src[v];
#pragma unroll
        for (int m = 0; m < kMats; ++m) acc[m][r] = chunk_dot<KIND>(w_raw[m][u], g[m], x_chunk, acc[m][r]);
      }
    }
  }
  // Reduce and store: bias added, rounded to fp16 as an unfused projection stores it; SWIGLU then writes
  // silu(gate) * up.
  __half* out = static_cast<__half*>(p.out);
  const __half* bias = static_cast<const __half*>(p.bias);
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    float value[kMats];
#pragma unroll
    for (int m = 0; m < kMats; ++m) {
      const float b = bias ? __half2float(bias[second ? rows_of[m] : rows_of[0]]) : 0.f;
      value[m] = __half2float(__float2half_rn(warp_sum(acc[m][r]) + b));
    }
    if (lane != 0 || r >= p.rows) continue;
    if constexpr (SWIGLU) {
      out[r * p.out_stride + warp] = __float2half_rn(silu(value[0]) * value[1]);
    } else {
      out[r * p.out_stride + rows_of[0]] = __float2half_rn(value[0]);
      if (second) out[r * p.out_stride + rows_of[1]] = __float2half_rn(value[1]);
    }
  }
}

}  // namespace voltllm
