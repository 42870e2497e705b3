// The parameters the decode attention kernel (paged_decode_wmma.cuh) and its split merge take: one
// definition, so the glue fills them once and the merge reads the partials through the same fields.
#pragma once

#include "common.cuh"

namespace voltllm {

struct DecodeParams {
  void* out;                    // [num_seqs, num_heads, head_size], rows out_stride apart
  const void* query;            // [num_seqs, num_heads, head_size], rows query_stride apart
  const void* key_cache;        // [num_blocks, block_size, num_kv_heads, head_size]
  const void* value_cache;      // [num_blocks, block_size, num_kv_heads, head_size]
  const int* block_tables;      // [num_seqs, max_blocks_per_seq]
  const int* seq_lens;          // [num_seqs] context length including the new token
  float* partial_out;           // [num_seqs, num_heads, max_splits, head_size] (max_splits > 1)
  float* partial_max;           // [num_seqs, num_heads, max_splits] running max, log2 units
  float* partial_sum;           // [num_seqs, num_heads, max_splits] softmax denominators
  long long query_stride;       // elements between sequences of query
  long long out_stride;         // elements between sequences of out
  int num_heads;                // query heads
  int num_kv_heads;             // kv heads; num_heads / num_kv_heads <= 16
  int max_blocks_per_seq;       // row length of block_tables
  int max_splits;               // grid z; splits past a sequence's own count exit at once
  int partition_size;           // tokens per split, a multiple of kBlockSize
  int sliding_window;           // attend to the last `sliding_window` positions; 0 = unlimited
  float scale_log2;             // softmax scale * log2(e): scores are kept in log2 units
};

}  // namespace voltllm
