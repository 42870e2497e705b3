// Structured outputs: sets the logits of the tokens a grammar's bitmask disallows to -inf, in place.
//
// The bitmask is what llguidance fills on the host (one bit per token id: bit i % 32 of int32 word
// i / 32, 1 = allowed), copied to the device as it is. Reading it directly replaces torch's unpack to
// a [rows, words, 32] int32 intermediate, a compare and a masked_fill (four kernels and ~200 MB of
// traffic at batch 64 over Qwen3's 151,936 tokens) with one kernel that reads 1.2 MB and writes only
// the masked logits.
#pragma once

#include "common.cuh"

namespace voltllm {

struct TokenBitmaskParams {
  void* logits;             // [num_rows, >= vocab], rows logits_stride elements apart
  long long logits_stride;  // elements between consecutive logits rows
  const int* bitmask;       // [num_masks, words]: bit (t % 32) of word t / 32 set = token t allowed
  const int* rows;          // [num_masks] the logits row of each mask; nullptr: mask m is row m
  int words;                // int32 words per mask (at least ceil(vocab / 32))
  int vocab;                // tokens (logits) to mask in each row
  int num_rows;             // logits rows: a mask whose row is outside [0, num_rows) is skipped
};

constexpr int kBitmaskThreads = 256;
constexpr int kBitmaskWarps = kBitmaskThreads / 32;
// Words a warp reads before it stores (loads in flight), and rounds of them per warp: a block covers
// kBitmaskBlockWords words of a row, 4,096 tokens. (The kernel before it ran one thread per token:
// ~38k blocks of 256 at batch 64 over 151,936 tokens, whose 39 MB of stores took 54 us of an H100
// step, ~0.25 of its store bandwidth: block scheduling, not bytes. This grid has 16x fewer blocks.)
constexpr int kBitmaskUnroll = 4;
constexpr int kBitmaskRounds = 4;
constexpr int kBitmaskBlockWords = kBitmaskWarps * kBitmaskUnroll * kBitmaskRounds;

// Blocks per mask (the grid's x) for a vocabulary of `vocab` tokens.
__host__ __device__ inline int apply_token_bitmask_blocks(int vocab) {
  const int words = (vocab + 31) / 32;
  return (words + kBitmaskBlockWords - 1) / kBitmaskBlockWords;
}

template <typename T>
__device__ __forceinline__ T negative_infinity() {
  return DType<T>::from_float(neg_inf());
}
template <>
__device__ __forceinline__ float negative_infinity<float>() {
  return neg_inf();
}

// grid: (apply_token_bitmask_blocks(vocab), num_masks), block: kBitmaskThreads. A warp takes
// kBitmaskUnroll consecutive words of its mask at a time (each a broadcast load, all issued before the
// first store), lane l the token 32 w + l of word w, and stores only the disallowed logits, which are
// contiguous across the warp; the warps of the grid stride over the row's words.
template <typename T>
__global__ void __launch_bounds__(kBitmaskThreads) apply_token_bitmask_kernel(TokenBitmaskParams p) {
  begin_dependent_grid();
  const int mask = blockIdx.y;
  const long long row = p.rows != nullptr ? p.rows[mask] : mask;
  if (row < 0 || row >= p.num_rows) return;
  const int lane = threadIdx.x & 31;
  const int words = (p.vocab + 31) >> 5;  // the words that hold tokens: bits past the vocabulary are ignored
  const int* bits = p.bitmask + static_cast<long long>(mask) * p.words;
  T* logits = static_cast<T*>(p.logits) + row * p.logits_stride;
  const int stride = gridDim.x * kBitmaskWarps * kBitmaskUnroll;
  for (int w0 = (blockIdx.x * kBitmaskWarps + (threadIdx.x >> 5)) * kBitmaskUnroll; w0 < words; w0 += stride) {
    unsigned word[kBitmaskUnroll];
#pragma unroll
    for (int u = 0; u < kBitmaskUnroll; ++u) word[u] = w0 + u < words ? static_cast<unsigned>(bits[w0 + u]) : ~0u;
#pragma unroll
    for (int u = 0; u < kBitmaskUnroll; ++u) {
      const int token = 32 * (w0 + u) + lane;
      if (token < p.vocab && !((word[u] >> lane) & 1u)) logits[token] = negative_infinity<T>();
    }
  }
}

}  // namespace voltllm
