// KV-cache write: copies a step's new keys/values into their paged-cache slots.
#pragma once

#include "common.cuh"

namespace voltllm {

struct KvWriteParams {
  const void* key;                 // [num_tokens, num_kv_heads, head_size], rows key_stride apart
  const void* value;               // [num_tokens, num_kv_heads, head_size], rows value_stride apart
  const long long* slot_mapping;   // [num_tokens] flat slot (block * block_size + offset); -1 = skip
  void* key_cache;                 // [num_blocks, block_size, num_kv_heads, head_size]
  void* value_cache;               // [num_blocks, block_size, num_kv_heads, head_size]
  long long key_stride;            // elements between consecutive tokens of `key`
  long long value_stride;          // elements between consecutive tokens of `value`
  long long num_slots;             // num_blocks * block_size: slots at or past it are skipped
  int num_tokens;                  // rows of key/value
  int row_elems;                   // num_kv_heads * head_size (a multiple of 8)
};

// grid: (num_tokens), block: any multiple of 32. Heads of one token are contiguous in both the
// source row and the cache slot, so one token is a single run of row_elems elements.
template <typename T>
__global__ void kv_cache_write_kernel(KvWriteParams p) {
  begin_dependent_grid();
  const int token = blockIdx.x;
  const long long slot = p.slot_mapping[token];
  // Padding tokens carry -1; an out-of-range slot is dropped rather than corrupting memory.
  if (slot < 0 || slot >= p.num_slots) return;
  const T* key = static_cast<const T*>(p.key) + token * p.key_stride;
  const T* value = static_cast<const T*>(p.value) + token * p.value_stride;
  T* key_dst = static_cast<T*>(p.key_cache) + slot * p.row_elems;
  T* value_dst = static_cast<T*>(p.value_cache) + slot * p.row_elems;
  for (int i = threadIdx.x * 8; i < p.row_elems; i += blockDim.x * 8) {
    *reinterpret_cast<uint4*>(key_dst + i) = *reinterpret_cast<const uint4*>(key + i);
    *reinterpret_cast<uint4*>(value_dst + i) = *reinterpret_cast<const uint4*>(value + i);
  }
}

}  // namespace voltllm
