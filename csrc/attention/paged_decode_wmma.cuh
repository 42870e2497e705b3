// Paged decode attention: one query token per sequence against its paged KV cache.
//
// GQA-aware: one thread block serves one (sequence, kv head, context split) and all of that kv
// head's query heads at once, so every key/value byte is read from memory exactly once. The query
// heads of the group are the rows of a 16-row tensor-core tile (rows past the group size are zero),
// so QK^T and PV run as WMMA m16n16k16 fp16 products with fp32 accumulation.
//
// Each warp walks its own KV blocks (one 16-token block per step) with its own online softmax; the
// next block's keys/values are loaded into registers while the current one is computed (Volta has
// no cp.async). Warps merge at the end of the split. Long contexts are split over the grid's z
// dimension, each sequence by its own length (decode_split); the splits are merged (log-sum-exp
// weighting) by the last split block to finish (a ticket per sequence and kv head) or by the reduce
// kernel, as the glue chooses. Optionally the layer's attention prologue (q/k RMSNorm, rotary, the newest
// token's KV-cache write) runs inside the kernel (DecodePrologue), saving its launch.
#pragma once

#include "attention/wmma_common.cuh"
#include "attention/paged_decode_common.cuh"
#include "ops/qk_norm_rope.cuh"

namespace voltllm {

// Tile geometry and shared-memory layout of one decode block, in one place.
template <int HEAD>
struct DecodeWmmaTraits {
  static constexpr int kWarps = 4;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kRows = 16;  // query heads per group, padded to the MMA's M
  static constexpr int kLdKV = HEAD + 8;  // padded smem row (halves): spreads rows over banks
  static constexpr int kLdS = 20;         // fp32 score row
  static constexpr int kLdP = 24;         // 16-bit probability row
  static constexpr int kLdO = HEAD + 4;   // fp32 output row when warps merge
  // Registers hold the next block while the current one is computed; at head 256 that would cost
  // 128 more registers on top of the 128 the accumulators take, so it is off there.
  static constexpr bool kPrefetch = HEAD <= 128;
  static constexpr int kChunks = kBlockSize * HEAD / 8 / 32;  // 16-byte chunks per lane per block
  static constexpr int kQBytes = kRows * kLdKV * 2;
  static constexpr int kKVBytes = kBlockSize * kLdKV * 2;  // one of K or V, per warp
  static constexpr int kSBytes = kRows * kLdS * 4;
  static constexpr int kPBytes = kRows * kLdP * 2;
  static constexpr int kWarpBytes = 2 * kKVBytes + kSBytes + kPBytes + kRows * 4;
  static constexpr int kStatBytes = 2 * kWarps * kRows * 4;
  static constexpr int kSmemBytes = kQBytes + kWarps * kWarpBytes + kStatBytes;
  static_assert(HEAD == 64 || HEAD == 128 || HEAD == 256, "head sizes 64, 128, 256");
  static_assert(kRows * kLdO * 4 <= 2 * kKVBytes, "merged output must fit in a warp's K/V area");
  static_assert(kKVBytes % 32 == 0 && kSBytes % 32 == 0 && kPBytes % 32 == 0, "WMMA wants 32B alignment");
  static_assert(kSmemBytes <= 96 * 1024, "Volta allows at most 96 KB of shared memory per block");
};

// The dynamic shared memory each variant launches with, emitted into the PTX so the sm70 gate can
// report it (ptxas only sees static shared memory).
// Only the gate (NVRTC) needs it; the torch build leaves it out.
#ifdef __CUDACC_RTC__
template <int HEAD>
__device__ const int decode_wmma_smem_bytes = DecodeWmmaTraits<HEAD>::kSmemBytes;
#endif

// The folded prologue's query staging: warps take the tile's rows in turn; a row of the group is the
// query head normalised and rotated (norm_rope_head, as ops/qk_norm_rope.cuh does it) and rounded to T,
// the bits the unfused prologue would have left in the qkv projection; rows past the group are zero.
template <typename T, int HEAD>
__device__ __forceinline__ void stage_prologue_query(const DecodePrologue& pro, const T* query, int group,
                                                     const float* cos, bool rotate, T* q_s, int ld, int rows,
                                                     int warps) {
  constexpr int kPerLane = HEAD / 32;
  const int first = (threadIdx.x & 31) * kPerLane;
  for (int r = threadIdx.x >> 5; r < rows; r += warps) {
    float v[kPerLane] = {};
    if (r < group) norm_rope_head<T, HEAD>(query + r * HEAD, static_cast<const T*>(pro.q_weight), pro.eps, cos, rotate, v);
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) q_s[r * ld + first + j] = DType<T>::from_float(v[j]);
  }
}

