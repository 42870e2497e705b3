// Host stand-in for <mma.h> used by the kernel emulator (tests/kernels/emu): nvcuda::wmma for m16n16k16
// with fp16 / bf16 operands and fp32 accumulators, the subset the WMMA attention kernels use.
//
// WMMA leaves the order in which a fragment's elements are spread over the lanes unspecified. Here it is
// deliberately none of any GPU's: each fragment use (matrix_a, matrix_b, accumulator) has its own fixed
// permutation of the 256 (row, col) positions over (lane, element). Two orders are available
// (emu::set_wmma_order): `scrambled` puts every element anywhere, `paired` keeps elements 2k and 2k+1
// side by side (the accumulator: in one row, neighbouring columns; matrix_b: in one column, neighbouring
// rows k; the property real GPUs have and kernels may test for at run time) but scatters the pairs. A
// kernel that assumes a layout gets wrong results.
//
// Operand fragments hold 8 elements per lane, each element once. Built with
// VOLTLLM_EMU_WMMA_OPERAND_ELEMENTS=16 they hold 16, every element twice, as on real GPUs: `scrambled`
// puts the two copies anywhere (maybe both in one lane), `paired` gives the lanes in pairs one shared
// tuple of 16 distinct elements (as Volta's quad pairs share operands), and a third order, `repeated`,
// gives each lane 8 distinct elements held twice, x[i] == x[i + 8] (as SM80+'s m16n8k16 layout does).
// mma_sync fails when two copies of one element disagree.
//
// load_matrix_sync reads before it synchronises the warp and store_matrix_sync writes after it does, so a
// missing __syncwarp between lanes writing shared memory and a fragment load (or between a fragment
// store and lanes reading it) reads stale data. Pointers must be 32-byte aligned and ldm a multiple of
// 16 bytes, as CUDA requires; every lane must pass the same pointer and ldm.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <random>
#include <type_traits>
#include <vector>

#include "cuda_bf16.h"
#include "cuda_emu.h"
#include "cuda_fp16.h"

