// What the weight-only quantized kernels (quant_gemv.cuh, quant_gemm_wmma.cuh) share: the packed weight
// layout written once at load (voltllm/ops/quantized_linear.py `pack`), the per-group parameter word, and
// the conversions of packed codes to fp16 in registers.
//
// Packed layout. A weight [n, k] is stored as n rows of k codes, each row a run of 16-byte chunks:
// 32 codes per chunk for 4-bit, 16 for 8-bit, columns in order (act-order checkpoints are permuted at
// pack time so that every group is a contiguous run of columns). Inside a chunk's 32-bit words:
//   4-bit: word w holds codes 8w .. 8w+7; code 8w + 2j sits at bits 4j, code 8w + 2j + 1 at bits 16 + 4j
//          (j = 0..3), so that one mask puts a pair of neighbours into the two halves of a half2;
//   8-bit: byte i of the row is code i (int8 and fp8 e4m3 alike).
// Group parameters: one 32-bit word per (row, group), [n, num_groups]:
//   int:  half2 (scale, 1024 + zero point): the zero is stored biased by the 1024 that the fp16 magic
//         number below adds, so that one HSUB2 yields the exact integer code - zero;
//   fp8:  float 256 * scale (the fp16 pattern built from an e4m3 byte is its value / 256).
// Every conversion is exact: dequantized weights equal `dequantize(weight, torch.float16)`, the
// definition in voltllm/layers/quantization/quantized_weight.py.
#pragma once

#include "common.cuh"

namespace voltllm {

// The three packed kinds; the torch glue and quantized_linear.py use the same numbers.
enum QuantKind : int {
  kQuantInt4 = 0,  // 4-bit integer codes, zero point per group
  kQuantInt8 = 1,  // 8-bit integer codes, zero point per group
  kQuantFp8 = 2,   // fp8 e4m3 values, scale per group
};

template <int KIND>
struct QuantTraits {
  static_assert(KIND == kQuantInt4 || KIND == kQuantInt8 || KIND == kQuantFp8, "unknown quantized kind");
  static constexpr int kBits = KIND == kQuantInt4 ? 4 : 8;
  static constexpr int kChunk = 128 / kBits;  // codes per 16-byte chunk
  static constexpr int kPairsPerWord = 16 / kBits;  // half2 values one 32-bit word unpacks to
};

union HalfBits {
  unsigned u;
  __half2 h;
};

__device__ __forceinline__ __half2 half2_of_bits(unsigned u) {
  HalfBits b;
  b.u = u;
  return b.h;
}

__device__ __forceinline__ unsigned bits_of_half2(__half2 h) {
  HalfBits b;
  b.h = h;
  return b.u;
}

// (a & MASK) | OR in one LOP3: written as C, the compiler spends an AND and an OR on two immediates.
template <unsigned MASK, unsigned OR>
__device__ __forceinline__ unsigned and_or(unsigned a) {
#ifdef VOLTLLM_EMULATE
  return (a & MASK) | OR;
#else
  unsigned r;
  asm("lop3.b32 %0, %1, %2, %3, 0xea;" : "=r"(r) : "r"(a), "n"(MASK), "n"(OR));  // 0xea: (a & b) | c
  return r;
#endif
}

// Loads of what a kernel reads once (packed weights, group words): by the non-coherent path without
// allocating in L1 (PTX ISA 7.4, sm_70+), so that the lines of x, which every warp reads again, keep
// L1 while the weights stream past.
__device__ __forceinline__ uint4 load_no_l1(const uint4* ptr) {
#ifdef VOLTLLM_EMULATE
  return *ptr;
#else
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(ptr));
  return v;
#endif
}

__device__ __forceinline__ unsigned load_no_l1(const unsigned* ptr) {
#ifdef VOLTLLM_EMULATE
  return *ptr;
#else
  unsigned v;
  asm("ld.global.nc.L1::no_allocate.u32 %0, [%1];" : "=r"(v) : "l"(ptr));
  return v;
#endif
}

// *ptr for data a kernel reads once: through load_no_l1 with NO_L1, else a plain load.
template <bool NO_L1, typename T>
__device__ __forceinline__ T load_once(const T* ptr) {
  if constexpr (NO_L1) {
    return load_no_l1(ptr);
  } else {
    return *ptr;
  }
}

