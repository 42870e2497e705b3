// Prefill / chunked-prefill flash attention over the paged KV cache on mma.sync: SM80 and newer (Volta
// runs the WMMA kernel, paged_prefill_wmma.cuh; see mma_sm80.cuh). Inputs and the row-tile lookup:
// paged_prefill_common.cuh.
//
// FlashAttention-2 style on mma.sync m16n8k16, whose fragment layouts are documented (WMMA's are not):
//  * Each warp owns 16 query rows; its Q fragments are loaded once (ldmatrix) and stay in registers.
//  * S = Q K^T lands in registers in exactly the layout the A operand of O += P V wants, so the
//    online softmax runs on registers and P feeds the second MMA directly: no score round trip
//    through shared memory, no row-index lookup table, no barrier between the two products.
//  * K/V tiles go global -> shared with cp.async, two stages: tile t+1 is in flight while tile t is
//    computed, without holding it in registers. Block ids are read one tile ahead of their copies.
//  * B fragments come from shared memory through ldmatrix (.trans for V); rows are padded by 16
//    bytes so the eight rows of each 8x8 matrix fall in distinct banks.
//  * BLOCK_M 128 (8 warps) at head <= 128: each K/V tile staged in shared memory serves 128 query rows.
//  * The softmax scale is applied in the exponent (one FFMA per score), not to Q in 16 bits.
#pragma once

#include "attention/mma_sm80.cuh"
#include "attention/paged_prefill_common.cuh"