// The folded prologue's cache write, by one warp: the newest token's key of `kv_head` normalised and
// rotated like the query, and its value as projected, into cache slot `slot`.
template <typename T, int HEAD>
__device__ __forceinline__ void write_newest_kv(const DecodeParams& p, const T* qkv_row, int kv_head, long long slot,
                                                const float* cos, bool rotate) {
  constexpr int kPerLane = HEAD / 32;
  const int first = (threadIdx.x & 31) * kPerLane;
  float k[kPerLane];
  norm_rope_head<T, HEAD>(qkv_row + (p.num_heads + kv_head) * HEAD, static_cast<const T*>(p.prologue.k_weight),
                          p.prologue.eps, cos, rotate, k);
  const T* value = qkv_row + (p.num_heads + p.num_kv_heads + kv_head) * HEAD + first;
  const long long at = (slot * p.num_kv_heads + kv_head) * HEAD + first;
  T* key_dst = static_cast<T*>(p.key_cache) + at;
  T* value_dst = static_cast<T*>(p.value_cache) + at;
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) {
    key_dst[j] = DType<T>::from_float(k[j]);
    value_dst[j] = value[j];
  }
}

// The in-kernel split merge (DecodeParams::merge_tickets), by the last split block of a (sequence, kv head):
// each thread combines 8 dims of one query row over the splits' partials (normalised outputs, maxima and
// sums, log-sum-exp weighted) and stores the result. Partials are read from L2 (__ldcg): other blocks
// wrote them.
template <typename T, int HEAD>
__device__ __forceinline__ void merge_split_rows(const DecodeParams& p, int seq, int first_head, int group,
                                                 int num_splits) {
  constexpr int kThreadsPerRow = HEAD / 8;
  const int rows_per_pass = blockDim.x / kThreadsPerRow;
  const int d0 = (threadIdx.x % kThreadsPerRow) * 8;
  for (int r = threadIdx.x / kThreadsPerRow; r < group; r += rows_per_pass) {
    const int head = first_head + r;
    const long long idx0 = (static_cast<long long>(seq) * p.num_heads + head) * p.max_splits;
    float m = neg_inf(), l = 0.f;
    float o[8] = {};
#pragma unroll 4
    for (int s = 0; s < num_splits; ++s) {
      const float split_max = __ldcg(p.partial_max + idx0 + s);
      const float split_sum = __ldcg(p.partial_sum + idx0 + s);
      const float4* part = reinterpret_cast<const float4*>(p.partial_out + (idx0 + s) * HEAD + d0);
      const float4 lo = __ldcg(part), hi = __ldcg(part + 1);
      const float new_max = fmaxf(m, split_max);
      const float alpha = merge_weight(m, new_max);  // 0 before the first split with tokens
      const float w = split_sum * merge_weight(split_max, new_max);
      l = l * alpha + w;
      o[0] = o[0] * alpha + lo.x * w, o[1] = o[1] * alpha + lo.y * w;
      o[2] = o[2] * alpha + lo.z * w, o[3] = o[3] * alpha + lo.w * w;
      o[4] = o[4] * alpha + hi.x * w, o[5] = o[5] * alpha + hi.y * w;
      o[6] = o[6] * alpha + hi.z * w, o[7] = o[7] * alpha + hi.w * w;
      m = new_max;
    }
    const float inv_l = 1.f / l;
#pragma unroll
    for (int i = 0; i < 8; ++i) o[i] *= inv_l;
    store_floats(static_cast<T*>(p.out) + seq * p.out_stride + head * HEAD + d0, o);
  }
}