namespace emu {

#ifndef VOLTLLM_EMU_WMMA_OPERAND_ELEMENTS
#define VOLTLLM_EMU_WMMA_OPERAND_ELEMENTS 8
#endif
// Elements per lane of a matrix_a / matrix_b fragment (an accumulator always holds 8).
constexpr int kOperandElements = VOLTLLM_EMU_WMMA_OPERAND_ELEMENTS;
static_assert(kOperandElements == 8 || kOperandElements == 16, "operand fragments of 8 or 16 elements");

enum class WmmaOrder { kScrambled = 0, kPaired = 1, kRepeated = 2 };

inline WmmaOrder& wmma_order() {
  static WmmaOrder order = WmmaOrder::kScrambled;
  return order;
}
inline void set_wmma_order(WmmaOrder order) {
  if (order == WmmaOrder::kRepeated && kOperandElements != 16) fail("wmma: the repeated order needs 16 elements");
  wmma_order() = order;
}

enum WmmaUse { kUseA = 0, kUseB = 1, kUseC = 2 };

inline int wmma_elements(WmmaUse use) { return use == kUseC ? 8 : kOperandElements; }

// (row << 4 | col) of element i of lane l of one fragment use.
struct WmmaMap {
  uint8_t code[32][16];
};

// Element i (its parity picks the pair's half) of pair `pair` (0..127): neighbouring columns of one row,
// or, with along_rows (matrix_b: neighbouring k of one column n), neighbouring rows of one column.
inline uint8_t pair_code(int pair, int i, bool along_rows) {
  const int line = pair / 8, offset = (pair % 8) * 2 + (i & 1);
  return static_cast<uint8_t>(along_rows ? (offset << 4) | line : (line << 4) | offset);
}

inline std::vector<int> shuffled(int count, std::mt19937& rng) {
  std::vector<int> v(count);
  for (int i = 0; i < count; ++i) v[i] = i;
  std::shuffle(v.begin(), v.end(), rng);
  return v;
}

inline WmmaMap make_wmma_map(unsigned seed, WmmaUse use, WmmaOrder order) {
  std::mt19937 rng(seed);
  WmmaMap m{};
  const int elements = wmma_elements(use);
  const bool along_rows = use == kUseB;
  // The accumulator and 8-element operands: every element once.
  if (elements == 8) {
    const bool paired = order != WmmaOrder::kScrambled && use != kUseA;
    const std::vector<int> perm = shuffled(paired ? 128 : 256, rng);
    for (int l = 0; l < 32; ++l)
      for (int i = 0; i < 8; ++i)
        m.code[l][i] = paired ? pair_code(perm[l * 4 + i / 2], i, along_rows) : static_cast<uint8_t>(perm[l * 8 + i]);
    return m;
  }
  // 16-element operands: every element twice.
  if (order == WmmaOrder::kScrambled) {
    const std::vector<int> perm = shuffled(512, rng);
    for (int l = 0; l < 32; ++l)
      for (int i = 0; i < 16; ++i) m.code[l][i] = static_cast<uint8_t>(perm[l * 16 + i] % 256);
    return m;
  }
  const std::vector<int> pairs = shuffled(128, rng);
  if (order == WmmaOrder::kPaired) {
    // Lanes in pairs (a random pairing) share a tuple of 8 pairs.
    const std::vector<int> lanes = shuffled(32, rng);
    for (int t = 0; t < 16; ++t)
      for (int i = 0; i < 16; ++i)
        for (int copy = 0; copy < 2; ++copy)
          m.code[lanes[2 * t + copy]][i] = pair_code(pairs[t * 8 + i / 2], i, along_rows);
    return m;
  }
  for (int l = 0; l < 32; ++l)
    for (int i = 0; i < 16; ++i) m.code[l][i] = pair_code(pairs[l * 4 + (i % 8) / 2], i, along_rows);
  return m;
}

inline const WmmaMap& wmma_map(WmmaUse use) {
  static const WmmaMap maps[3][3] = {
      {make_wmma_map(101, kUseA, WmmaOrder::kScrambled), make_wmma_map(202, kUseB, WmmaOrder::kScrambled),
       make_wmma_map(303, kUseC, WmmaOrder::kScrambled)},
      {make_wmma_map(101, kUseA, WmmaOrder::kPaired), make_wmma_map(202, kUseB, WmmaOrder::kPaired),
       make_wmma_map(404, kUseC, WmmaOrder::kPaired)},
      {make_wmma_map(505, kUseA, WmmaOrder::kRepeated), make_wmma_map(606, kUseB, WmmaOrder::kRepeated),
       make_wmma_map(404, kUseC, WmmaOrder::kRepeated)},
  };
  return maps[static_cast<int>(wmma_order())][use];
}

inline int wmma_row(WmmaUse use, int lane, int i) { return wmma_map(use).code[lane][i] >> 4; }
inline int wmma_col(WmmaUse use, int lane, int i) { return wmma_map(use).code[lane][i] & 15; }

// Every lane must pass the same (pointer, ldm); CUDA's alignment rules are enforced.
inline void wmma_check_args(const void* ptr, unsigned ldm, unsigned elem_bytes) {
  if (reinterpret_cast<uintptr_t>(ptr) % 32 != 0) fail("wmma: matrix pointer not 256-bit aligned");
  if ((ldm * elem_bytes) % 16 != 0) fail("wmma: ldm is not a multiple of 16 bytes");
  struct Args {
    uintptr_t ptr;
    unsigned ldm;
  };
  const Args mine{reinterpret_cast<uintptr_t>(ptr), ldm};
  exchange(mine, [](const Args* all) {
    for (int l = 1; l < 32; ++l) {
      if (all[l].ptr != all[0].ptr || all[l].ldm != all[0].ldm) fail("wmma: lanes disagree on pointer or ldm");
    }
    return 0;
  });
}

inline float wmma_to_float(float v) { return v; }
inline float wmma_to_float(__half v) { return __half2float(v); }
inline float wmma_to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T>
T wmma_from_float(float v);
template <>
inline float wmma_from_float<float>(float v) {
  return v;
}
template <>
inline __half wmma_from_float<__half>(float v) {
  return __float2half_rn(v);
}
template <>
inline __nv_bfloat16 wmma_from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

}  // namespace emu