namespace voltllm {

template <int HEAD>
struct PrefillMmaSm80Traits {
  static constexpr int kBlockM = HEAD <= 128 ? 128 : 64;  // query rows per block; head 256 keeps
  static constexpr int kBlockN = HEAD <= 128 ? 64 : 32;   // its 128 accumulator registers per lane
  static constexpr int kWarps = kBlockM / 16;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kLd = HEAD + 8;                    // padded 16-bit row
  static constexpr int kTileElems = kBlockN * kLd;        // one K or V tile
  static constexpr int kStageBytes = 2 * kTileElems * 2;  // K and V of one tile
  static constexpr int kSmemBytes = 2 * kStageBytes;      // two stages; Q and the output alias them
  static constexpr int kChunks = kBlockN * HEAD / 8 / kThreads;   // 16-byte K (and V) copies per thread
  static constexpr int kQChunks = kBlockM * HEAD / 8 / kThreads;  // 16-byte Q copies per thread
  static_assert(HEAD == 64 || HEAD == 128 || HEAD == 256, "head sizes 64, 128, 256");
  static_assert(kBlockN % kBlockSize == 0, "a key tile is whole cache blocks");
  static_assert(kChunks * kThreads * 8 == kBlockN * HEAD, "tile copies divide evenly");
  static_assert(kBlockM * kLd * 2 <= kStageBytes, "the Q / output tile fits in one stage");
  static_assert(kSmemBytes <= 99 * 1024, "SM86 and SM89 allow 99 KB of shared memory per block");
};

// The dynamic shared memory each variant launches with, emitted into the PTX for the gate (NVRTC only).
#ifdef __CUDACC_RTC__
template <int HEAD>
__device__ const int prefill_mma_sm80_smem_bytes = PrefillMmaSm80Traits<HEAD>::kSmemBytes;
#endif

#ifdef VOLTLLM_SM80_PATH
template <typename T, int HEAD>
__device__ __forceinline__ void paged_prefill_mma_sm80_block(const PrefillParams& p) {
  using Tr = PrefillMmaSm80Traits<HEAD>;
  using sm80::kFullMask;
  constexpr int kBN = Tr::kBlockN;
  constexpr int kNT = kBN / 8;      // 8-key column tiles of S
  constexpr int kKS = HEAD / 16;    // 16-dim steps of S = Q K^T
  constexpr int kDT = HEAD / 8;     // 8-dim column tiles of O
  constexpr int kCPR = HEAD / 8;    // 16-byte chunks per row
  constexpr int kLd = Tr::kLd;

  PrefillRowTile rt;
  if (!find_row_tile(p, Tr::kBlockM, rt)) return;
  const int seq = rt.seq, q_start = rt.q_start, ctx_before = rt.ctx_before, row0 = rt.row0, rows = rt.rows;
  const int head = blockIdx.y;
  const int kv_head = head / (p.num_heads / p.num_kv_heads);
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  const int g = lane >> 2;
  const int q = lane & 3;

  VOLTLLM_DYNAMIC_SMEM(smem);
  T* stage0 = reinterpret_cast<T*>(smem);                    // K [kBN][kLd], then V [kBN][kLd]
  T* stage1 = reinterpret_cast<T*>(smem + Tr::kStageBytes);  // the same for odd tiles
  T* q_s = stage1;  // [kBlockM][kLd] until Q is in registers

  // Rows past the sequence load the last row again: finite, never stored.
  const T* query = static_cast<const T*>(p.query) + static_cast<long long>(q_start + row0) * p.query_stride +
                   static_cast<long long>(head) * HEAD;
#pragma unroll
  for (int i = 0; i < Tr::kQChunks; ++i) {
    const int c = threadIdx.x + Tr::kThreads * i;
    const int r = c / kCPR, col = (c % kCPR) * 8;
    sm80::cp_async16(q_s + r * kLd + col, query + static_cast<long long>(min(r, rows - 1)) * p.query_stride + col);
  }
  sm80::cp_async_commit();

  // Key range of the whole block: up to the last row's position, from the first row's window start.
  const int kv_end = ctx_before + row0 + rows;
  int kv_begin = 0;
  if (p.sliding_window > 0) kv_begin = max(0, ctx_before + row0 - p.sliding_window + 1);
  kv_begin = (kv_begin / kBN) * kBN;
  const int n_tiles = (kv_end - kv_begin + kBN - 1) / kBN;

  const long long token_stride = static_cast<long long>(p.num_kv_heads) * HEAD;
  const T* k_cache = static_cast<const T*>(p.key_cache) + kv_head * HEAD;
  const T* v_cache = static_cast<const T*>(p.value_cache) + kv_head * HEAD;
  const int* block_table = p.block_tables + static_cast<long long>(seq) * p.max_blocks_per_seq;
  // Positions past the context are clamped to the last valid token: masked, and finite.
  int ids[Tr::kChunks];
  auto read_ids = [&](int tile_start) {
#pragma unroll
    for (int i = 0; i < Tr::kChunks; ++i) {
      const int pos = min(tile_start + (threadIdx.x + Tr::kThreads * i) / kCPR, kv_end - 1);
      ids[i] = block_table[pos / kBlockSize];
    }
  };
  auto issue_tile = [&](int tile_start, T* dst) {
#pragma unroll
    for (int i = 0; i < Tr::kChunks; ++i) {
      const int c = threadIdx.x + Tr::kThreads * i;
      const int r = c / kCPR, col = (c % kCPR) * 8;
      const int pos = min(tile_start + r, kv_end - 1);
      const long long off = (static_cast<long long>(ids[i]) * kBlockSize + pos % kBlockSize) * token_stride + col;
      sm80::cp_async16(dst + r * kLd + col, k_cache + off);
      sm80::cp_async16(dst + Tr::kTileElems + r * kLd + col, v_cache + off);
    }
  };
  read_ids(kv_begin);
  issue_tile(kv_begin, stage0);
  sm80::cp_async_commit();
  if (n_tiles > 1) read_ids(kv_begin + kBN);

  sm80::cp_async_wait<1>();  // Q has landed (tile 0 may still be in flight)
  __syncthreads();
  unsigned qf[kKS][4];
#pragma unroll
  for (int kk = 0; kk < kKS; ++kk) {
    sm80::ldmatrix_x4(qf[kk], q_s + (warp * 16 + (lane & 7) + 8 * ((lane >> 3) & 1)) * kLd + 16 * kk + 8 * (lane >> 4));
  }
  __syncthreads();  // stage 1 is free for tile 1

  float o[kDT][4];
#pragma unroll
  for (int dt = 0; dt < kDT; ++dt) o[dt][0] = o[dt][1] = o[dt][2] = o[dt][3] = 0.f;
  float row_m[2] = {neg_inf(), neg_inf()};  // raw score units
  float row_l[2] = {0.f, 0.f};              // per lane; summed over the quad at the end
  const float sc = p.scale_log2;
  const int window = p.sliding_window;
  // This lane's rows g and g+8 of the warp. Rows past the sequence reuse the last row's position.
  const int pos0 = ctx_before + row0 + min(warp * 16 + g, rows - 1);
  const int pos1 = ctx_before + row0 + min(warp * 16 + g + 8, rows - 1);
  const int warp_min_pos = ctx_before + row0 + min(warp * 16, rows - 1);
  const int warp_max_pos = ctx_before + row0 + min(warp * 16 + 15, rows - 1);
  const bool warp_active = warp * 16 < rows;

  for (int t = 0; t < n_tiles; ++t) {
    const int tile_start = kv_begin + t * kBN;
    sm80::cp_async_wait<0>();
    __syncthreads();  // tile t is visible to all; nobody reads tile t-1's stage any more
    if (t + 1 < n_tiles) {
      issue_tile(tile_start + kBN, (t & 1) ? stage0 : stage1);
      sm80::cp_async_commit();
      if (t + 2 < n_tiles) read_ids(tile_start + 2 * kBN);
    }
    // Skip tiles wholly in this warp's causal future or before its window (warp-uniform).
    const bool in_future = tile_start > warp_max_pos;
    const bool in_past = window > 0 && tile_start + kBN - 1 <= warp_min_pos - window;
    if (!warp_active || in_future || in_past) continue;
    const T* ks = (t & 1) ? stage1 : stage0;
    const T* vs = ks + Tr::kTileElems;

    // S = Q K^T: one ldmatrix.x4 gives the B fragments of two 8-key tiles for one 16-dim step.
    float s[kNT][4];
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < kKS; ++kk) {
#pragma unroll
      for (int np = 0; np < kNT / 2; ++np) {
        unsigned b[4];
        sm80::ldmatrix_x4(b, ks + (np * 16 + (lane & 7) + 8 * (lane >> 4)) * kLd + 16 * kk + 8 * ((lane >> 3) & 1));
        sm80::mma<T>(s[2 * np], qf[kk], b[0], b[1]);
        sm80::mma<T>(s[2 * np + 1], qf[kk], b[2], b[3]);
      }
    }
    // Masks only on tiles that cross this warp's diagonal or window edge (a warp-uniform test).
    const bool need_mask = tile_start + kBN - 1 > warp_min_pos || (window > 0 && tile_start < warp_max_pos - window + 1);
    if (need_mask) {
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int key = tile_start + nt * 8 + 2 * q + (i & 1);
          const int pos = i < 2 ? pos0 : pos1;
          const bool visible = key <= pos && (window == 0 || key > pos - window);
          s[nt][i] = visible ? s[nt][i] : neg_inf();
        }
      }
    }

    // Online softmax on registers: the four lanes of a quad share rows g and g+8.
    float alpha[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float mx = neg_inf();
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt) mx = fmaxf(mx, fmaxf(s[nt][2 * r], s[nt][2 * r + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(kFullMask, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(kFullMask, mx, 2));
      const float m_new = fmaxf(row_m[r], mx);
      const float ref = m_new == neg_inf() ? 0.f : m_new * sc;  // a row with nothing visible stays 0
      alpha[r] = fast_exp2(row_m[r] * sc - ref);
      row_m[r] = m_new;
      float sum = 0.f;
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt) {
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const float e = fast_exp2(fmaf(s[nt][2 * r + j], sc, -ref));
          s[nt][2 * r + j] = e;
          sum += e;
        }
      }
      row_l[r] = row_l[r] * alpha[r] + sum;
    }
    // Once the running maxima settle, every factor is exactly 1: skip the rescale then.
    if (!__all_sync(kFullMask, alpha[0] == 1.f && alpha[1] == 1.f)) {
#pragma unroll
      for (int dt = 0; dt < kDT; ++dt) {
        o[dt][0] *= alpha[0];
        o[dt][1] *= alpha[0];
        o[dt][2] *= alpha[1];
        o[dt][3] *= alpha[1];
      }
    }

    // O += P V: S's accumulator layout is the A fragment layout, 16 keys per step.