template <typename T, int HEAD>
__device__ __forceinline__ void paged_decode_wmma_block(const DecodeParams& p) {
  using Tr = DecodeWmmaTraits<HEAD>;
  using namespace nvcuda;
  using FragA = wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major>;
  using FragBc = wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major>;
  using FragBr = wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major>;
  using FragC = wmma::fragment<wmma::accumulator, 16, 16, 16, float>;
  constexpr int kDTiles = HEAD / 16;
  constexpr int kChunksPerRow = HEAD / 8;

  const int kv_head = blockIdx.x;
  const int seq = blockIdx.y;
  const int split = blockIdx.z;
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  const int group = p.num_heads / p.num_kv_heads;
  const bool fused_prologue = p.prologue.positions != nullptr;

  // Sequence lengths and block tables come from host copies and torch ops, never from a kernel launched
  // as a dependent one, so they are read before waiting for the kernel before this one (see
  // begin_dependent_grid): the length -> block id chain overlaps that kernel's end. Without a sliding
  // window the first split's first block id does not depend on the length, so both are read at once.
  const int* block_table = p.block_tables + static_cast<long long>(seq) * p.max_blocks_per_seq;
  const int guess_id = block_table[min(warp, p.max_blocks_per_seq - 1)];
  const int seq_len = p.seq_lens[seq];
  // With a sliding window the splits cover only the blocks that hold visible positions.
  const int first_pos = p.sliding_window > 0 ? max(0, seq_len - p.sliding_window) : 0;
  const int base = decode_base(seq_len, p.sliding_window);
  const DecodeSplit plan = decode_split(seq_len - base, p.max_splits, p.min_split);
  const int start = base + split * plan.partition;
  if (split >= plan.count) {
    // A split past this sequence's own count has no keys to read; its threads still take their share
    // of the layer's next weights, after the kernel before (whose weights streaming they would slow).
    if (p.l2_prefetch.count != 0) {
      wait_for_previous_grid();
      prefetch_l2_ranges(p.l2_prefetch);
    }
    return;
  }
  const int end = min(start + plan.partition, seq_len);
  const int num_splits = plan.count;
  const int first_block = start / kBlockSize + warp;
  const int last_block = (end - 1) / kBlockSize;  // inclusive
  const int newest_block = (seq_len - 1) / kBlockSize;
  // Block ids are read one step ahead of the K/V they locate, so issuing a block's loads never waits
  // for its block-table entry.
  int next_id = first_block > last_block ? 0 : start == 0 ? guess_id : block_table[first_block];
  int second_id = Tr::kPrefetch && first_block + Tr::kWarps <= last_block ? block_table[first_block + Tr::kWarps] : 0;
  // With the prologue folded in, the split holding the newest position writes that token's K/V itself.
  const bool writes_newest = fused_prologue && end == seq_len;
  long long newest_slot = -1;
  if (writes_newest) {
    newest_slot = p.prologue.slot_mapping[seq];
    if (newest_slot >= p.prologue.num_slots) newest_slot = -1;
  }
  // Positions, like lengths, come from host copies: the rotary table row is located before the wait.
  bool rotate = false;
  const float* cos = nullptr;
  if (fused_prologue) {
    const long long pos = p.prologue.positions[seq];
    rotate = pos >= 0 && pos < p.prologue.max_position;
    cos = p.prologue.cos_sin_cache + (rotate ? pos : 0) * HEAD;
  }

  const long long token_stride = static_cast<long long>(p.num_kv_heads) * HEAD;
  const T* k_cache = static_cast<const T*>(p.key_cache) + kv_head * HEAD;
  const T* v_cache = static_cast<const T*>(p.value_cache) + kv_head * HEAD;
  uint4 k_reg[Tr::kChunks], v_reg[Tr::kChunks];
  auto load_block = [&](int physical_block) {
    const long long block_base = static_cast<long long>(physical_block) * kBlockSize;
#pragma unroll
    for (int i = 0; i < Tr::kChunks; ++i) {
      const int c = lane + 32 * i;
      const long long off = (block_base + c / kChunksPerRow) * token_stride + (c % kChunksPerRow) * 8;
      k_reg[i] = *reinterpret_cast<const uint4*>(k_cache + off);
      v_reg[i] = *reinterpret_cast<const uint4*>(v_cache + off);
    }
  };

  // The kernel just before this one writes at most the newest token's K/V (the op's contract), so a
  // first block that ends before the newest token is loaded before the wait: the stream starts while
  // that kernel finishes. The block holding the newest token, the query and the outputs wait.
  const bool first_loaded = Tr::kPrefetch && first_block <= last_block;
  const bool early = first_loaded && first_block < newest_block;
  if (early) {
    load_block(next_id);
    next_id = second_id;
  }
  begin_dependent_grid();
  prefetch_l2_ranges(p.l2_prefetch);
  VOLTLLM_DYNAMIC_SMEM(smem);
  T* q_s = reinterpret_cast<T*>(smem);  // [16][kLdKV]
  unsigned char* warp_base = smem + Tr::kQBytes + warp * Tr::kWarpBytes;
  T* k_s = reinterpret_cast<T*>(warp_base);                                 // [16][kLdKV]
  T* v_s = reinterpret_cast<T*>(warp_base + Tr::kKVBytes);                  // [16][kLdKV]
  float* s_s = reinterpret_cast<float*>(warp_base + 2 * Tr::kKVBytes);      // [16][kLdS]
  T* p_s = reinterpret_cast<T*>(warp_base + 2 * Tr::kKVBytes + Tr::kSBytes);  // [16][kLdP]
  float* alpha_s = reinterpret_cast<float*>(warp_base + 2 * Tr::kKVBytes + Tr::kSBytes + Tr::kPBytes);
  float* stat_max = reinterpret_cast<float*>(smem + Tr::kQBytes + Tr::kWarps * Tr::kWarpBytes);
  float* stat_sum = stat_max + Tr::kWarps * Tr::kRows;

  // Otherwise the first block's loads are issued before the query is staged, so the two latencies overlap;
  // but not where this block writes the newest token into that first block: then they wait for the write.
  if (first_loaded && !early && !writes_newest) {
    load_block(next_id);
    next_id = second_id;
  }
  // Query rows of this group; rows past the group stay zero so their scores are finite.
  const T* query = static_cast<const T*>(p.query) + seq * p.query_stride + kv_head * group * HEAD;
  if (fused_prologue) {
    stage_prologue_query<T, HEAD>(p.prologue, query, group, cos, rotate, q_s, Tr::kLdKV, Tr::kRows, Tr::kWarps);
    // The warp with the fewest query rows (the last) writes the newest token's K/V.
    if (newest_slot >= 0 && warp == Tr::kWarps - 1) {
      write_newest_kv<T, HEAD>(p, static_cast<const T*>(p.query) + seq * p.query_stride, kv_head, newest_slot, cos,
                               rotate);
    }
  } else {
    for (int c = threadIdx.x; c < Tr::kRows * kChunksPerRow; c += Tr::kThreads) {
      const int r = c / kChunksPerRow, col = (c % kChunksPerRow) * 8;
      uint4 v = make_uint4(0, 0, 0, 0);
      if (r < group) v = *reinterpret_cast<const uint4*>(query + r * HEAD + col);
      *reinterpret_cast<uint4*>(q_s + r * Tr::kLdKV + col) = v;
    }
  }

  int acc_rows[FragC::num_elements];
  fragment_rows<FragC>(s_s, Tr::kLdS, acc_rows);

  FragC o_acc[kDTiles];
#pragma unroll
  for (int j = 0; j < kDTiles; ++j) wmma::fill_fragment(o_acc[j], 0.f);
  // Lanes 2r and 2r+1 own row r's softmax state: each handles 8 of the block's 16 columns.
  const int my_row = lane >> 1;
  const int my_col = (lane & 1) * 8;
  float row_max = neg_inf();
  float row_sum = 0.f;

  __syncthreads();  // q_s complete, and the newest token's K/V in the cache (visible to the whole block)
  if (first_loaded && !early && writes_newest) {
    load_block(next_id);
    next_id = second_id;
  }

  for (int b = first_block; b <= last_block; b += Tr::kWarps) {
    if (!Tr::kPrefetch) {
      load_block(next_id);
      next_id = b + Tr::kWarps <= last_block ? block_table[b + Tr::kWarps] : 0;
    }
#pragma unroll
    for (int i = 0; i < Tr::kChunks; ++i) {
      const int c = lane + 32 * i;
      const int off = (c / kChunksPerRow) * Tr::kLdKV + (c % kChunksPerRow) * 8;
      // Slots past the sequence's end may hold anything (even NaN): their probabilities are 0, but
      // 0 * NaN is not, so their values are replaced by zeros. (Their scores are masked by select.)
      const bool live = b * kBlockSize + c / kChunksPerRow < seq_len;
      *reinterpret_cast<uint4*>(k_s + off) = k_reg[i];
      *reinterpret_cast<uint4*>(v_s + off) = live ? v_reg[i] : make_uint4(0, 0, 0, 0);
    }
    __syncwarp();
    if (Tr::kPrefetch && b + Tr::kWarps <= last_block) {
      load_block(next_id);
      next_id = b + 2 * Tr::kWarps <= last_block ? block_table[b + 2 * Tr::kWarps] : 0;
    }

    // S = Q K^T over this block's 16 tokens.
    FragC s_acc;
    wmma::fill_fragment(s_acc, 0.f);
#pragma unroll
    for (int k = 0; k < kDTiles; ++k) {
      FragA a;
      FragBc bk;
      wmma::load_matrix_sync(a, q_s + k * 16, Tr::kLdKV);
      wmma::load_matrix_sync(bk, k_s + k * 16, Tr::kLdKV);
      wmma::mma_sync(s_acc, a, bk, s_acc);
    }
    wmma::store_matrix_sync(s_s, s_acc, Tr::kLdS, wmma::mem_row_major);
    __syncwarp();

    // Online softmax over the 16 columns of each row (two lanes per row).
    float s[8];
    float block_max = neg_inf();
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int pos = b * kBlockSize + my_col + i;
      const bool visible = pos >= first_pos && pos >= start && pos < end;
      s[i] = visible ? s_s[my_row * Tr::kLdS + my_col + i] * p.scale_log2 : neg_inf();
      block_max = fmaxf(block_max, s[i]);
    }
    block_max = fmaxf(block_max, __shfl_xor_sync(0xffffffffu, block_max, 1));
    const float new_max = fmaxf(row_max, block_max);
    const float ref = new_max == neg_inf() ? 0.f : new_max;  // a fully masked row stays all-zero
    float block_sum = 0.f;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const float e = fast_exp2(s[i] - ref);
      block_sum += e;
      p_s[my_row * Tr::kLdP + my_col + i] = DType<T>::from_float(e);
    }
    block_sum += __shfl_xor_sync(0xffffffffu, block_sum, 1);
    const float alpha = fast_exp2(row_max - ref);
    row_sum = row_sum * alpha + block_sum;
    row_max = new_max;
    if ((lane & 1) == 0) alpha_s[my_row] = alpha;
    __syncwarp();

    // O = O * alpha + P V.
    // All accumulator fragments share one element order: look each element's row factor up once.
    float alpha_el[FragC::num_elements];