namespace nvcuda {
namespace wmma {

struct matrix_a {};
struct matrix_b {};
struct accumulator {};
struct row_major {};
struct col_major {};
enum layout_t { mem_row_major, mem_col_major };

template <typename Use, int M, int N, int K, typename T, typename Layout = void>
struct fragment {
  static_assert(M == 16 && N == 16 && K == 16, "the emulator has m16n16k16 only");
  static constexpr int num_elements = std::is_same<Use, accumulator>::value ? 8 : ::emu::kOperandElements;
  T x[num_elements];
};

// Element (r, c) of a 16x16 operand tile: matrix_a is (m, k), matrix_b is (k, n). Row-major puts
// (r, c) at ptr[r * ldm + c], column-major at ptr[c * ldm + r].
template <typename Use, typename T, typename Layout>
void load_matrix_sync(fragment<Use, 16, 16, 16, T, Layout>& f, const T* ptr, unsigned ldm) {
  static_assert(std::is_same<Use, matrix_a>::value || std::is_same<Use, matrix_b>::value,
                "an accumulator load takes a memory layout");
  constexpr ::emu::WmmaUse use = std::is_same<Use, matrix_a>::value ? ::emu::kUseA : ::emu::kUseB;
  const int lane = ::emu::self().lane;
  for (int i = 0; i < f.num_elements; ++i) {
    const int r = ::emu::wmma_row(use, lane, i), c = ::emu::wmma_col(use, lane, i);
    f.x[i] = std::is_same<Layout, row_major>::value ? ptr[r * ldm + c] : ptr[c * ldm + r];
  }
  ::emu::wmma_check_args(ptr, ldm, sizeof(T));
}

inline void load_matrix_sync(fragment<accumulator, 16, 16, 16, float>& f, const float* ptr, unsigned ldm,
                             layout_t layout) {
  const int lane = ::emu::self().lane;
  for (int i = 0; i < 8; ++i) {
    const int r = ::emu::wmma_row(::emu::kUseC, lane, i), c = ::emu::wmma_col(::emu::kUseC, lane, i);
    f.x[i] = layout == mem_row_major ? ptr[r * ldm + c] : ptr[c * ldm + r];
  }
  ::emu::wmma_check_args(ptr, ldm, sizeof(float));
}

inline void store_matrix_sync(float* ptr, const fragment<accumulator, 16, 16, 16, float>& f, unsigned ldm,
                              layout_t layout) {
  ::emu::wmma_check_args(ptr, ldm, sizeof(float));
  const int lane = ::emu::self().lane;
  for (int i = 0; i < 8; ++i) {
    const int r = ::emu::wmma_row(::emu::kUseC, lane, i), c = ::emu::wmma_col(::emu::kUseC, lane, i);
    (layout == mem_row_major ? ptr[r * ldm + c] : ptr[c * ldm + r]) = f.x[i];
  }
}

template <typename Use, typename T, typename Layout, typename V>
void fill_fragment(fragment<Use, 16, 16, 16, T, Layout>& f, const V& v) {
  for (int i = 0; i < f.num_elements; ++i) f.x[i] = ::emu::wmma_from_float<T>(static_cast<float>(v));
}

// D = A B + C over the whole warp, fp32 accumulation of the fp16 / bf16 products. Every copy of an
// operand element must hold the same value.
template <typename T, typename La, typename Lb>
void mma_sync(fragment<accumulator, 16, 16, 16, float>& d, const fragment<matrix_a, 16, 16, 16, T, La>& a,
              const fragment<matrix_b, 16, 16, 16, T, Lb>& b, const fragment<accumulator, 16, 16, 16, float>& c) {
  constexpr int kOps = ::emu::kOperandElements;
  struct In {
    T a[kOps], b[kOps];
    float c[8];
  } in;
  std::memcpy(in.a, a.x, sizeof(in.a));
  std::memcpy(in.b, b.x, sizeof(in.b));
  std::memcpy(in.c, c.x, sizeof(in.c));
  float A[16][16], B[16][16], C[16][16];
  bool seen_a[16][16] = {}, seen_b[16][16] = {};
  const auto put = [](float (&m)[16][16], bool (&seen)[16][16], int r, int col, float v) {
    if (seen[r][col] && !(m[r][col] == v || (std::isnan(m[r][col]) && std::isnan(v))))
      ::emu::fail("wmma: two copies of an operand element disagree");
    m[r][col] = v;
    seen[r][col] = true;
  };
  ::emu::exchange(in, [&](const In* all) {
    for (int l = 0; l < 32; ++l) {
      for (int i = 0; i < kOps; ++i) {
        put(A, seen_a, ::emu::wmma_row(::emu::kUseA, l, i), ::emu::wmma_col(::emu::kUseA, l, i),
            ::emu::wmma_to_float(all[l].a[i]));
        put(B, seen_b, ::emu::wmma_row(::emu::kUseB, l, i), ::emu::wmma_col(::emu::kUseB, l, i),
            ::emu::wmma_to_float(all[l].b[i]));
      }
      for (int i = 0; i < 8; ++i)
        C[::emu::wmma_row(::emu::kUseC, l, i)][::emu::wmma_col(::emu::kUseC, l, i)] = all[l].c[i];
    }
    return 0;
  });
  const int lane = ::emu::self().lane;
  for (int i = 0; i < 8; ++i) {
    const int r = ::emu::wmma_row(::emu::kUseC, lane, i), col = ::emu::wmma_col(::emu::kUseC, lane, i);
    float acc = C[r][col];
    for (int k = 0; k < 16; ++k) acc += A[r][k] * B[k][col];
    d.x[i] = acc;
  }
}

}  // namespace wmma
}  // namespace nvcuda
