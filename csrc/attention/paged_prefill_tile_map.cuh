// The row-tile map every prefill attention launch (mma_sm80 or wmma) builds first: where each sequence's
// row tiles start in the grid (PrefillParams::cu_tiles, paged_prefill_common.cuh).
#pragma once

#include "common.cuh"

namespace voltllm {

// Writes cu_tiles[i] = sum over earlier sequences of ceil(query_len / block_m), block_m being the BLOCK_M
// of the kernel launched next. One warp; runs once per step and layer, over at most a few thousand
// sequences. grid: 1, block: 32.
__global__ void prefill_tile_map_kernel(const int* query_start_loc, int* cu_tiles, int num_seqs, int block_m) {
  begin_dependent_grid();
  const int lane = threadIdx.x;
  int carry = 0;
  if (lane == 0) cu_tiles[0] = 0;
  for (int base = 0; base < num_seqs; base += 32) {
    const int i = base + lane;
    int tiles = 0;
    if (i < num_seqs) tiles = (query_start_loc[i + 1] - query_start_loc[i] + block_m - 1) / block_m;
    // Inclusive warp scan.
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int n = __shfl_up_sync(0xffffffffu, tiles, o);
      if (lane >= o) tiles += n;
    }
    if (i < num_seqs) cu_tiles[i + 1] = carry + tiles;
    carry += __shfl_sync(0xffffffffu, tiles, 31);
  }
}

}  // namespace voltllm