#pragma unroll
    for (int i = 0; i < FragC::num_elements; ++i) alpha_el[i] = alpha_s[acc_rows[i]];
    FragA pa;
    wmma::load_matrix_sync(pa, p_s, Tr::kLdP);
#pragma unroll
    for (int j = 0; j < kDTiles; ++j) {
#pragma unroll
      for (int i = 0; i < FragC::num_elements; ++i) o_acc[j].x[i] *= alpha_el[i];
      FragBr bv;
      wmma::load_matrix_sync(bv, v_s + j * 16, Tr::kLdKV);
      wmma::mma_sync(o_acc[j], pa, bv, o_acc[j]);
    }
    __syncwarp();  // k_s/v_s/p_s are overwritten next step
  }

  // Merge the warps: each parks its unnormalised output (in its K/V area) and its row statistics.
  if ((lane & 1) == 0) {
    stat_max[warp * Tr::kRows + my_row] = row_max;
    stat_sum[warp * Tr::kRows + my_row] = row_sum;
  }
  float* o_s = reinterpret_cast<float*>(warp_base);  // [16][kLdO]
#pragma unroll
  for (int j = 0; j < kDTiles; ++j) wmma::store_matrix_sync(o_s + j * 16, o_acc[j], Tr::kLdO, wmma::mem_row_major);
  __syncthreads();

  // Each thread merges 8 consecutive dims of one row: the row's warp weights are computed once, the
  // parked outputs are read as 16-byte vectors, and the results leave as 16-byte stores, so the tail
  // after the slowest warp is a few dependent steps, not a loop over every element.
  constexpr int kThreadsPerRow = HEAD / 8;
  constexpr int kRowsPerPass = Tr::kThreads / kThreadsPerRow;
  const int d0 = (threadIdx.x % kThreadsPerRow) * 8;
  const long long head0 = static_cast<long long>(seq) * p.num_heads + kv_head * group;
  for (int r = threadIdx.x / kThreadsPerRow; r < group; r += kRowsPerPass) {
    float m = neg_inf();
#pragma unroll
    for (int w = 0; w < Tr::kWarps; ++w) m = fmaxf(m, stat_max[w * Tr::kRows + r]);
    float l = 0.f;
    float o[8] = {};
#pragma unroll
    for (int w = 0; w < Tr::kWarps; ++w) {
      const float wm = stat_max[w * Tr::kRows + r];
      const float scale = merge_weight(wm, m);  // warps with no tokens add nothing
      l += stat_sum[w * Tr::kRows + r] * scale;
      const float* parked = reinterpret_cast<const float*>(smem + Tr::kQBytes + w * Tr::kWarpBytes) + r * Tr::kLdO + d0;
      const float4 lo = *reinterpret_cast<const float4*>(parked);
      const float4 hi = *reinterpret_cast<const float4*>(parked + 4);
      o[0] += lo.x * scale, o[1] += lo.y * scale, o[2] += lo.z * scale, o[3] += lo.w * scale;
      o[4] += hi.x * scale, o[5] += hi.y * scale, o[6] += hi.z * scale, o[7] += hi.w * scale;
    }
    const float inv_l = 1.f / l;
#pragma unroll
    for (int i = 0; i < 8; ++i) o[i] *= inv_l;
    if (num_splits == 1) {
      store_floats(static_cast<T*>(p.out) + seq * p.out_stride + (kv_head * group + r) * HEAD + d0, o);
    } else {
      const long long idx = (head0 + r) * p.max_splits + split;
      float4* dst = reinterpret_cast<float4*>(p.partial_out + idx * HEAD + d0);
      dst[0] = make_float4(o[0], o[1], o[2], o[3]);
      dst[1] = make_float4(o[4], o[5], o[6], o[7]);
      if (d0 == 0) {
        p.partial_max[idx] = m;
        p.partial_sum[idx] = l;
      }
    }
  }
  if (num_splits == 1 || p.merge_tickets == nullptr) return;

  // The last split block of this (sequence, kv head) to finish merges every split's partials: no merge
  // launch, which at short contexts costs more than the merge itself. The fence makes this block's
  // partials visible to whichever block turns out to be last before its ticket is counted.
  __threadfence();
  __syncthreads();  // every thread's partials fenced; the row statistics are no longer read
  int* last_flag = reinterpret_cast<int*>(stat_max);
  if (threadIdx.x == 0) {
    int* ticket = p.merge_tickets + static_cast<long long>(seq) * p.num_kv_heads + kv_head;
    const bool last = atomicAdd(ticket, 1) == num_splits - 1;
    if (last) atomicExch(ticket, 0);  // every other split has counted: ready for the next launch
    *last_flag = last;
  }
  __syncthreads();
  if (!*last_flag) return;
  __threadfence();
  merge_split_rows<T, HEAD>(p, seq, kv_head * group, group, num_splits);
}

