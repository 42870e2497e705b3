// Weight-streaming 4-bit GEMM that dequantizes straight into WMMA matrix_b fragment registers (the
// Marlin / TurboMind way), for 4-128 rows: out[m, f] = sum_k x[m, k] * W[f, k] (+ bias[f]) for fp16 x
// and int4 weights with zero points, groups of 64+ columns or one per row. Volta-legal (WMMA m16n16k16,
// fp16 operands, fp32 accumulation).
//
// The streaming GEMM (quant_gemm_stream.cuh) writes each dequantized chunk to shared memory and reads
// it back as a WMMA operand: with x's fragments about 6 bytes of shared-memory traffic per weight, near
// an SM's limit. Here a lane builds its matrix_b fragment's elements itself, from codes repacked once at
// load so that its 16-byte loads hold exactly the codes of its elements, in element order.
//
// WMMA leaves the fragment layout unspecified (SM70's HMMA.884 gives every operand element to two lanes;
// SM80+ gives each lane 8 distinct elements held twice, x[i] == x[i + 8]). Nothing here assumes one:
// `quant_wmma_b_layout_kernel` probes it on the device (once, at load: voltllm/ops/quantized_linear.py
// `fragment_layout`) and the host derives the repack from the probe:
// - a lane's D = num_elements / REP distinct slots (REP = 2 when x[i] == x[i + num_elements / 2] in
//   every lane, else 1; the kernel writes slot i % D into element i);
// - lanes holding the same slots in the same order share one tuple of codes (their loads of one address
//   coalesce: no extra bytes); `lane_tuple[lane]` names a lane's;
// - RUN = 2 when slots 2q and 2q + 1 of every lane lie in one output column (one group parameter per
//   pair), else 1 (one per slot); `lane_cols[lane][s]` is the column (0..15) of parameter slot s.
// LAYOUT numbers the (REP, RUN) pairs built: 0 = (1, 1) works for any layout, 1 = (1, 2), 2 = (2, 2).
//
// Fragment-ordered codes, per 16-feature tile and 64-column k-chunk: the tuples one after another, each
// 2 D bytes: for k-step s (16 columns) and word w (8 slots), a 32-bit word at (s * D / 8 + w) * 4 with
// slot 8w + 2j at bits 4j and slot 8w + 2j + 1 at bits 16 + 4j (quant_common.cuh's nibble order).
// Group parameters (quant_common.cuh's word) transposed per tile, [tiles][num_groups][16], so that one
// group's words of a tile are 64 contiguous bytes. The tiles cover n rounded up to 32 (a warp's two
// tiles at NF = 2 always exist); features past n are zero codes with zero scales.
//
// The block, the x windows, the k split and the epilogue are the streaming GEMM's (QuantStreamTiles).
#pragma once

#include <mma.h>

#include "quantization/quant_gemm_stream.cuh"

