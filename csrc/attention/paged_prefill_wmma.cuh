// Prefill / chunked-prefill flash attention over the paged KV cache on WMMA: Volta-legal (WMMA m16n16k16
// for every product, no cp.async / ldmatrix / mma.sync, <= 96 KB of shared memory); the inputs and
// row-tile lookup it shares with the SM80+ kernel (paged_prefill_mma_sm80.cuh) are in
// paged_prefill_common.cuh. Against the first WMMA prefill kernel (BLOCK_M 64, scores through shared
// memory; retired, see docs/kernels.md):
//  * BLOCK_M 128 with 8 warps at head <= 128 (64 / 4 warps at head 256): each K/V tile staged in shared
//    memory serves 128 query rows, and each warp's Q fragments stay in registers for the block.
//  * The online softmax runs on the S accumulators in registers. WMMA's accumulator element order is
//    unspecified but fixed, so the block reads it once at start-up (a fragment loaded from a tile whose
//    every element is its own (row, col) code) and relies on nothing else about it: per element its row
//    and column come from that map; row maxima and sums are reduced within each lane over the tile's
//    column blocks, then across lanes through one 16x16 fp32 scratch tile per warp (two lanes finish each
//    row and publish its statistics). Only P (16-bit) goes through shared memory, because the matrix_a
//    order differs from the accumulator's in general.
//  * Per-element running sums: each accumulator element keeps the partial row sum of its own columns;
//    the sums are reduced across lanes once, at the end.
//  * K/V tiles double-buffered in shared memory and fed by a register prefetch (Volta has no cp.async):
//    tile t+1's K is loaded into registers during tile t's S = Q K^T and its V during the softmax and
//    O += P V, each then stored into the other buffer, so one barrier per tile suffices and only one
//    half-tile of registers is ever in flight.
//  * The softmax scale is applied in the exponent (one FFMA per score), not to Q in 16 bits.
#pragma once

#include <mma.h>

#include "attention/paged_prefill_common.cuh"

