// Sorts the routed pairs by expert into tiles: per-expert counts, their offsets padded to the tile rows,
// each tile's expert and each slot's pair (see moe_params.cuh for the layout).
//
// One thread block does it all, counting in shared memory with atomics: the work is a few reads per pair
// (at most 65,536 pairs for 8,192 tokens of top-8), and one block needs no grid-wide step between the
// count, the scan and the scatter. The order of the pairs inside an expert's slots follows the atomics
// and varies between runs; every slot's result depends on its own pair only, so outputs do not.
#pragma once

#include "moe/moe_params.cuh"

namespace voltllm {

constexpr int kMoeAlignThreads = 512;

// Shared memory of moe_align_kernel: counts, slot offsets (one more) and scatter cursors per expert.
__host__ __device__ constexpr int moe_align_smem_bytes(int num_experts) { return (3 * num_experts + 1) * 4; }
__device__ const int moe_align_max_smem_bytes = moe_align_smem_bytes(kMoeMaxExperts);  // for the gate's report

// grid: 1, block: kMoeAlignThreads, dynamic shared memory: moe_align_smem_bytes(num_experts).
__global__ void __launch_bounds__(kMoeAlignThreads) moe_align_kernel(MoeAlignParams p) {
  VOLTLLM_DYNAMIC_SMEM(smem);
  int* counts = reinterpret_cast<int*>(smem);         // [num_experts]
  int* slot_offsets = counts + p.num_experts;         // [num_experts + 1]: first slot of each expert
  int* cursors = slot_offsets + p.num_experts + 1;    // [num_experts]
  const int experts = p.num_experts, rows = p.tile_rows;
  begin_dependent_grid();
  for (int e = threadIdx.x; e < experts; e += blockDim.x) {
    counts[e] = 0;
    cursors[e] = 0;
  }
  __syncthreads();
  for (int i = threadIdx.x; i < p.num_pairs; i += blockDim.x) atomicAdd(&counts[p.topk_ids[i]], 1);
  __syncthreads();
  if (threadIdx.x < 32) {
    // Warp 0 scans the padded counts: lane l sums experts [l * per_lane, (l + 1) * per_lane) in order,
    // a shuffle scan adds the lanes before it.
    const int lane = threadIdx.x;
    const int per_lane = (experts + 31) / 32;
    const int first = lane * per_lane, last = min(first + per_lane, experts);
    int local = 0;
    for (int e = first; e < last; ++e) local += (counts[e] + rows - 1) / rows * rows;
    int inclusive = local;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int before = __shfl_up_sync(0xffffffffu, inclusive, o);
      if (lane >= o) inclusive += before;
    }
    int running = inclusive - local;
    for (int e = first; e < last; ++e) {
      slot_offsets[e] = running;
      running += (counts[e] + rows - 1) / rows * rows;
    }
    if (lane == 31) {
      slot_offsets[experts] = inclusive;
      *p.num_tiles = inclusive / rows;
    }
  }
  __syncthreads();
  for (int e = threadIdx.x; e < experts; e += blockDim.x) {
    const int begin = slot_offsets[e], end = slot_offsets[e + 1];
    for (int t = begin / rows; t < end / rows; ++t) p.tile_experts[t] = e;
    for (int s = begin + counts[e]; s < end; ++s) p.sorted_pair_ids[s] = -1;
  }
  for (int i = threadIdx.x; i < p.num_pairs; i += blockDim.x) {
    const int e = p.topk_ids[i];
    p.sorted_pair_ids[slot_offsets[e] + atomicAdd(&cursors[e], 1)] = i;
  }
}

}  // namespace voltllm