namespace voltllm {

// Layout numbers (the host side: quantized_linear.py FRAGMENT_LAYOUTS).
constexpr int kFragLayoutGeneric = 0;   // REP 1, RUN 1
constexpr int kFragLayoutPairs = 1;     // REP 1, RUN 2
constexpr int kFragLayoutRepeated = 2;  // REP 2, RUN 2

struct QuantFragParams {
  // s.weight: the fragment-ordered codes; s.group_params: the transposed words; s.chunk_group_shift:
  // log2(64-column chunks per group). s.n: output features (the tiles cover it rounded up to 32).
  QuantStreamParams s;
  int tile_chunk_vectors;  // 16-byte vectors per (tile, k-chunk): tuples * 2 D / 16
  unsigned char lane_tuple[32];
  unsigned char lane_cols[32][16];
};

// Dynamic shared memory of the layout probe: a 16x16 fp16 tile.
constexpr int kQuantWmmaLayoutSmemBytes = 512;
#ifdef __CUDACC_RTC__
__device__ const int quant_wmma_b_layout_smem_bytes_probe = kQuantWmmaLayoutSmemBytes;
#endif

// Writes the (k, n) position each matrix_b (col-major) element of each lane holds: out[lane * 16 + i] =
// 16 n + k for i < num_elements, -1 past it. One warp, kQuantWmmaLayoutSmemBytes of dynamic shared memory.
__global__ void quant_wmma_b_layout_kernel(int* out) {
  using namespace nvcuda;
  VOLTLLM_DYNAMIC_SMEM(smem);
  __half* ramp = reinterpret_cast<__half*>(smem);
  const int lane = threadIdx.x & 31;
  // Col-major with ldm 16: element (k, n) at ramp[16 n + k], holding its own index (exact in fp16).
  for (int v = lane; v < 256; v += 32) ramp[v] = __float2half_rn(static_cast<float>(v));
  __syncwarp();
  wmma::fragment<wmma::matrix_b, 16, 16, 16, __half, wmma::col_major> b;
  wmma::load_matrix_sync(b, ramp, 16);
  for (int i = 0; i < 16; ++i)
    out[lane * 16 + i] = i < b.num_elements ? static_cast<int>(__half2float(b.x[i])) : -1;
}

// DEEP: 3/4 of the streaming GEMM's bytes of codes in flight per lane, else half (a ring entry's group
// words take as many registers again; at all of them sm_90 spills); built for NF = 1 at the structured
// layouts, for the A/B.
template <int MF, int NF, int LAYOUT, bool DEEP = false>
struct QuantFragTraits : QuantStreamTiles<MF, NF> {
  using Tiles = QuantStreamTiles<MF, NF>;
  using BFrag = nvcuda::wmma::fragment<nvcuda::wmma::matrix_b, 16, 16, 16, __half, nvcuda::wmma::col_major>;
  static_assert(LAYOUT >= kFragLayoutGeneric && LAYOUT <= kFragLayoutRepeated, "unknown fragment layout");
  static constexpr int kRep = LAYOUT == kFragLayoutRepeated ? 2 : 1;
  static constexpr int kRun = LAYOUT == kFragLayoutGeneric ? 1 : 2;
  static constexpr int kElements = BFrag::num_elements;
  static constexpr int kSlots = kElements / kRep;              // D: distinct elements a lane builds
  static constexpr int kParamSlots = kSlots / kRun;            // group words per lane per tile
  static constexpr int kWordsPerStep = kSlots / 8;             // code words per lane per k-step
  static constexpr int kTupleVectors = 2 * kSlots / 16;        // 16-byte loads per lane per k-chunk
  // k-chunks in flight per lane (a ring entry holds its codes and group words).
  static constexpr int kDepthBytes = DEEP ? 3 * Tiles::kLaneBytesInFlight / 4 : Tiles::kLaneBytesInFlight / 2;
  static constexpr int kChunkBytes = 16 * kTupleVectors * NF;
  static constexpr int kDepth = kDepthBytes / kChunkBytes > 1 ? kDepthBytes / kChunkBytes : 1;
  static constexpr int kScratchBytes = 16 * 16 * 4;            // a warp's epilogue fragment
  static constexpr int kSmemBytes = Tiles::kWarps * kScratchBytes + Tiles::kXSmemBytes;
  static_assert(kSlots % 8 == 0, "whole code words per k-step");
  static_assert(kSmemBytes <= 96 * 1024, "Volta's shared memory");
};

template <int MF, int NF, int LAYOUT, bool DEEP = false>
__host__ __device__ constexpr int quant_gemm_frag_smem_bytes() {
  return QuantFragTraits<MF, NF, LAYOUT, DEEP>::kSmemBytes;
}

#ifdef __CUDACC_RTC__
// The dynamic shared memory each variant launches with, for the sm70 gate (ptxas sees only static).
template <int MF, int NF, int LAYOUT, bool DEEP = false>
__device__ const int quant_gemm_frag_smem_bytes_probe = QuantFragTraits<MF, NF, LAYOUT, DEEP>::kSmemBytes;
#endif

// One k-chunk of a lane's codes and group words, for each of the warp's NF tiles.
template <typename Tr>
struct QuantFragRegs {
  uint4 codes[Tr::kNFrags][Tr::kTupleVectors];
  unsigned words[Tr::kNFrags][Tr::kParamSlots];
};

// A lane's place in the repacked layout: its tuple's first vector and its parameter slots' columns.
template <typename Tr>
struct QuantFragLane {
  int tuple_vector;
  int cols[Tr::kParamSlots];
};

template <typename Tr>
__device__ __forceinline__ QuantFragLane<Tr> frag_lane(const QuantFragParams& p, int lane) {
  QuantFragLane<Tr> l;
  l.tuple_vector = p.lane_tuple[lane] * Tr::kTupleVectors;
#pragma unroll
  for (int s = 0; s < Tr::kParamSlots; ++s) l.cols[s] = p.lane_cols[lane][s];
  return l;
}

// K-chunk kt of tiles tile0 .. tile0 + NF - 1: the lane's codes and its parameter slots' group words
// (read through L1: a group's words serve several chunks and every row block).
template <typename Tr>
__device__ __forceinline__ void load_frag_chunk(const QuantFragParams& p, const QuantFragLane<Tr>& l, int tile0,
                                                int kt, QuantFragRegs<Tr>& regs) {
  const int chunks = p.s.k / Tr::kBlockK;
  const int group = group_of_chunk(kt, p.s.chunk_group_shift, p.s.num_groups);
#pragma unroll
  for (int j = 0; j < Tr::kNFrags; ++j) {
    const long long tile = tile0 + j;
    const uint4* src = p.s.weight + (tile * chunks + kt) * p.tile_chunk_vectors + l.tuple_vector;
#pragma unroll
    for (int v = 0; v < Tr::kTupleVectors; ++v) regs.codes[j][v] = load_no_l1(src + v);
    const unsigned* words = p.s.group_params + (tile * p.s.num_groups + group) * 16;
#pragma unroll
    for (int s = 0; s < Tr::kParamSlots; ++s) regs.words[j][s] = words[l.cols[s]];
  }
}

// One pair of slots' parameters: the fp16 scales and the term subtracted from the magic-number pattern
// (1024 + zero for the even pairs of a word, 64 + zero for the odd ones, whose codes sit 16x higher).
struct FragPairParams {
  __half2 scale2;
  __half2 offset2;
};

template <int RUN>
__device__ __forceinline__ FragPairParams frag_pair_params(unsigned first, unsigned second, bool odd_pair) {
  FragPairParams q;
  // A word is half2 (scale, 1024 + zero): the low halves of the pair's two words, then the high halves.
  const unsigned scales = RUN == 2 ? __byte_perm(first, 0u, 0x1010u) : __byte_perm(first, second, 0x5410u);
  const unsigned zeros = RUN == 2 ? __byte_perm(first, 0u, 0x3232u) : __byte_perm(first, second, 0x7632u);
  q.scale2 = half2_of_bits(scales);
  q.offset2 = half2_of_bits(zeros);
  if (odd_pair) q.offset2 = __hadd2(q.offset2, __float2half2_rn(-960.f));  // 64 + zero, exact
  return q;
}

// K-step s of a ring entry's tile j into fragment b: slot 2q, 2q + 1 from pair q of its code words,
// dequantized exactly as `dequantize(weight, float16)` (quant_common.cuh's dequant_int4_word), and
// slot i % D into element i.
template <typename Tr>
__device__ __forceinline__ void build_b_fragment(const QuantFragRegs<Tr>& regs, int j, int s,
                                                 const FragPairParams (&pairs)[Tr::kSlots / 2], typename Tr::BFrag& b) {
  const __half2 sixteenth = __float2half2_rn(0.0625f);
#pragma unroll
  for (int w = 0; w < Tr::kWordsPerStep; ++w) {
    const int index = s * Tr::kWordsPerStep + w;
    const uint4& v = regs.codes[j][index / 4];
    const unsigned word = index % 4 == 0 ? v.x : index % 4 == 1 ? v.y : index % 4 == 2 ? v.z : v.w;
    unsigned bits[4];
    int4_word_bits(word, bits);
#pragma unroll
    for (int jj = 0; jj < 4; ++jj) {
      const int q = 4 * w + jj;
      const __half2 h = half2_of_bits(bits[jj]);
      const __half2 diff = (jj & 1) ? __hfma2(h, sixteenth, __hneg2(pairs[q].offset2)) : __hsub2(h, pairs[q].offset2);
      const __half2 value = __hmul2(diff, pairs[q].scale2);
#pragma unroll
      for (int r = 0; r < Tr::kRep; ++r) {
        b.x[r * Tr::kSlots + 2 * q] = value.x;
        b.x[r * Tr::kSlots + 2 * q + 1] = value.y;
      }
    }
  }
}

// grid: (ceil(m / (16 MF)), ceil(n / (128 NF)), splits), block: 256, dynamic shared memory
// quant_gemm_frag_smem_bytes<MF, NF, LAYOUT, DEEP>(); as quant_gemm_stream_kernel.
template <int MF, int NF, int LAYOUT, bool DEEP = false>
__global__ void __launch_bounds__(256, kQuantStreamMinBlocks) quant_gemm_frag_kernel(QuantFragParams p) {
  using namespace nvcuda;
  using Tr = QuantFragTraits<MF, NF, LAYOUT, DEEP>;
  constexpr int kDepth = Tr::kDepth;
  VOLTLLM_DYNAMIC_SMEM(smem);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  float* scratch = reinterpret_cast<float*>(smem + warp * Tr::kScratchBytes);
  __half* x_buffers = reinterpret_cast<__half*>(smem + Tr::kWarps * Tr::kScratchBytes);  // [2][kXBufHalves]
  const int m0 = blockIdx.x * Tr::kXRows;
  const int block_f0 = blockIdx.y * Tr::kBlockFeatures;
  const int f0 = block_f0 + warp * Tr::kRows;
  const int tile0 = f0 / 16;
  const int kt_begin = blockIdx.z * p.s.chunks_per_split;
  const int num_chunks = min(p.s.k / Tr::kBlockK, kt_begin + p.s.chunks_per_split) - kt_begin;  // >= 1 (host)
  const bool active = f0 < p.s.n;  // a warp past n only helps stage x (the tiles cover n rounded up to 32)
  const QuantFragLane<Tr> me = frag_lane<Tr>(p, lane);
  QuantFragRegs<Tr> ring[kDepth];
  if (active) {
#pragma unroll
    for (int d = 0; d < kDepth; ++d)
      if (d < num_chunks) load_frag_chunk<Tr>(p, me, tile0, kt_begin + d, ring[d]);
  }
  begin_dependent_grid();  // x is the previous kernel's output, and the counters its last writes
  uint4 x_regs[Tr::kXLoads];
  begin_x_windows<Tr>(p.s, m0, kt_begin, num_chunks, x_buffers, x_regs);

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
      advance_x_window<Tr>(p.s, t, m0, kt_begin, num_chunks, x_buffers, x_regs);
      if (!active) continue;
      FragPairParams pairs[NF][Tr::kSlots / 2];
#pragma unroll
      for (int j = 0; j < NF; ++j)
#pragma unroll
        for (int q = 0; q < Tr::kSlots / 2; ++q)
          pairs[j][q] = frag_pair_params<Tr::kRun>(ring[d].words[j][(2 * q) / Tr::kRun],
                                                   ring[d].words[j][(2 * q + 1) / Tr::kRun], q & 1);
      const QuantFragRegs<Tr> codes = ring[d];
      if (t + kDepth < num_chunks) load_frag_chunk<Tr>(p, me, tile0, kt_begin + t + kDepth, ring[d]);
      const __half* x_s = x_window_chunk<Tr>(x_buffers, t);
#pragma unroll
      for (int s = 0; s < Tr::kBlockK / 16; ++s) {
        typename Tr::BFrag b[NF];
#pragma unroll
        for (int j = 0; j < NF; ++j) build_b_fragment<Tr>(codes, j, s, pairs[j], b[j]);
#pragma unroll
        for (int i = 0; i < MF; ++i) {
          wmma::fragment<wmma::matrix_a, 16, 16, 16, __half, wmma::row_major> a;
          wmma::load_matrix_sync(a, x_s + 16 * i * Tr::kXLd + 16 * s, Tr::kXLd);
#pragma unroll
          for (int j = 0; j < NF; ++j) wmma::mma_sync(acc[i][j], a, b[j], acc[i][j]);
        }
      }
    }
  }
  finish_stream_tile<Tr>(p.s, acc, scratch, reinterpret_cast<int*>(x_buffers), m0, block_f0, f0, active);
}

}  // namespace voltllm