namespace voltllm {

template <int HEAD>
struct PrefillWmmaTraits {
  // Head 256's output accumulators alone take 128 registers per lane: its Q stays in shared memory, and
  // the smaller key tile keeps Q plus two K/V stages under Volta's 96 KB.
  static constexpr bool kQInRegisters = HEAD <= 128;
  static constexpr int kBlockM = HEAD <= 128 ? 128 : 64;  // query rows per thread block
  static constexpr int kBlockN = HEAD <= 128 ? 64 : 16;   // keys per tile
  static constexpr int kWarps = kBlockM / 16;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kLd = HEAD + 8;         // padded 16-bit K/V/Q/output row
  static constexpr int kLdP = kBlockN + 8;     // padded 16-bit probability row
  static constexpr int kLdRed = 16;            // fp32 row of the reduction scratch tile
  static constexpr int kTileElems = kBlockN * kLd;         // one K or V tile
  static constexpr int kStageBytes = 2 * kTileElems * 2;   // K and V of one tile
  static constexpr int kQBytes = kQInRegisters ? 0 : kBlockM * kLd * 2;
  // Per warp: P [16][kLdP] 16-bit, aliased by the reduction tile [16][16] fp32 (used at other times).
  static constexpr int kScratchBytes = 16 * kLdP * 2 > 16 * kLdRed * 4 ? 16 * kLdP * 2 : 16 * kLdRed * 4;
  static constexpr int kStatBytes = 16 * 8;   // per warp: (reference, rescale factor) of each row
  static constexpr int kOrderBytes = 32 * 8;  // per warp: each lane's accumulator order (two words)
  static constexpr int kSmemBytes =
      kQBytes + 2 * kStageBytes + kWarps * (kScratchBytes + kStatBytes + kOrderBytes);
  static constexpr int kChunks = kBlockN * HEAD / 8 / kThreads;   // 16-byte K (and V) loads per thread
  static constexpr int kQChunks = kBlockM * HEAD / 8 / kThreads;  // 16-byte Q loads per thread
  static_assert(HEAD == 64 || HEAD == 128 || HEAD == 256, "head sizes 64, 128, 256");
  static_assert(kBlockN % kBlockSize == 0, "a key tile is whole cache blocks");
  static_assert(kChunks * kThreads * 8 == kBlockN * HEAD, "tile loads divide evenly");
  static_assert(kThreads % (HEAD / 8) == 0, "a thread's chunks share one column");
  static_assert(kQChunks * kThreads * 8 == kBlockM * HEAD, "Q loads divide evenly");
  static_assert(!kQInRegisters || kBlockM * kLd * 2 <= kStageBytes, "Q is staged in the second K/V stage");
  static_assert(kBlockM * kLd * 2 <= 2 * kStageBytes, "the output tile fits in the two stages");
  static_assert(kQBytes % 32 == 0 && kStageBytes % 32 == 0 && kScratchBytes % 32 == 0,
                "WMMA wants 32-byte aligned tiles");
  static_assert(kSmemBytes <= 96 * 1024, "Volta allows at most 96 KB of shared memory per block");
};

// The dynamic shared memory each variant launches with, emitted into the PTX for the gate (NVRTC only).
#ifdef __CUDACC_RTC__
template <int HEAD>
__device__ const int prefill_wmma_smem_bytes = PrefillWmmaTraits<HEAD>::kSmemBytes;
#endif

namespace prefill_wmma {

// The accumulator element order of this GPU, as eight bytes (row << 4 | col), element i in byte i % 4 of
// word i / 4. Loading a 16x16 tile whose every element holds its own code reveals it; the order is the
// same for every accumulator fragment of the type, so one lookup serves the whole block.
template <typename FragC>
__device__ __forceinline__ void accumulator_order(float* scratch, int ld, uint2& order) {
  const int lane = threadIdx.x & 31;
  for (int e = lane; e < 256; e += 32) scratch[(e >> 4) * ld + (e & 15)] = static_cast<float>(e);
  __syncwarp();
  FragC f;
  nvcuda::wmma::load_matrix_sync(f, scratch, ld, nvcuda::wmma::mem_row_major);
  order = make_uint2(0u, 0u);
#pragma unroll
  for (int i = 0; i < 8; ++i) (i < 4 ? order.x : order.y) |= static_cast<unsigned>(f.x[i]) << (8 * (i & 3));
  __syncwarp();  // the scratch tile is reused right after
}

__device__ __forceinline__ int order_code(const uint2& order, int i) {
  return ((i < 4 ? order.x : order.y) >> (8 * (i & 3))) & 0xff;
}

// Writes the 16 x (16 * BLOCKS) fp32 elements of `frags`, as T, into the row-major tile at `dst`: 32-bit
// stores when elements 2k and 2k+1 sit side by side in one row (as on every GPU so far), else 16-bit.
template <typename T, int BLOCKS, typename FragC>
__device__ __forceinline__ void store_fragments(T* dst, int ld, const FragC (&frags)[BLOCKS],
                                                const uint2& order, bool pairs_adjacent) {
  if (pairs_adjacent) {
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int c = order_code(order, 2 * k);
      typename DType<T>::T2* at = reinterpret_cast<typename DType<T>::T2*>(dst + (c >> 4) * ld + (c & 15));
#pragma unroll
      for (int n = 0; n < BLOCKS; ++n) {
        at[8 * n] = DType<T>::from_float2(make_float2(frags[n].x[2 * k], frags[n].x[2 * k + 1]));
      }
    }
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int c = order_code(order, i);
      T* at = dst + (c >> 4) * ld + (c & 15);
#pragma unroll
      for (int n = 0; n < BLOCKS; ++n) at[16 * n] = DType<T>::from_float(frags[n].x[i]);
    }
  }
}

// Every row's maximum (or sum) of the per-element partials `x` of an accumulator-ordered 16x16 tile,
// through the warp's fp32 scratch tile: lanes 2r and 2r+1 finish row r and both return it.
template <typename FragC>
__device__ __forceinline__ float row_reduce(float* scratch, int ld, const float (&x)[8], bool take_max) {
  const int lane = threadIdx.x & 31;
  FragC part;
#pragma unroll
  for (int i = 0; i < 8; ++i) part.x[i] = x[i];
  nvcuda::wmma::store_matrix_sync(scratch, part, ld, nvcuda::wmma::mem_row_major);
  __syncwarp();
  const float4* mine = reinterpret_cast<const float4*>(scratch + (lane >> 1) * ld + (lane & 1) * 8);
  const float4 a = mine[0], b = mine[1];
  float v;
  if (take_max) {
    v = fmaxf(fmaxf(fmaxf(a.x, a.y), fmaxf(a.z, a.w)), fmaxf(fmaxf(b.x, b.y), fmaxf(b.z, b.w)));
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
  } else {
    v = ((a.x + a.y) + (a.z + a.w)) + ((b.x + b.y) + (b.z + b.w));
    v += __shfl_xor_sync(0xffffffffu, v, 1);
  }
  return v;
}

}  // namespace prefill_wmma