// One (row, group)'s parameters, unpacked once per chunk.
template <int KIND>
struct GroupParams {
  __half2 scale2;  // int: the fp16 scale in both halves
  __half2 zero2;   // int: 1024 + zero point in both halves
  float scale;     // fp8: 256 * scale
};

template <int KIND>
__device__ __forceinline__ GroupParams<KIND> unpack_group_params(unsigned word) {
  GroupParams<KIND> g;
  if constexpr (KIND == kQuantFp8) {
    g.scale = __uint_as_float(word);
  } else {
    g.scale2 = half2_of_bits(__byte_perm(word, 0u, 0x1010u));  // low half in both halves
    g.zero2 = half2_of_bits(__byte_perm(word, 0u, 0x3232u));   // high half in both halves
  }
  return g;
}

// Pair j of a packed word, as the fp16 bit pattern of (1024 + code) (int) or of value / 256 (fp8).
// 4-bit: nibbles j and 4 + j of the word's two halves, OR'd into the exponent of 1024 (0x6400), whose
// mantissa step is exactly 1. 8-bit int: bytes 2j and 2j + 1 under the same exponent (byte_perm).
// fp8 e4m3 (sign, 4 exponent bits with bias 7, 3 mantissa bits): the byte in the high half of a 16-bit
// lane, the sign kept and the other 7 bits shifted down one, is the fp16 (bias 15) pattern of value
// * 2^-8, subnormals included. (e4m3's NaN, 0x7f / 0xff, becomes 480 / 256; checkpoints hold none.)
template <int KIND>
__device__ __forceinline__ unsigned code_pair_bits(unsigned word, int j) {
  if constexpr (KIND == kQuantInt4) {
    return and_or<0x000f000fu, 0x64006400u>(word >> (4 * j));
  } else if constexpr (KIND == kQuantInt8) {
    return __byte_perm(word, 0x64646464u, j == 0 ? 0x4140u : 0x4342u);
  } else {
    const unsigned x = __byte_perm(word, 0u, j == 0 ? 0x1404u : 0x3424u);  // bytes 2j, 2j+1 as high bytes
    return (x & 0x80008000u) | ((x >> 1) & 0x3f803f80u);
  }
}

// The magic-number conversion of a whole 4-bit word in 1 shift and 4 LOP3: its 4 pairs as fp16 bit
// patterns, pairs 0 and 2 as (1024 + code), pairs 1 and 3 as (1024 + 16 code) (their nibbles sit 4 bits
// higher; shifting them down would cost an instruction per pair). Pair j holds codes 8w + 2j, 8w + 2j + 1.
__device__ __forceinline__ void int4_word_bits(unsigned word, unsigned (&bits)[4]) {
  const unsigned high = word >> 8;
  bits[0] = and_or<0x000f000fu, 0x64006400u>(word);
  bits[1] = and_or<0x00f000f0u, 0x64006400u>(word);
  bits[2] = and_or<0x000f000fu, 0x64006400u>(high);
  bits[3] = and_or<0x00f000f0u, 0x64006400u>(high);
}

// For kernels that apply the scale once per chunk (the GEMV): an int word's pairs as (code - zero) /
// 2^bits, exact in fp16 (|value| < 1, at most 9 significant bits), from the magic-number patterns with
// one HFMA2 each: p * 2^-s - (zero term), where the power-of-two product is exact and the difference is
// representable, so the FMA's one rounding changes nothing. The zero terms depend only on the group.
struct IntOffsetTerms {
  __half2 lo;  // int4 pairs 0, 2 and int8: subtracted from p / 16 (int4) or p / 256 (int8)
  __half2 hi;  // int4 pairs 1, 3: subtracted from p / 256
};