// grid: (num_kv_heads, num_seqs, max_splits), block: DecodeWmmaTraits::kThreads,
// dynamic shared memory: DecodeWmmaTraits::kSmemBytes.
template <typename T, int HEAD>
__global__ void __launch_bounds__(DecodeWmmaTraits<HEAD>::kThreads)
    paged_decode_wmma_kernel(DecodeParams p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  // bf16 tensor-core math exists from SM80 on; the host wrapper never launches this variant there.
  if constexpr (is_same<T, __nv_bfloat16>::value) {
    __trap();
  } else
#endif
  {
    paged_decode_wmma_block<T, HEAD>(p);
  }
}

// Split-merge geometry: a block of up to kReduceMaxGroups warps merges kReduceDims output dims of one head
// (one warp-wide coalesced row of each split's partial); its warps take the splits in turn, each lane
// loading kReduceBatch splits' outputs at once while the splits' max and sum come one per lane and travel
// by shuffle, so the 64 splits of 1 x 32k on the H200 are one L2 round trip. At 128 threads and 40
// registers a block fits beside two attention blocks on an SM: the merge is resident while the attention
// kernel runs, and (SM90) lets the kernel after it be scheduled as attention blocks finish.
constexpr int kReduceDims = 32;
constexpr int kReduceMaxGroups = 4;
constexpr int kReduceBatch = 16;  // splits a warp loads at once: at most 32 (one split's stats per lane)
constexpr int kReduceThreads = kReduceDims * kReduceMaxGroups;
// Per group: its running max, its sum, and its kReduceDims outputs (dynamic shared memory, floats).
constexpr int kReduceSmemBytes = kReduceMaxGroups * (2 + kReduceDims) * 4;