template <typename T, int HEAD>
__device__ __forceinline__ void paged_prefill_wmma_block(const PrefillParams& p) {
  using Tr = PrefillWmmaTraits<HEAD>;
  using namespace nvcuda;
  using FragA = wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major>;
  using FragBc = wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major>;
  using FragBr = wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major>;
  using FragC = wmma::fragment<wmma::accumulator, 16, 16, 16, float>;
  static_assert(FragC::num_elements == 8, "a 16x16 fp32 accumulator spreads 8 elements over each lane");
  constexpr int kBN = Tr::kBlockN;
  constexpr int kNT = kBN / 16;   // 16-key column blocks of S
  constexpr int kKS = HEAD / 16;  // 16-dim steps of S = Q K^T
  constexpr int kDT = HEAD / 16;  // 16-dim column blocks of O
  constexpr int kCPR = HEAD / 8;  // 16-byte chunks per row
  constexpr int kLd = Tr::kLd;
  constexpr int kLdP = Tr::kLdP;
  constexpr unsigned kFull = 0xffffffffu;

  PrefillRowTile rt;
  if (!find_row_tile(p, Tr::kBlockM, rt)) return;
  const int seq = rt.seq, q_start = rt.q_start, ctx_before = rt.ctx_before, row0 = rt.row0, rows = rt.rows;
  const int head = blockIdx.y;
  const int kv_head = head / (p.num_heads / p.num_kv_heads);
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;

  VOLTLLM_DYNAMIC_SMEM(smem);
  T* stage0 = reinterpret_cast<T*>(smem + Tr::kQBytes);  // K [kBN][kLd], then V [kBN][kLd]
  T* stage1 = reinterpret_cast<T*>(smem + Tr::kQBytes + Tr::kStageBytes);  // the same for odd tiles
  unsigned char* scratch = smem + Tr::kQBytes + 2 * Tr::kStageBytes + warp * Tr::kScratchBytes;
  float* red_s = reinterpret_cast<float*>(scratch);  // [16][kLdRed] per-element partials
  T* p_s = reinterpret_cast<T*>(scratch);            // [16][kLdP] probabilities (aliases red_s)
  unsigned char* stats = smem + Tr::kQBytes + 2 * Tr::kStageBytes + Tr::kWarps * Tr::kScratchBytes;
  // [16] per row: (max * scale_log2, rescale factor), later (1 / sum, -)
  float2* stat_s = reinterpret_cast<float2*>(stats) + warp * 16;
  // [32] this warp's accumulator orders, one per lane. Re-read where needed: kept in registers, the
  // per-element positions and addresses derived from it are loop-invariant and the compiler would hold
  // them all for the whole loop (spills on sm_70); a shared load cannot move across the barriers.
  uint2* order_s = reinterpret_cast<uint2*>(stats + Tr::kWarps * Tr::kStatBytes) + warp * 32 + lane;
  // Q [kBlockM][kLd]: its own area at head 256, else the second stage until Q is in registers.
  T* q_s = Tr::kQInRegisters ? stage1 : reinterpret_cast<T*>(smem);

  // Q as it is: the softmax scale goes into the exponent. Rows past the sequence load the last row
  // again (finite, never stored).
  const T* query = static_cast<const T*>(p.query) + static_cast<long long>(q_start + row0) * p.query_stride +
                   static_cast<long long>(head) * HEAD;
  uint4 q_reg[Tr::kQChunks];
#pragma unroll
  for (int i = 0; i < Tr::kQChunks; ++i) {
    const int c = threadIdx.x + Tr::kThreads * i;
    const long long row = min(c / kCPR, rows - 1);
    q_reg[i] = *reinterpret_cast<const uint4*>(query + row * p.query_stride + (c % kCPR) * 8);
  }

  // Key range of the whole block: up to the last row's position, from the first row's window start.
  const int kv_end = ctx_before + row0 + rows;
  const int window = p.sliding_window;
  int kv_begin = 0;
  if (window > 0) kv_begin = max(0, ctx_before + row0 - window + 1);
  kv_begin = (kv_begin / kBN) * kBN;
  const int n_tiles = (kv_end - kv_begin + kBN - 1) / kBN;

  // Strides within a cache block fit in 32 bits (16 tokens x num_kv_heads x HEAD); only the block id is
  // scaled in 64 bits (one wide multiply-add per chunk). Ids and offsets are never negative: unsigned
  // keeps the arithmetic free of sign fix-ups.
  const unsigned token_stride = static_cast<unsigned>(p.num_kv_heads) * HEAD;
  const unsigned block_stride = kBlockSize * token_stride;
  const T* k_cache = static_cast<const T*>(p.key_cache) + kv_head * HEAD;
  const T* v_cache = static_cast<const T*>(p.value_cache) + kv_head * HEAD;
  const int* block_table = p.block_tables + static_cast<long long>(seq) * p.max_blocks_per_seq;
  const int chunk_row = threadIdx.x / kCPR;             // of chunk 0; chunk i is kThreads / kCPR rows on
  const unsigned chunk_col = (threadIdx.x % kCPR) * 8;  // the same for every chunk of this thread

  // All block-table reads of a tile are issued before any K/V read, so the tile costs one dependent
  // memory round trip, not one per chunk. Positions past the context are clamped to the last valid
  // token: those keys are masked, and real (finite) data keeps 0 * V finite.
  auto load_rows = [&](uint4 (&dst)[Tr::kChunks], const T* cache, int tile_start) {
    unsigned block[Tr::kChunks], pos[Tr::kChunks];
#pragma unroll
    for (int i = 0; i < Tr::kChunks; ++i) {
      pos[i] = static_cast<unsigned>(min(tile_start + chunk_row + i * (Tr::kThreads / kCPR), kv_end - 1));
      block[i] = static_cast<unsigned>(block_table[pos[i] / kBlockSize]);
    }
#pragma unroll
    for (int i = 0; i < Tr::kChunks; ++i) {
      const T* row = cache + ((pos[i] % kBlockSize) * token_stride + chunk_col);
      dst[i] = *reinterpret_cast<const uint4*>(row + static_cast<unsigned long long>(block[i]) * block_stride);
    }
  };
  auto store_rows = [&](T* tile, const uint4 (&src)[Tr::kChunks]) {
#pragma unroll
    for (int i = 0; i < Tr::kChunks; ++i) {
      *reinterpret_cast<uint4*>(tile + (chunk_row + i * (Tr::kThreads / kCPR)) * kLd + chunk_col) = src[i];
    }
  };
  {
    // Q and tile 0 in one round trip (the loop's registers are not live yet).
    uint4 k0[Tr::kChunks], v0[Tr::kChunks];
    load_rows(k0, k_cache, kv_begin);
    load_rows(v0, v_cache, kv_begin);
#pragma unroll
    for (int i = 0; i < Tr::kQChunks; ++i) {
      const int c = threadIdx.x + Tr::kThreads * i;
      *reinterpret_cast<uint4*>(q_s + (c / kCPR) * kLd + (c % kCPR) * 8) = q_reg[i];
    }
    store_rows(stage0, k0);
    store_rows(stage0 + Tr::kTileElems, v0);
  }

  // Where each accumulator element sits (warp-local; the scratch tile is free until the first tile).
  bool pairs_adjacent = true;
  {
    uint2 order;
    prefill_wmma::accumulator_order<FragC>(red_s, Tr::kLdRed, order);
    *order_s = order;  // read back by this lane only
    // Elements 2k and 2k+1 side by side in one row (as on every GPU so far): 32-bit stores of P and O.
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int c = prefill_wmma::order_code(order, 2 * k);
      pairs_adjacent = pairs_adjacent && (c & 1) == 0 && prefill_wmma::order_code(order, 2 * k + 1) == c + 1;
    }
    pairs_adjacent = __all_sync(kFull, pairs_adjacent);
  }
  __syncthreads();  // Q staged, tile 0 in stage 0
  FragA qf[Tr::kQInRegisters ? kKS : 1];
  if constexpr (Tr::kQInRegisters) {
#pragma unroll
    for (int k = 0; k < kKS; ++k) wmma::load_matrix_sync(qf[k], q_s + warp * 16 * kLd + k * 16, kLd);
    __syncthreads();  // stage 1 is free for tile 1
  }

  // This warp's rows. Rows past the sequence reuse the last row's position.
  const int warp_min_pos = ctx_before + row0 + min(warp * 16, rows - 1);
  const int warp_max_pos = ctx_before + row0 + min(warp * 16 + 15, rows - 1);
  const bool warp_active = warp * 16 < rows;
  const float sc = p.scale_log2;

  FragC o[kDT];
