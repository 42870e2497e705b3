// Prefill / chunked-prefill flash attention over the paged KV cache, on tensor cores.
//
// Every query token attends causally to its sequence's whole context: the cached prefix (prefix
// cache hits, earlier chunks) and this step's tokens. The step's keys/values are written into the
// cache first (kv_cache.cuh), so all of the context is read from one place, through the block table.
//
// One thread block computes BLOCK_M query rows of one head; each warp owns 16 rows. Key/value tiles
// of BLOCK_N tokens are staged in shared memory (next tile prefetched into registers: Volta has no
// cp.async); S = QK^T and O += PV are WMMA m16n16k16 products with fp32 accumulation. Scores pass
// through a warp-private shared-memory tile for the online softmax (fragment layouts are opaque).
#pragma once

#include "attention_common.cuh"

namespace voltllm {

struct PrefillParams {
  void* out;                    // [num_tokens, num_heads, head_size], rows out_stride apart
  const void* query;            // [num_tokens, num_heads, head_size], rows query_stride apart
  const void* key_cache;        // [num_blocks, block_size, num_kv_heads, head_size]
  const void* value_cache;      // [num_blocks, block_size, num_kv_heads, head_size]
  const int* block_tables;      // [num_seqs, max_blocks_per_seq]
  const int* seq_lens;          // [num_seqs] context length after this step
  const int* query_start_loc;   // [num_seqs + 1] first query row of each sequence
  const int* cu_tiles;          // [num_seqs + 1] first BLOCK_M tile of each sequence (prefix sum)
  long long query_stride;       // elements between tokens of query
  long long out_stride;         // elements between tokens of out
  int num_seqs;                 // sequences in the batch
  int num_heads;                // query heads
  int num_kv_heads;             // kv heads (num_heads is a multiple)
  int max_blocks_per_seq;       // row length of block_tables
  int sliding_window;           // attend to the last `sliding_window` positions; 0 = unlimited
  float scale_log2;             // softmax scale * log2(e)
};

template <int HEAD>
struct PrefillTraits {
  static constexpr int kBlockM = 64;                   // query rows per thread block
  static constexpr int kBlockN = HEAD == 256 ? 32 : 64;  // keys per tile: keeps head 256 under 96 KB
  static constexpr int kWarps = kBlockM / 16;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kLdQKV = HEAD + 8;  // padded 16-bit rows
  static constexpr int kLdS = kBlockN + 4;  // fp32 score rows
  static constexpr int kLdP = kBlockN + 8;  // 16-bit probability rows
  static constexpr bool kPrefetch = HEAD <= 128;  // see DecodeTraits: registers run out at 256
  static constexpr int kChunks = kBlockN * HEAD / 8 / kThreads;  // 16-byte chunks per thread per tile
  static constexpr int kQBytes = kBlockM * kLdQKV * 2;
  static constexpr int kKVBytes = kBlockN * kLdQKV * 2;
  static constexpr int kSBytes = 16 * kLdS * 4;  // per warp
  static constexpr int kPBytes = 16 * kLdP * 2;  // per warp
  static constexpr int kSmemBytes = kQBytes + 2 * kKVBytes + kWarps * (kSBytes + kPBytes + 16 * 4);
  static_assert(HEAD == 64 || HEAD == 128 || HEAD == 256, "head sizes 64, 128, 256");
  static_assert(kBlockN % kBlockSize == 0, "a key tile is whole cache blocks");
  static_assert(kChunks * kThreads * 8 == kBlockN * HEAD, "tile loads divide evenly");
  static_assert(kSBytes % 32 == 0 && kPBytes % 32 == 0 && kKVBytes % 32 == 0, "WMMA wants 32B alignment");
  static_assert(kSmemBytes <= 96 * 1024, "Volta allows at most 96 KB of shared memory per block");
};

// The dynamic shared memory each variant launches with, emitted into the PTX for the sm70 gate.
// Only the gate (NVRTC) needs it; the torch build leaves it out.
#ifdef __CUDACC_RTC__
template <int HEAD>
__device__ const int prefill_smem_bytes = PrefillTraits<HEAD>::kSmemBytes;
#endif

// Writes cu_tiles[i] = sum over earlier sequences of ceil(query_len / BLOCK_M). One warp; runs once
// per step and layer, over at most a few thousand sequences.
__global__ void prefill_tile_map_kernel(const int* query_start_loc, int* cu_tiles, int num_seqs, int block_m) {
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

template <typename T, int HEAD>
__device__ __forceinline__ void paged_prefill_attention_block(const PrefillParams& p) {
  using Tr = PrefillTraits<HEAD>;
  using namespace nvcuda;
  using FragA = wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major>;
  using FragBc = wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major>;
  using FragBr = wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major>;
  using FragC = wmma::fragment<wmma::accumulator, 16, 16, 16, float>;
  constexpr int kDTiles = HEAD / 16;
  constexpr int kNTiles = Tr::kBlockN / 16;
  constexpr int kChunksPerRow = HEAD / 8;
  constexpr int kColsPerLane = Tr::kBlockN / 2;

  // Which sequence and which of its row tiles: binary search in the tile prefix sum.
  const int tile = blockIdx.x;
  if (tile >= p.cu_tiles[p.num_seqs]) return;  // the grid may over-count tiles
  int lo = 0, hi = p.num_seqs - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (p.cu_tiles[mid] <= tile) lo = mid; else hi = mid - 1;
  }
  const int seq = lo;
  const int seq_tiles = p.cu_tiles[seq + 1] - p.cu_tiles[seq];
  // Later row tiles see more keys; launching them first shortens the tail of the grid.
  const int m_tile = seq_tiles - 1 - (tile - p.cu_tiles[seq]);
  const int head = blockIdx.y;
  const int kv_head = head / (p.num_heads / p.num_kv_heads);
  const int q_start = p.query_start_loc[seq];
  const int q_len = p.query_start_loc[seq + 1] - q_start;
  const int seq_len = p.seq_lens[seq];
  const int ctx_before = seq_len - q_len;  // cached positions in front of this step's tokens
  const int row0 = m_tile * Tr::kBlockM;
  const int rows = min(Tr::kBlockM, q_len - row0);

  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;

  extern __shared__ __align__(128) unsigned char smem[];
  T* q_s = reinterpret_cast<T*>(smem);                                   // [kBlockM][kLdQKV]
  T* k_s = reinterpret_cast<T*>(smem + Tr::kQBytes);                     // [kBlockN][kLdQKV]
  T* v_s = reinterpret_cast<T*>(smem + Tr::kQBytes + Tr::kKVBytes);      // [kBlockN][kLdQKV]
  unsigned char* warp_base = smem + Tr::kQBytes + 2 * Tr::kKVBytes + warp * (Tr::kSBytes + Tr::kPBytes + 64);
  float* s_s = reinterpret_cast<float*>(warp_base);                      // [16][kLdS]
  T* p_s = reinterpret_cast<T*>(warp_base + Tr::kSBytes);                // [16][kLdP]
  float* alpha_s = reinterpret_cast<float*>(warp_base + Tr::kSBytes + Tr::kPBytes);  // [16]

  const T* query = static_cast<const T*>(p.query) + (q_start + row0) * p.query_stride + head * HEAD;
  for (int c = threadIdx.x; c < Tr::kBlockM * kChunksPerRow; c += Tr::kThreads) {
    const int r = c / kChunksPerRow, col = (c % kChunksPerRow) * 8;
    // Q is pre-scaled by softmax_scale * log2(e), so scores come out of the MMA in log2 units.
    float v[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    if (r < rows) load_floats(query + r * p.query_stride + col, v);
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] *= p.scale_log2;
    store_floats(q_s + r * Tr::kLdQKV + col, v);
  }
  int acc_rows[FragC::num_elements];
  fragment_rows<FragC>(s_s, Tr::kLdS, acc_rows);

  // Key range of the whole block: up to the last row's position, from the first row's window start.
  const int last_pos = ctx_before + row0 + rows - 1;
  const int kv_end = last_pos + 1;
  int kv_begin = 0;
  if (p.sliding_window > 0) kv_begin = max(0, ctx_before + row0 - p.sliding_window + 1);
  kv_begin = (kv_begin / Tr::kBlockN) * Tr::kBlockN;

  // This warp's rows. Rows past the sequence reuse the last row's position, so they stay finite
  // (they are never stored).
  const int my_row = lane >> 1;
  const int my_col = (lane & 1) * kColsPerLane;
  const int my_pos = ctx_before + row0 + min(warp * 16 + my_row, rows - 1);
  const int warp_min_pos = ctx_before + row0 + min(warp * 16, rows - 1);
  const int warp_max_pos = ctx_before + row0 + min(warp * 16 + 15, rows - 1);
  const bool warp_active = warp * 16 < rows;

  const long long token_stride = static_cast<long long>(p.num_kv_heads) * HEAD;
  const T* k_cache = static_cast<const T*>(p.key_cache) + kv_head * HEAD;
  const T* v_cache = static_cast<const T*>(p.value_cache) + kv_head * HEAD;
  const int* block_table = p.block_tables + static_cast<long long>(seq) * p.max_blocks_per_seq;

  uint4 k_reg[Tr::kChunks], v_reg[Tr::kChunks];
  // All block-table reads of a tile are issued before any K/V read, so the tile costs one dependent
  // memory round trip, not one per chunk. Positions past the context are clamped to the last valid
  // token: those rows are masked out, and reading real (finite) data keeps 0 * V finite.
  auto load_tile = [&](int tile_start) {
    long long slot[Tr::kChunks];
#pragma unroll
    for (int i = 0; i < Tr::kChunks; ++i) {
      const int c = threadIdx.x + Tr::kThreads * i;
      const int pos = min(tile_start + c / kChunksPerRow, kv_end - 1);
      slot[i] = static_cast<long long>(block_table[pos / kBlockSize]) * kBlockSize + pos % kBlockSize;
    }
#pragma unroll
    for (int i = 0; i < Tr::kChunks; ++i) {
      const int c = threadIdx.x + Tr::kThreads * i;
      const long long off = slot[i] * token_stride + (c % kChunksPerRow) * 8;
      k_reg[i] = *reinterpret_cast<const uint4*>(k_cache + off);
      v_reg[i] = *reinterpret_cast<const uint4*>(v_cache + off);
    }
  };

  FragC o_acc[kDTiles];
#pragma unroll
  for (int j = 0; j < kDTiles; ++j) wmma::fill_fragment(o_acc[j], 0.f);
  float row_max = neg_inf();
  float row_sum = 0.f;

  if (Tr::kPrefetch) load_tile(kv_begin);
  for (int tile_start = kv_begin; tile_start < kv_end; tile_start += Tr::kBlockN) {
    if (!Tr::kPrefetch) load_tile(tile_start);
    __syncthreads();  // everyone is done reading the previous tile
#pragma unroll
    for (int i = 0; i < Tr::kChunks; ++i) {
      const int c = threadIdx.x + Tr::kThreads * i;
      const int off = (c / kChunksPerRow) * Tr::kLdQKV + (c % kChunksPerRow) * 8;
      *reinterpret_cast<uint4*>(k_s + off) = k_reg[i];
      *reinterpret_cast<uint4*>(v_s + off) = v_reg[i];
    }
    __syncthreads();
    if (Tr::kPrefetch && tile_start + Tr::kBlockN < kv_end) load_tile(tile_start + Tr::kBlockN);

    // Skip tiles that are wholly in this warp's causal future or before its window.
    const bool in_future = tile_start > warp_max_pos;
    const bool in_past = p.sliding_window > 0 && tile_start + Tr::kBlockN - 1 <= warp_min_pos - p.sliding_window;
    if (!warp_active || in_future || in_past) continue;

    // S = Q K^T for this warp's 16 rows: each Q fragment is loaded once and used for every key tile.
    {
      FragC s_acc[kNTiles];
#pragma unroll
      for (int n = 0; n < kNTiles; ++n) wmma::fill_fragment(s_acc[n], 0.f);
#pragma unroll 2
      for (int k = 0; k < kDTiles; ++k) {
        FragA a;
        wmma::load_matrix_sync(a, q_s + warp * 16 * Tr::kLdQKV + k * 16, Tr::kLdQKV);
#pragma unroll
        for (int n = 0; n < kNTiles; ++n) {
          FragBc bk;
          wmma::load_matrix_sync(bk, k_s + n * 16 * Tr::kLdQKV + k * 16, Tr::kLdQKV);
          wmma::mma_sync(s_acc[n], a, bk, s_acc[n]);
        }
      }
#pragma unroll
      for (int n = 0; n < kNTiles; ++n) wmma::store_matrix_sync(s_s + n * 16, s_acc[n], Tr::kLdS, wmma::mem_row_major);
    }
    __syncwarp();

    // Online softmax, two lanes per row. Scores are read twice (max, then exp) instead of being
    // held in registers, which the output accumulators need. Masks are only evaluated on tiles
    // that cross this warp's diagonal or window edge (a warp-uniform test).
    const int window_lo = p.sliding_window > 0 ? my_pos - p.sliding_window + 1 : 0;
    const bool need_mask = tile_start + Tr::kBlockN - 1 > warp_min_pos ||
                           (p.sliding_window > 0 && tile_start < warp_max_pos - p.sliding_window + 1);
    const float4* s_vec = reinterpret_cast<const float4*>(s_s + my_row * Tr::kLdS + my_col);
    const int first_key = tile_start + my_col;
    auto scores4 = [&](int i) {
      float4 v = s_vec[i];
      if (need_mask) {
        const int k = first_key + 4 * i;
        v.x = (k <= my_pos && k >= window_lo) ? v.x : neg_inf();
        v.y = (k + 1 <= my_pos && k + 1 >= window_lo) ? v.y : neg_inf();
        v.z = (k + 2 <= my_pos && k + 2 >= window_lo) ? v.z : neg_inf();
        v.w = (k + 3 <= my_pos && k + 3 >= window_lo) ? v.w : neg_inf();
      }
      return v;
    };
    float tile_max = neg_inf();
#pragma unroll
    for (int i = 0; i < kColsPerLane / 4; ++i) {
      const float4 v = scores4(i);
      tile_max = fmaxf(tile_max, fmaxf(fmaxf(v.x, v.y), fmaxf(v.z, v.w)));
    }
    tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
    const float new_max = fmaxf(row_max, tile_max);
    const float ref = new_max == neg_inf() ? 0.f : new_max;
    float tile_sum = 0.f;
    using T2 = typename DType<T>::T2;
#pragma unroll
    for (int i = 0; i < kColsPerLane / 4; ++i) {
      const float4 v = scores4(i);
      const float e0 = fast_exp2(v.x - ref), e1 = fast_exp2(v.y - ref), e2 = fast_exp2(v.z - ref), e3 = fast_exp2(v.w - ref);
      tile_sum += (e0 + e1) + (e2 + e3);
      T2* dst = reinterpret_cast<T2*>(p_s + my_row * Tr::kLdP + my_col + 4 * i);
      dst[0] = DType<T>::from_float2(make_float2(e0, e1));
      dst[1] = DType<T>::from_float2(make_float2(e2, e3));
    }
    tile_sum += __shfl_xor_sync(0xffffffffu, tile_sum, 1);
    const float alpha = fast_exp2(row_max - ref);
    row_sum = row_sum * alpha + tile_sum;
    row_max = new_max;
    if ((lane & 1) == 0) alpha_s[my_row] = alpha;
    __syncwarp();

    // O = O * alpha + P V.
    // All accumulator fragments share one element order: look each element's row factor up once.
    float alpha_el[FragC::num_elements];
#pragma unroll
    for (int i = 0; i < FragC::num_elements; ++i) alpha_el[i] = alpha_s[acc_rows[i]];
    // Once the running maxima settle, every factor is exactly 1: skip the rescale then.
    if (!__all_sync(0xffffffffu, alpha == 1.f)) {
#pragma unroll
      for (int j = 0; j < kDTiles; ++j) {
#pragma unroll
        for (int i = 0; i < FragC::num_elements; ++i) o_acc[j].x[i] *= alpha_el[i];
      }
    }
#pragma unroll 1  // one P fragment live at a time: the accumulators own the register file
    for (int n = 0; n < kNTiles; ++n) {
      FragA pa;
      wmma::load_matrix_sync(pa, p_s + n * 16, Tr::kLdP);
#pragma unroll
      for (int j = 0; j < kDTiles; ++j) {
        FragBr bv;
        wmma::load_matrix_sync(bv, v_s + n * 16 * Tr::kLdQKV + j * 16, Tr::kLdQKV);
        wmma::mma_sync(o_acc[j], pa, bv, o_acc[j]);
      }
    }
    __syncwarp();
  }

  if (!warp_active) return;  // no barrier follows
  // Normalise rows, then write each 16x16 output tile through the warp's score area.
  if ((lane & 1) == 0) alpha_s[my_row] = 1.f / row_sum;
  __syncwarp();
  T* out = static_cast<T*>(p.out) + (q_start + row0 + warp * 16) * p.out_stride + head * HEAD;
  const int out_rows = min(16, rows - warp * 16);
  float inv_sum_el[FragC::num_elements];
#pragma unroll
  for (int i = 0; i < FragC::num_elements; ++i) inv_sum_el[i] = alpha_s[acc_rows[i]];
#pragma unroll
  for (int j = 0; j < kDTiles; ++j) {
#pragma unroll
    for (int i = 0; i < FragC::num_elements; ++i) o_acc[j].x[i] *= inv_sum_el[i];
    wmma::store_matrix_sync(s_s, o_acc[j], Tr::kLdS, wmma::mem_row_major);
    __syncwarp();
    const int r = lane >> 1, c = (lane & 1) * 8;
    if (r < out_rows) {
      float v[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) v[i] = s_s[r * Tr::kLdS + c + i];
      store_floats(out + r * p.out_stride + j * 16 + c, v);
    }
    __syncwarp();
  }
}

// grid: (total row tiles = cu_tiles[num_seqs], num_heads), block: PrefillTraits::kThreads,
// dynamic shared memory: PrefillTraits::kSmemBytes.
template <typename T, int HEAD>
__global__ void __launch_bounds__(PrefillTraits<HEAD>::kThreads)
    paged_prefill_attention_kernel(PrefillParams p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  // bf16 tensor-core math exists from SM80 on; the host wrapper never launches this variant there.
  if constexpr (is_same<T, __nv_bfloat16>::value) {
    __trap();
  } else
#endif
  {
    paged_prefill_attention_block<T, HEAD>(p);
  }
}

}  // namespace voltllm