#ifdef __CUDACC_RTC__
__device__ const int decode_reduce_smem_bytes = kReduceSmemBytes;  // for the sm70 gate's report
#endif

// Warps per reduce block for `splits` splits.
__host__ __device__ constexpr int reduce_groups(long long splits) {
  return splits < kReduceMaxGroups ? static_cast<int>(splits) : kReduceMaxGroups;
}

// Merges the splits of sequences whose context was split. grid: (num_heads, num_seqs, HEAD / kReduceDims),
// block: kReduceDims * reduce_groups(max_splits), dynamic shared memory: kReduceSmemBytes.
// The merge lets its dependent be scheduled at once (see begin_dependent_grid): the slots attention
// blocks leave are then taken by the next kernel, whose early loads overlap attention's last blocks.
template <typename T, int HEAD>
__global__ void __launch_bounds__(kReduceThreads) paged_decode_reduce_kernel(DecodeParams p) {
  static_assert(HEAD % kReduceDims == 0, "whole warps of dims");
  static_assert(kReduceBatch <= 32, "one split's statistics per lane");
  launch_dependent_grids();
  VOLTLLM_DYNAMIC_SMEM(smem);
  float* group_max = reinterpret_cast<float*>(smem);  // [groups]
  float* group_sum = group_max + kReduceMaxGroups;     // [groups]
  float* group_out = group_sum + kReduceMaxGroups;     // [groups][kReduceDims]
  const int head = blockIdx.x;
  const int seq = blockIdx.y;
  const int seq_len = p.seq_lens[seq];  // read before the wait, as in the attention kernel
  const int num_splits = decode_split(seq_len - decode_base(seq_len, p.sliding_window), p.max_splits, p.min_split).count;
  // Every block waits, even one with nothing to merge, so the merge never completes before the
  // attention kernel: the kernels after it may rely on both being done.
  wait_for_previous_grid();
  if (num_splits <= 1) return;  // the attention kernel wrote the output directly
  const long long idx0 = (static_cast<long long>(seq) * p.num_heads + head) * p.max_splits;
  const int groups = blockDim.x / kReduceDims;
  const int lane = threadIdx.x % kReduceDims;
  const int g = threadIdx.x / kReduceDims;
  const int d = blockIdx.z * kReduceDims + lane;
  const float* partial = p.partial_out + idx0 * HEAD + d;

  float m = neg_inf(), l = 0.f, o = 0.f;
  for (int s0 = g; s0 < num_splits; s0 += groups * kReduceBatch) {
    // Lane i (mod kReduceBatch) holds split s0 + i * groups's max and sum.
    const int my_split = s0 + (lane % kReduceBatch) * groups;
    const bool mine = my_split < num_splits;
    const float split_max = mine ? p.partial_max[idx0 + my_split] : neg_inf();
    const float split_sum = mine ? p.partial_sum[idx0 + my_split] : 0.f;
    float split_out[kReduceBatch];
#pragma unroll
    for (int i = 0; i < kReduceBatch; ++i) {
      const int s = s0 + i * groups;
      split_out[i] = s < num_splits ? partial[static_cast<long long>(s) * HEAD] : 0.f;
    }
    const float new_max = warp_max(fmaxf(m, split_max));
    const float alpha = fast_exp2(m - new_max);  // m = -inf on the first batch: 0
    // Partials are normalised by their own sums; a missing split (max -inf, sum 0) weighs 0.
    const float weight = mine ? split_sum * fast_exp2(split_max - new_max) : 0.f;
    l *= alpha;
    o *= alpha;
#pragma unroll
    for (int i = 0; i < kReduceBatch; ++i) {
      const float w = __shfl_sync(0xffffffffu, weight, i);
      l += w;
      o += split_out[i] * w;
    }
    m = new_max;
  }
  if (lane == 0) {
    group_max[g] = m;
    group_sum[g] = l;
  }
  group_out[g * kReduceDims + lane] = o;
  __syncthreads();
  if (g != 0) return;
  // Unrolled over the most groups a block has, so every shared-memory read is issued at once rather
  // than one dependent read per group; entries past `groups` weigh 0.
  float gm[kReduceMaxGroups];
  float total_max = neg_inf();
#pragma unroll
  for (int k = 0; k < kReduceMaxGroups; ++k) {
    gm[k] = k < groups ? group_max[k] : neg_inf();
    total_max = fmaxf(total_max, gm[k]);
  }
  float total_sum = 0.f, total_out = 0.f;
#pragma unroll
  for (int k = 0; k < kReduceMaxGroups; ++k) {
    if (k < groups) {
      const float w = merge_weight(gm[k], total_max);  // idle groups add nothing
      total_sum += group_sum[k] * w;
      total_out += group_out[k * kReduceDims + lane] * w;
    }
  }
  T* out = static_cast<T*>(p.out) + seq * p.out_stride + head * HEAD;
  out[d] = DType<T>::from_float(total_out / total_sum);
}

}  // namespace voltllm
