// What the prefill / chunked-prefill attention kernels (paged_prefill_mma_sm80.cuh, SM80+;
// paged_prefill_wmma.cuh, every GPU) share: their params struct and how a thread block finds the sequence
// and query rows it computes in the row-tile map (paged_prefill_tile_map.cuh, kept apart so that each
// kernel source compiles only its own kernels).
//
// Both kernels see the same problem: every query token attends causally to its sequence's whole context,
// the cached prefix (prefix-cache hits, earlier chunks) and this step's tokens. The step's keys/values are
// written into the cache first (ops/kv_cache_write.cuh), so all of the context is read through the block table.
// A thread block computes BLOCK_M query rows (a row tile) of one query head; BLOCK_M is the kernel's own.
#pragma once

#include "common.cuh"


namespace voltllm {

struct PrefillParams {
  void* out;                    // [num_tokens, num_heads, head_size], rows out_stride apart
  const void* query;            // [num_tokens, num_heads, head_size], rows query_stride apart
  const void* key_cache;        // [num_blocks, block_size, num_kv_heads, head_size]
  const void* value_cache;      // [num_blocks, block_size, num_kv_heads, head_size]
  const int* block_tables;      // [num_seqs, max_blocks_per_seq]
  const int* seq_lens;          // [num_seqs] context length after this step
  const int* query_start_loc;   // [num_seqs + 1] first query row of each sequence
  const int* cu_tiles;          // [num_seqs + 1] first row tile of each sequence (prefix sum)
  long long query_stride;       // elements between tokens of query
  long long out_stride;         // elements between tokens of out
  int num_seqs;                 // sequences in the batch
  int num_heads;                // query heads
  int num_kv_heads;             // kv heads (num_heads is a multiple)
  int max_blocks_per_seq;       // row length of block_tables
  int sliding_window;           // attend to the last `sliding_window` positions; 0 = unlimited
  float scale_log2;             // softmax scale * log2(e)
};

// The query rows one thread block computes: row tile blockIdx.x of the batch, for query head blockIdx.y.
struct PrefillRowTile {
  int seq;         // the sequence
  int q_start;     // its first query row in query / out
  int ctx_before;  // its cached positions in front of this step's tokens
  int row0;        // this tile's first row within the sequence's query rows
  int rows;        // rows in this tile: block_m, fewer in a sequence's last tile
};

// Finds this block's row tile by binary search in the tile prefix sum; false for the blocks past the last
// tile (the grid may over-count tiles). Within a sequence, later row tiles see more keys: they are given
// the lower block indices, which launch first and so shorten the tail of the grid.
__device__ __forceinline__ bool find_row_tile(const PrefillParams& p, int block_m, PrefillRowTile& t) {
  const int tile = blockIdx.x;
  if (tile >= p.cu_tiles[p.num_seqs]) return false;
  int lo = 0, hi = p.num_seqs - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (p.cu_tiles[mid] <= tile) lo = mid; else hi = mid - 1;
  }
  t.seq = lo;
  const int seq_tiles = p.cu_tiles[lo + 1] - p.cu_tiles[lo];
  const int m_tile = seq_tiles - 1 - (tile - p.cu_tiles[lo]);
  t.q_start = p.query_start_loc[lo];
  const int q_len = p.query_start_loc[lo + 1] - t.q_start;
  t.ctx_before = p.seq_lens[lo] - q_len;
  t.row0 = m_tile * block_m;
  t.rows = min(block_m, q_len - t.row0);
  return true;
}

}  // namespace voltllm
