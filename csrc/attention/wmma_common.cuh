// Helpers shared by the tensor-core attention kernels.
#pragma once

#include <mma.h>

#include "common.cuh"

namespace voltllm {

// Recovers which tile row each accumulator element holds. WMMA fragments have an unspecified but
// fixed element order, so loading a matrix whose every element is its own row index reveals it;
// the online softmax needs this to rescale accumulator rows without a shared-memory round trip.
template <typename Frag>
__device__ __forceinline__ void fragment_rows(float* scratch, int ld, int (&rows)[Frag::num_elements]) {
  const int lane = threadIdx.x & 31;
  for (int i = lane; i < 16 * 16; i += 32) scratch[(i / 16) * ld + i % 16] = static_cast<float>(i / 16);
  __syncwarp();
  Frag f;
  nvcuda::wmma::load_matrix_sync(f, scratch, ld, nvcuda::wmma::mem_row_major);
#pragma unroll
  for (int i = 0; i < Frag::num_elements; ++i) rows[i] = static_cast<int>(f.x[i]);
  __syncwarp();
}

}  // namespace voltllm