#pragma unroll
  for (int j = 0; j < kDT; ++j) wmma::fill_fragment(o[j], 0.f);
  float row_sum[8];  // per element: this element's share of its row's running sum
#pragma unroll
  for (int i = 0; i < 8; ++i) row_sum[i] = 0.f;
  float row_max = neg_inf();  // of row lane / 2 (both lanes of the pair), raw score units

  // The stage this tile is read from and the one the next tile goes to, swapped every tile. (Selected
  // from t & 1 instead, the choice was re-made in every fragment address: ~3 instructions per load.)
  T* ks = stage0;
  T* next_stage = stage1;
  for (int t = 0; t < n_tiles; ++t) {
    const int tile_start = kv_begin + t * kBN;
    const T* vs = ks + Tr::kTileElems;
    const bool has_next = t + 1 < n_tiles;
    // One 16-byte chunk per (thread, i) of the next tile: its K is in flight during S = Q K^T, its V
    // during the softmax and O += P V (the two never hold registers at once).
    uint4 next[Tr::kChunks];
    if (has_next) load_rows(next, k_cache, tile_start + kBN);

    // Skip tiles wholly in this warp's causal future or before its window (warp-uniform).
    const bool in_future = tile_start > warp_max_pos;
    const bool in_past = window > 0 && tile_start + kBN - 1 <= warp_min_pos - window;
    const bool compute = warp_active && !in_future && !in_past;
    FragC s[kNT];
    if (compute) {
      // S = Q K^T for this warp's 16 rows.
#pragma unroll
      for (int n = 0; n < kNT; ++n) wmma::fill_fragment(s[n], 0.f);
      auto qk_step = [&](const FragA& a, int k) {
#pragma unroll
        for (int n = 0; n < kNT; ++n) {
          FragBc b;
          wmma::load_matrix_sync(b, ks + n * 16 * kLd + k * 16, kLd);
          wmma::mma_sync(s[n], a, b, s[n]);
        }
      };
#pragma unroll
      for (int k = 0; k < kKS; ++k) {
        if constexpr (Tr::kQInRegisters) {
          qk_step(qf[k], k);
        } else {
          FragA a;
          wmma::load_matrix_sync(a, q_s + warp * 16 * kLd + k * 16, kLd);
          qk_step(a, k);
        }
      }
    }
    // Between the two products the next K goes to its stage, which frees its registers for the next V.
    if (has_next) {
      store_rows(next_stage, next);
      load_rows(next, v_cache, tile_start + kBN);
    }
    if (compute) {
      // Masks only on tiles that cross this warp's diagonal or window edge (a warp-uniform test).
      const bool need_mask =
          tile_start + kBN - 1 > warp_min_pos || (window > 0 && tile_start < warp_max_pos - window + 1);
      if (need_mask) {
        const uint2 order = *order_s;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          const int c = prefill_wmma::order_code(order, i);
          const int pos = ctx_before + row0 + min(warp * 16 + (c >> 4), rows - 1);
#pragma unroll
          for (int n = 0; n < kNT; ++n) {
            const int key = tile_start + 16 * n + (c & 15);
            const bool visible = key <= pos && (window == 0 || key > pos - window);
            s[n].x[i] = visible ? s[n].x[i] : neg_inf();
          }
        }
      }

      // Row maxima: each element's maximum over the tile's column blocks, then per row.
      float part[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        part[i] = s[0].x[i];
#pragma unroll
        for (int n = 1; n < kNT; ++n) part[i] = fmaxf(part[i], s[n].x[i]);
      }
      const float tile_max = prefill_wmma::row_reduce<FragC>(red_s, Tr::kLdRed, part, true);
      const float new_max = fmaxf(row_max, tile_max);
      const float ref = new_max == neg_inf() ? 0.f : new_max * sc;  // a row with nothing visible stays 0
      const float alpha = fast_exp2(row_max * sc - ref);
      row_max = new_max;
      if ((lane & 1) == 0) stat_s[lane >> 1] = make_float2(ref, alpha);
      // Once the running maxima settle, every factor is exactly 1: skip the rescale then.
      const bool rescale = !__all_sync(kFull, alpha == 1.f);
      __syncwarp();  // stat_s is published; every lane is done reading the scratch tile

      const uint2 order = *order_s;
      if (rescale) {
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          const float f = stat_s[prefill_wmma::order_code(order, i) >> 4].y;
          row_sum[i] *= f;
#pragma unroll
          for (int j = 0; j < kDT; ++j) o[j].x[i] *= f;
        }
      }
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const float r = stat_s[prefill_wmma::order_code(order, i) >> 4].x;
        float sum = 0.f;