#pragma unroll
    for (int kk = 0; kk < kBN / 16; ++kk) {
      const unsigned a[4] = {sm80::pack<T>(s[2 * kk][0], s[2 * kk][1]), sm80::pack<T>(s[2 * kk][2], s[2 * kk][3]),
                             sm80::pack<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                             sm80::pack<T>(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
      for (int dp = 0; dp < kDT / 2; ++dp) {
        unsigned b[4];
        sm80::ldmatrix_x4_trans(b, vs + (16 * kk + (lane & 7) + 8 * ((lane >> 3) & 1)) * kLd + 16 * dp + 8 * (lane >> 4));
        sm80::mma<T>(o[2 * dp], a, b[0], b[1]);
        sm80::mma<T>(o[2 * dp + 1], a, b[2], b[3]);
      }
    }
  }

  sm80::cp_async_wait<0>();
  __syncthreads();  // every warp is done with the stages: they now hold the output tile
  if (!warp_active) return;  // no barrier follows
  float inv[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float l = row_l[r];
    l += __shfl_xor_sync(kFullMask, l, 1);
    l += __shfl_xor_sync(kFullMask, l, 2);
    inv[r] = 1.f / l;
  }
  T* o_s = reinterpret_cast<T*>(smem) + warp * 16 * kLd;  // [16][kLd]
#pragma unroll
  for (int dt = 0; dt < kDT; ++dt) {
    *reinterpret_cast<unsigned*>(o_s + g * kLd + 8 * dt + 2 * q) = sm80::pack<T>(o[dt][0] * inv[0], o[dt][1] * inv[0]);
    *reinterpret_cast<unsigned*>(o_s + (g + 8) * kLd + 8 * dt + 2 * q) =
        sm80::pack<T>(o[dt][2] * inv[1], o[dt][3] * inv[1]);
  }
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
#endif  // VOLTLLM_SM80_PATH

// grid: (total row tiles = cu_tiles[num_seqs], num_heads), block: PrefillMmaSm80Traits::kThreads,
// dynamic shared memory: PrefillMmaSm80Traits::kSmemBytes. cu_tiles counts tiles of
// PrefillMmaSm80Traits::kBlockM.
template <typename T, int HEAD>
__global__ void __launch_bounds__(PrefillMmaSm80Traits<HEAD>::kThreads)
    paged_prefill_mma_sm80_kernel(PrefillParams p) {
  begin_dependent_grid();
#ifdef VOLTLLM_SM80_PATH
  paged_prefill_mma_sm80_block<T, HEAD>(p);
#else
  __trap();  // SM80+ only: the Python layer runs the WMMA kernel on older GPUs
#endif
}

}  // namespace voltllm