template <int KIND>
__device__ __forceinline__ IntOffsetTerms int_offset_terms(__half2 zero2) {
  static_assert(KIND == kQuantInt4 || KIND == kQuantInt8, "integer kinds only");
  IntOffsetTerms t;
  if constexpr (KIND == kQuantInt4) {
    // (1024 + c) / 16 - (64 + z / 16) and (1024 + 16 c) / 256 - (4 + z / 16) are both (c - z) / 16.
    t.lo = __hmul2(zero2, __float2half2_rn(0.0625f));          // 64 + z / 16, exact
    t.hi = __hadd2(t.lo, __float2half2_rn(-60.f));              // 4 + z / 16, exact
  } else {
    // (1024 + c) / 256 - (4 + z / 256) is (c - z) / 256.
    t.lo = __hmul2(zero2, __float2half2_rn(0.00390625f));      // 4 + z / 256, exact
    t.hi = t.lo;
  }
  return t;
}

// The int kinds' fp32 factor that turns a sum of x * (code - zero) / 2^bits into x * weight.
template <int KIND>
__device__ __forceinline__ float int_offset_scale(const GroupParams<KIND>& g) {
  return __low2float(g.scale2) * (KIND == kQuantInt4 ? 16.f : 256.f);
}

// The dequantized fp16 weights of pair j of a word, rounded once as `dequantize(..., float16)` rounds:
// int (code - zero) * scale (exact difference, one rounding of the product); fp8 value * scale computed
// in fp32 from the exact value / 256.
template <int KIND>
__device__ __forceinline__ __half2 dequant_pair(unsigned word, int j, const GroupParams<KIND>& g) {
  const __half2 h = half2_of_bits(code_pair_bits<KIND>(word, j));
  if constexpr (KIND == kQuantFp8) {
    const float2 f = __half22float2(h);
    return __floats2half2_rn(f.x * g.scale, f.y * g.scale);
  } else {
    return __hmul2(__hsub2(h, g.zero2), g.scale2);
  }
}

// The 4 dequantized pairs of a 4-bit word, from int4_word_bits: pairs 0 and 2 by (p - (1024 + zero)),
// pairs 1 and 3 by p / 16 - (64 + zero) (both the exact integer code - zero), then times the scale.
__device__ __forceinline__ void dequant_int4_word(unsigned word, const GroupParams<kQuantInt4>& g,
                                                  __half2 (&out)[4]) {
  unsigned bits[4];
  int4_word_bits(word, bits);
  const __half2 zero_hi = __hadd2(g.zero2, __float2half2_rn(-960.f));  // 64 + zero, exact
  const __half2 sixteenth = __float2half2_rn(0.0625f);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const __half2 h = half2_of_bits(bits[j]);
    const __half2 diff = (j & 1) ? __hfma2(h, sixteenth, __hneg2(zero_hi)) : __hsub2(h, g.zero2);
    out[j] = __hmul2(diff, g.scale2);
  }
}

// A 16-byte chunk of codes dequantized to kChunk fp16 weights in column order (as 16-byte vectors).
template <int KIND>
__device__ __forceinline__ void dequant_chunk(const uint4& raw, const GroupParams<KIND>& g,
                                              uint4 (&out)[QuantTraits<KIND>::kChunk / 8]) {
  constexpr int kPairs = QuantTraits<KIND>::kPairsPerWord;
  const unsigned words[4] = {raw.x, raw.y, raw.z, raw.w};
  unsigned pairs[4 * kPairs];
#pragma unroll
  for (int w = 0; w < 4; ++w) {
    if constexpr (KIND == kQuantInt4) {
      __half2 word_pairs[4];
      dequant_int4_word(words[w], g, word_pairs);
#pragma unroll
      for (int j = 0; j < 4; ++j) pairs[w * 4 + j] = bits_of_half2(word_pairs[j]);
    } else {
#pragma unroll
      for (int j = 0; j < kPairs; ++j) pairs[w * kPairs + j] = bits_of_half2(dequant_pair<KIND>(words[w], j, g));
    }
  }
#pragma unroll
  for (int v = 0; v < QuantTraits<KIND>::kChunk / 8; ++v)
    out[v] = make_uint4(pairs[4 * v], pairs[4 * v + 1], pairs[4 * v + 2], pairs[4 * v + 3]);
}

// The group of chunk `chunk` of a row: groups are 2^chunk_group_shift chunks long, or one group spans
// the row (per-channel scales, num_groups == 1, whatever the row length).
__device__ __forceinline__ int group_of_chunk(int chunk, int chunk_group_shift, int num_groups) {
  return num_groups == 1 ? 0 : chunk >> chunk_group_shift;
}

}  // namespace voltllm