#pragma unroll
        for (int n = 0; n < kNT; ++n) {
          const float e = fast_exp2(fmaf(s[n].x[i], sc, -r));
          s[n].x[i] = e;
          sum += e;
        }
        row_sum[i] += sum;
      }
      prefill_wmma::store_fragments(p_s, kLdP, s, order, pairs_adjacent);
      __syncwarp();

      // O += P V. Unrolled, the next column block's V fragments load during this one's MMAs; sm_70 keeps
      // the loop rolled (one P fragment live at a time), or head 128 spills at 255 registers.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#pragma unroll 1
#else
#pragma unroll
#endif
      for (int n = 0; n < kNT; ++n) {
        FragA pa;
        wmma::load_matrix_sync(pa, p_s + n * 16, kLdP);
#pragma unroll
        for (int j = 0; j < kDT; ++j) {
          FragBr bv;
          wmma::load_matrix_sync(bv, vs + n * 16 * kLd + j * 16, kLd);
          wmma::mma_sync(o[j], pa, bv, o[j]);
        }
      }
    }
    if (has_next) store_rows(next_stage + Tr::kTileElems, next);
    T* const done = ks;
    ks = next_stage;
    next_stage = done;
    // Tile t+1 is complete and visible; every warp is done with tile t's stage (refilled during tile
    // t+1) and with its P.
    __syncthreads();
  }

  if (!warp_active) return;  // no barrier follows
  // Normalise: row sums from the per-element partials, then 1 / sum per element.
  const uint2 order = *order_s;
  const float total = prefill_wmma::row_reduce<FragC>(red_s, Tr::kLdRed, row_sum, false);
  if ((lane & 1) == 0) stat_s[lane >> 1].x = 1.f / total;
  __syncwarp();
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const float inv = stat_s[prefill_wmma::order_code(order, i) >> 4].x;
#pragma unroll
    for (int j = 0; j < kDT; ++j) o[j].x[i] *= inv;
  }
  // The output tile goes through this warp's slice of the (idle) stages, then out in 16-byte rows.
  T* o_s = stage0 + warp * 16 * kLd;  // [16][kLd]
  prefill_wmma::store_fragments(o_s, kLd, o, order, pairs_adjacent);
  __syncwarp();
  T* out = static_cast<T*>(p.out) + static_cast<long long>(q_start + row0 + warp * 16) * p.out_stride +
           static_cast<long long>(head) * HEAD;
  const int out_rows = min(16, rows - warp * 16);
  for (int i = lane; i < 16 * kCPR; i += 32) {
    const int r = i / kCPR, col = (i % kCPR) * 8;
    if (r < out_rows) {
      *reinterpret_cast<uint4*>(out + r * p.out_stride + col) = *reinterpret_cast<const uint4*>(o_s + r * kLd + col);
    }
  }
}

// grid: (total row tiles = cu_tiles[num_seqs], num_heads), block: PrefillWmmaTraits::kThreads,
// dynamic shared memory: PrefillWmmaTraits::kSmemBytes. cu_tiles counts tiles of PrefillWmmaTraits::kBlockM.
template <typename T, int HEAD>
__global__ void __launch_bounds__(PrefillWmmaTraits<HEAD>::kThreads) paged_prefill_wmma_kernel(PrefillParams p) {
  begin_dependent_grid();
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  // bf16 tensor-core math exists from SM80 on; the host wrapper never launches this variant there.
  if constexpr (is_same<T, __nv_bfloat16>::value) {
    __trap();
  } else
#endif
  {
    paged_prefill_wmma_block<T, HEAD>(p);
  }
}

}  // namespace voltllm
