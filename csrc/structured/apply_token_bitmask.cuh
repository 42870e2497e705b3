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

template <typename T>
__device__ __forceinline__ T negative_infinity() {
  return DType<T>::from_float(neg_inf());
}
template <>
__device__ __forceinline__ float negative_infinity<float>() {
  return neg_inf();
}

// grid: (ceil(vocab / kBitmaskThreads), num_masks), block: kBitmaskThreads. One thread per token: a
// warp reads one bitmask word (a broadcast) and stores only its disallowed logits, which are
// contiguous across the warp.
template <typename T>
__global__ void apply_token_bitmask_kernel(TokenBitmaskParams p) {
  begin_dependent_grid();
  const int token = blockIdx.x * blockDim.x + threadIdx.x;
  if (token >= p.vocab) return;
  const int mask = blockIdx.y;
  const unsigned word = static_cast<unsigned>(p.bitmask[static_cast<long long>(mask) * p.words + (token >> 5)]);
  if ((word >> (token & 31)) & 1u) return;
  const long long row = p.rows != nullptr ? p.rows[mask] : mask;
  if (row < 0 || row >= p.num_rows) return;
  static_cast<T*>(p.logits)[row * p.logits_stride + token] = negative_infinity<T>();
}

}  // namespace voltllm
