// The parameters the decode attention kernel (paged_decode_wmma.cuh) and its split merge take, and the rule
// that splits a sequence's context: one definition, so the glue, the kernel and the merge agree on both.
#pragma once

#include "common.cuh"

namespace voltllm {

// Weights a kernel asks L2 for on behalf of the kernels after it (up to kMaxRanges byte ranges). A
// latency-bound kernel that leaves the memory idle (decode attention at small batches) brings the layer's
// next weights into L2 that way, so the GEMVs that read them stream from L2 instead of memory. Weights are
// never written by a kernel, so asking early is always safe. count 0: nothing.
//
// SM90+ only, through the TMA's bulk prefetch (cp.async.bulk.prefetch.L2: one instruction per kChunkBytes,
// no register, nothing waited for). Session 15's form, a `prefetch.global.L2` per 128-byte line from
// every thread (~180k instructions a layer at Qwen3-0.6B), lengthened the attention kernel by more than
// the GEMVs gained (docs/kernels.md); earlier GPUs have no bulk form, so there the ranges are ignored.
struct L2Prefetch {
  static constexpr int kMaxRanges = 4;
  static constexpr long long kChunkBytes = 32 * 1024;
  const char* base[kMaxRanges];  // 16-byte aligned
  long long bytes[kMaxRanges];   // multiples of 16
  int count;
};

// This warp's share of `pf`: the grid's warps take the kChunkBytes chunks of each range in turn, lane 0
// asking for each (so a chunk is asked for once).
__device__ __forceinline__ void prefetch_l2_ranges(const L2Prefetch& pf) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && !defined(VOLTLLM_EMULATE)
  if (pf.count == 0 || (threadIdx.x & 31) != 0) return;
  const long long warps = static_cast<long long>(gridDim.x) * gridDim.y * gridDim.z * (blockDim.x >> 5);
  const long long block = (static_cast<long long>(blockIdx.z) * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x;
  const long long first = block * (blockDim.x >> 5) + (threadIdx.x >> 5);
  for (int r = 0; r < L2Prefetch::kMaxRanges && r < pf.count; ++r) {
    for (long long offset = first * L2Prefetch::kChunkBytes; offset < pf.bytes[r];
         offset += warps * L2Prefetch::kChunkBytes) {
      const long long left = pf.bytes[r] - offset;
      const unsigned size = static_cast<unsigned>(left < L2Prefetch::kChunkBytes ? left : L2Prefetch::kChunkBytes);
      asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(pf.base[r] + offset), "r"(size) : "memory");
    }
  }
#else
  (void)pf;
#endif
}

// The attention prologue folded into the decode kernel (positions != nullptr): `query` then points at the
// layer's qkv projection rows [q heads | k heads | v heads], before q/k norm and rotary; each block
// normalises and rotates its query heads while staging them, and the block whose split holds the newest
// position writes that token's rotated key and its value into the cache before it reads the cache.
// Same arithmetic as ops/qk_norm_rope.cuh (NeoX rotary), which the kernel shares.
struct DecodePrologue {
  const long long* positions;     // [num_seqs] rotary positions; outside [0, max_position) not rotated
  const float* cos_sin_cache;     // [max_position, HEAD]: cos in [:HEAD/2], sin in [HEAD/2:]
  const void* q_weight;           // [HEAD] q norm weight, or nullptr (no q/k norm)
  const void* k_weight;           // [HEAD] or nullptr
  const long long* slot_mapping;  // [num_seqs] cache slot of the newest token; -1 (or >= num_slots) = not written
  long long max_position;
  long long num_slots;
  float eps;
};

struct DecodeParams {
  void* out;                    // [num_seqs, num_heads, head_size], rows out_stride apart
  const void* query;            // [num_seqs, num_heads, head_size], rows query_stride apart (or qkv rows)
  void* key_cache;              // [num_blocks, block_size, num_kv_heads, head_size]; written by the prologue
  void* value_cache;            // [num_blocks, block_size, num_kv_heads, head_size]
  const int* block_tables;      // [num_seqs, max_blocks_per_seq]
  const int* seq_lens;          // [num_seqs] context length including the new token
  float* partial_out;           // [num_seqs, num_heads, max_splits, head_size] (max_splits > 1)
  float* partial_max;           // [num_seqs, num_heads, max_splits] running max, log2 units
  float* partial_sum;           // [num_seqs, num_heads, max_splits] softmax denominators
  // [num_seqs * num_kv_heads] zeroed counters: the last split block of a (sequence, kv head) to finish
  // merges the splits and sets its counter back to 0. nullptr: the split merge kernel merges.
  int* merge_tickets;
  DecodePrologue prologue;
  // The layer's next weights (o_proj, then the MLP's up to its first input-dependent read), asked of L2
  // by every block once the kernel before has finished (so the request does not slow that kernel's own
  // weight stream): at small batches this kernel is latency-bound and the memory idle.
  L2Prefetch l2_prefetch;
  long long query_stride;       // elements between sequences of query
  long long out_stride;         // elements between sequences of out
  int num_heads;                // query heads
  int num_kv_heads;             // kv heads; num_heads / num_kv_heads <= 16
  int max_blocks_per_seq;       // row length of block_tables
  int max_splits;               // grid z; splits past a sequence's own count exit at once
  int min_split;                // tokens a split covers at least (decode_split)
  int sliding_window;           // attend to the last `sliding_window` positions; 0 = unlimited
  float scale_log2;             // softmax scale * log2(e): scores are kept in log2 units
};

// Splits are a multiple of four warps' KV blocks, so every warp of a split walks the same number of blocks.
constexpr int kSplitGranule = 4 * kBlockSize;

struct DecodeSplit {
  int count;      // splits of this context
  int partition;  // tokens per split (the last may have fewer)
};

// How a context of `span` positions is split: into as many splits as `max_splits` allows while each covers
// at least `min_split` tokens, rounded up to kSplitGranule. The kernel applies it to each sequence's own
// span (read on the device), so a CUDA graph captured for the longest context still splits a short one
// by its real length; the glue applies it to the longest span for the grid.
__host__ __device__ __forceinline__ DecodeSplit decode_split(int span, int max_splits, int min_split) {
  const int most = (span + min_split - 1) / min_split;
  const int capped = most < max_splits ? most : max_splits;  // (no min/max: this runs on the host too)
  const int splits = capped > 1 ? capped : 1;
  const int partition = ((span + splits - 1) / splits + kSplitGranule - 1) / kSplitGranule * kSplitGranule;
  return {(span + partition - 1) / partition, partition};
}

// The first position a sequence of `seq_len` attends to, rounded down to its KV block: splits start there.
__host__ __device__ __forceinline__ int decode_base(int seq_len, int sliding_window) {
  const int first_pos = sliding_window > 0 && seq_len > sliding_window ? seq_len - sliding_window : 0;
  return first_pos / kBlockSize * kBlockSize;
}

}  // namespace voltllm
