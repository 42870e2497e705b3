// Paged decode attention, v8: SM80 and newer (Volta runs v6, paged_decode_attention.cuh; see
// attention_sm80.cuh). Same inputs, outputs and split-partial layout as v6.
//
// What changes against v6:
//  * Both products are transposed, so the query heads of a GQA group sit on the 8-wide N side of
//    mma.m16n8k16 and tokens / head dims on its 16-wide M side: S^T = K Q^T and O^T += V^T P^T. At
//    group 8 no MMA row is padding, and the output accumulator is half of v6's (32 fp32 registers per
//    lane at head 128, against 64).
//  * K and V go from global memory straight into MMA fragments; nothing is staged in shared memory.
//    The order of the head dim inside a dot product is free, so each lane loads whole 16-byte chunks of
//    K and Q is laid out in the same permuted order; V's token pairs are formed with one byte permute
//    per fragment register.
//  * The online softmax runs on the accumulator registers; P^T reaches its B fragment through four
//    shuffles. Row sums stay per lane until the end.
//  * A block has 4, 8 or 16 warps, chosen per call (plan_decode_v8): big blocks where the context must
//    be split (fewer partials to merge), small ones where many sequences already fill the GPU.
//  * The split merge is folded in: the last block of each (sequence, kv head) to finish (an atomic
//    ticket) merges the partials and resets its ticket to 0, so no reduce kernel is launched and CUDA
//    graph replays need no memset. (fused_merge = 0 leaves the partials to v6's reduce kernel.)
//  * The split's first block id is read in parallel with the sequence length (without a sliding
//    window the id's index does not depend on it), removing one memory round trip from the start.
//
// Per 16-token KV block a warp runs HEAD/16 MMAs for S^T and HEAD/16 for O^T; the next block's K is
// loaded as soon as S^T has consumed the current one, and its V right after O^T consumed the current.
#pragma once

#include "attention_sm80.cuh"
#include "paged_decode_attention_common.cuh"

namespace voltllm {

// v6's parameters (group size up to 8 * NT) and the folded merge's.
struct DecodeV8Params : DecodeParams {
  int* tickets;                 // [num_seqs * num_kv_heads] finished splits; 0 between calls
  int fused_merge;              // 1: the last split block merges; 0: the reduce kernel does
};

// NT: 8-head column tiles of the group (1 for group <= 8, 2 for group <= 16).
template <int HEAD, int NT>
struct DecodeV8Traits {
  static constexpr int kRows = 8 * NT;           // query heads per block, padded to the MMA's N
  static constexpr int kKChunks = HEAD / 32;     // 16-byte K chunks per lane and row
  static constexpr int kVChunks = HEAD / 64;     // 16-byte V chunks per lane and token
  static constexpr int kMTiles = HEAD / 16;      // 16-dim row tiles of O^T
  // Registers per lane grow with HEAD * NT (accumulator + one K and one V block); the cap keeps
  // them (and the per-warp merge area below) within one SM's budget at the largest block.
  static constexpr int kMaxWarps = HEAD * NT <= 128 ? 16 : HEAD * NT <= 256 ? 8 : 4;
  static constexpr int kMaxThreads = 32 * kMaxWarps;
  static constexpr int kQBytes = kRows * HEAD * 2;               // Q in fragment order
  static constexpr int kFlagBytes = 16;                           // "this block merges" flag
  static constexpr int kWarpBytes = kRows * HEAD * 4 + 2 * kRows * 4;  // a warp's O, max and sum
  __host__ __device__ static constexpr int smem_bytes(int warps) { return kQBytes + kFlagBytes + warps * kWarpBytes; }
  static_assert(HEAD == 64 || HEAD == 128 || HEAD == 256, "head sizes 64, 128, 256");
  static_assert(NT == 1 || NT == 2, "groups of up to 16 query heads");
};

// The dynamic shared memory of the largest block of each variant, emitted for the gate (NVRTC only).
#ifdef __CUDACC_RTC__
template <int HEAD, int NT>
__device__ const int decode_v8_smem_bytes =
    DecodeV8Traits<HEAD, NT>::smem_bytes(DecodeV8Traits<HEAD, NT>::kMaxWarps);
#endif

#ifndef __CUDACC_RTC__
// Launch shape of one call: warps per block, context splits, tokens per split.
struct DecodeV8Plan {
  int warps;
  long long splits;
  long long partition;
};

// Chooses the largest block (16, 8 or 4 warps) of which one wave covers every (sequence, kv head),
// then splits the context so that the grid is one full wave of that block, with at least two KV
// blocks per warp in a split. resident[i] = blocks of 4 << i warps that fit on one SM.
inline DecodeV8Plan plan_decode_v8(long long span, long long base_blocks, long long num_sms,
                                   const int (&resident)[3], int max_warps) {
  for (int i = 2; i >= 0; --i) {
    const int warps = 4 << i;
    if (warps > max_warps || resident[i] <= 0) continue;
    const long long slots = num_sms * resident[i];
    if (slots < base_blocks && i > 0) continue;
    const long long want = slots / base_blocks > 1 ? slots / base_blocks : 1;
    long long most = span / (32LL * warps);
    most = most < 1 ? 1 : most > 4096 ? 4096 : most;
    const long long splits = want < most ? want : most;
    const long long per_split = (span + splits - 1) / splits;
    const long long partition = (per_split + kBlockSize - 1) / kBlockSize * kBlockSize;
    return {warps, (span + partition - 1) / partition, partition};
  }
  const long long partition = (span + kBlockSize - 1) / kBlockSize * kBlockSize;
  return {4, 1, partition};
}
#endif

#ifdef VOLTLLM_SM80_PATH
template <typename T, int HEAD, int NT>
__device__ __forceinline__ void paged_decode_v8_block(const DecodeV8Params& p) {
  using Tr = DecodeV8Traits<HEAD, NT>;
  using sm80::kFullMask;
  constexpr int kKC = Tr::kKChunks;
  constexpr int kVC = Tr::kVChunks;
  constexpr int kMT = Tr::kMTiles;
  constexpr int kRows = Tr::kRows;

  const int warps = blockDim.x >> 5;
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  const int g = lane >> 2;  // MMA group: token (S^T) / head-dim row (O^T) / head (B fragments)
  const int q = lane & 3;   // lane in the group
  const int kv_head = blockIdx.x;
  const int seq = blockIdx.y;
  const int split = blockIdx.z;
  const int group = p.num_heads / p.num_kv_heads;
  const int* block_table = p.block_tables + static_cast<long long>(seq) * p.max_blocks_per_seq;

  const int guess_block = split * (p.partition_size / kBlockSize) + warp;
  int first_id = block_table[min(guess_block, p.max_blocks_per_seq - 1)];
  const int seq_len = p.seq_lens[seq];
  const int first_pos = p.sliding_window > 0 ? max(0, seq_len - p.sliding_window) : 0;
  const int base = (first_pos / kBlockSize) * kBlockSize;
  const int start = base + split * p.partition_size;
  if (start >= seq_len) return;
  const int end = min(start + p.partition_size, seq_len);
  const int num_splits = (seq_len - base + p.partition_size - 1) / p.partition_size;
  const int lo = max(start, first_pos);  // first visible position of this split
  const int first_block = start / kBlockSize + warp;
  const int last_block = (end - 1) / kBlockSize;  // inclusive
  if (base != 0 && first_block <= last_block) first_id = block_table[first_block];

  const long long token_stride = static_cast<long long>(p.num_kv_heads) * HEAD;
  const T* k_head = static_cast<const T*>(p.key_cache) + kv_head * HEAD;
  const T* v_head = static_cast<const T*>(p.value_cache) + kv_head * HEAD;
  // K: tokens g and g+8, dims 32c + 8q .. +8. As S^T's A fragment, step (c, half) takes words
  // (x, y) or (z, w): logical k {2q, 2q+1} <- dims +0..1 (+4..5), {2q+8, 2q+9} <- dims +2..3 (+6..7).
  uint4 kr[2][kKC];
  // V: tokens 2q, 2q+1, 2q+8, 2q+9 (the k of O^T's A fragment), dims 64c + 8g .. +8.
  uint4 vr[4][kVC];
  auto load_k = [&](int id) {
    const T* rows = k_head + static_cast<long long>(id) * kBlockSize * token_stride + 8 * q;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
#pragma unroll
      for (int c = 0; c < kKC; ++c) {
        kr[r][c] = *reinterpret_cast<const uint4*>(rows + (g + 8 * r) * token_stride + 32 * c);
      }
    }
  };
  auto load_v = [&](int id) {
    const T* rows = v_head + static_cast<long long>(id) * kBlockSize * token_stride + 8 * g;
#pragma unroll
    for (int t = 0; t < 4; ++t) {
#pragma unroll
      for (int c = 0; c < kVC; ++c) {
        vr[t][c] = *reinterpret_cast<const uint4*>(rows + (2 * q + (t & 1) + 8 * (t >> 1)) * token_stride + 64 * c);
      }
    }
  };
  if (first_block <= last_block) {
    load_k(first_id);
    load_v(first_id);
  }

  VOLTLLM_DYNAMIC_SMEM(smem);
  uint4* q_s = reinterpret_cast<uint4*>(smem);  // [NT][kKC][32 lanes]: each lane's B fragments
  int* merge_flag = reinterpret_cast<int*>(smem + Tr::kQBytes);
  float* o_s = reinterpret_cast<float*>(smem + Tr::kQBytes + Tr::kFlagBytes);  // [warps][kRows][HEAD]
  float* stat_m = o_s + warps * kRows * HEAD;                                   // [warps][kRows]
  float* stat_l = stat_m + warps * kRows;                                       // [warps][kRows]

  // Q^T as B fragments (n = head, k = dim in K's permuted order); heads past the group are zero.
  const T* query = static_cast<const T*>(p.query) + seq * p.query_stride + static_cast<long long>(kv_head) * group * HEAD;
  for (int i = threadIdx.x; i < NT * kKC * 32; i += blockDim.x) {
    const int l = i & 31, c = (i >> 5) % kKC, nt = (i >> 5) / kKC;
    const int h = nt * 8 + (l >> 2);
    uint4 v = make_uint4(0, 0, 0, 0);
    if (h < group) v = *reinterpret_cast<const uint4*>(query + h * HEAD + 32 * c + 8 * (l & 3));
    q_s[i] = v;
  }

  float o[kMT][NT][4];
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
      for (int i = 0; i < 4; ++i) o[mt][nt][i] = 0.f;
    }
  }
  // Softmax state of heads nt*8 + 2q + j (the same in every lane of the column); sums per lane.
  float row_m[NT][2], row_l[NT][2];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    row_m[nt][0] = row_m[nt][1] = neg_inf();
    row_l[nt][0] = row_l[nt][1] = 0.f;
  }
  // P^T's B fragment wants head g of tokens 2q, 2q+1 (+8): lanes (2q, g/2) and (2q+1, g/2) hold them.
  const int src0 = 8 * q + (g >> 1);
  const int src1 = src0 + 4;
  const int half_sel = g & 1;
  int next_id = first_block + warps <= last_block ? block_table[first_block + warps] : 0;
  __syncthreads();  // q_s complete

  for (int b = first_block; b <= last_block; b += warps) {
    float s[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
#pragma unroll
    for (int c = 0; c < kKC; ++c) {
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        const uint4 qv = q_s[(nt * kKC + c) * 32 + lane];
        const unsigned a0[4] = {kr[0][c].x, kr[1][c].x, kr[0][c].y, kr[1][c].y};
        sm80::mma<T>(s[nt], a0, qv.x, qv.y);
        const unsigned a1[4] = {kr[0][c].z, kr[1][c].z, kr[0][c].w, kr[1][c].w};
        sm80::mma<T>(s[nt], a1, qv.z, qv.w);
      }
    }
    const bool more = b + warps <= last_block;
    if (more) load_k(next_id);

    // Online softmax per head over this block's 16 tokens (rows g and g+8 of S^T).
    const int tok = b * kBlockSize + g;
    const bool vis0 = tok >= lo && tok < end;
    const bool vis1 = tok + 8 >= lo && tok + 8 < end;
    float alpha[NT][2];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        // Masking selects, never multiplies: K slots past the sequence may hold NaN.
        const float s0 = vis0 ? s[nt][j] * p.scale_log2 : neg_inf();
        const float s1 = vis1 ? s[nt][j + 2] * p.scale_log2 : neg_inf();
        float mx = fmaxf(s0, s1);
        mx = fmaxf(mx, __shfl_xor_sync(kFullMask, mx, 4));
        mx = fmaxf(mx, __shfl_xor_sync(kFullMask, mx, 8));
        mx = fmaxf(mx, __shfl_xor_sync(kFullMask, mx, 16));
        const float m_new = fmaxf(row_m[nt][j], mx);
        const float ref = m_new == neg_inf() ? 0.f : m_new;  // a column with nothing visible stays 0
        alpha[nt][j] = fast_exp2(row_m[nt][j] - ref);
        const float p0 = fast_exp2(s0 - ref);
        const float p1 = fast_exp2(s1 - ref);
        row_l[nt][j] = row_l[nt][j] * alpha[nt][j] + (p0 + p1);
        row_m[nt][j] = m_new;
        s[nt][j] = p0;
        s[nt][j + 2] = p1;
      }
    }
    // V slots past the sequence may hold anything (even NaN): P is 0 there, but 0 * NaN is not.
    if (b * kBlockSize + kBlockSize > seq_len) {
#pragma unroll
      for (int t = 0; t < 4; ++t) {
        if (b * kBlockSize + 2 * q + (t & 1) + 8 * (t >> 1) >= seq_len) {
#pragma unroll
          for (int c = 0; c < kVC; ++c) vr[t][c] = make_uint4(0, 0, 0, 0);
        }
      }
    }
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        o[mt][nt][0] *= alpha[nt][0];
        o[mt][nt][1] *= alpha[nt][1];
        o[mt][nt][2] *= alpha[nt][0];
        o[mt][nt][3] *= alpha[nt][1];
      }
    }
    unsigned pb[NT][2];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const unsigned tok_g = sm80::pack<T>(s[nt][0], s[nt][1]);   // token g: heads 2q, 2q+1
      const unsigned tok_g8 = sm80::pack<T>(s[nt][2], s[nt][3]);  // token g+8
      const unsigned x0 = __shfl_sync(kFullMask, tok_g, src0);
      const unsigned x1 = __shfl_sync(kFullMask, tok_g, src1);
      const unsigned y0 = __shfl_sync(kFullMask, tok_g8, src0);
      const unsigned y1 = __shfl_sync(kFullMask, tok_g8, src1);
      pb[nt][0] = sm80::pick_halves(x0, x1, half_sel);
      pb[nt][1] = sm80::pick_halves(y0, y1, half_sel);
    }
    // O^T += V^T P^T. Row tile mt takes, per lane, dim (chunk cA, element eA) for row g and
    // (cB, eB) for row g+8; the epilogue inverts the same map.
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) {
      const int ca = HEAD == 64 ? 0 : 2 * (mt / 8);
      const int cb = HEAD == 64 ? 0 : ca + 1;
      const int ea = HEAD == 64 ? 2 * mt : mt % 8;
      const int eb = HEAD == 64 ? 2 * mt + 1 : mt % 8;
      const unsigned a[4] = {
          sm80::pick_halves(sm80::word(vr[0][ca], ea >> 1), sm80::word(vr[1][ca], ea >> 1), ea & 1),
          sm80::pick_halves(sm80::word(vr[0][cb], eb >> 1), sm80::word(vr[1][cb], eb >> 1), eb & 1),
          sm80::pick_halves(sm80::word(vr[2][ca], ea >> 1), sm80::word(vr[3][ca], ea >> 1), ea & 1),
          sm80::pick_halves(sm80::word(vr[2][cb], eb >> 1), sm80::word(vr[3][cb], eb >> 1), eb & 1)};
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) sm80::mma<T>(o[mt][nt], a, pb[nt]);
    }
    if (more) load_v(next_id);
    next_id = b + 2 * warps <= last_block ? block_table[b + 2 * warps] : 0;
  }

  // Park this warp's unnormalised output and row statistics for the merge of the block's warps.
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      float l = row_l[nt][j];
      l += __shfl_xor_sync(kFullMask, l, 4);
      l += __shfl_xor_sync(kFullMask, l, 8);
      l += __shfl_xor_sync(kFullMask, l, 16);
      const int h = nt * 8 + 2 * q + j;
      if (g == 0) {
        stat_m[warp * kRows + h] = row_m[nt][j];
        stat_l[warp * kRows + h] = l;
      }
#pragma unroll
      for (int c = 0; c < kVC; ++c) {
        float v[8];
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          const int mt = HEAD == 64 ? e >> 1 : 8 * (c >> 1) + e;
          const int upper = HEAD == 64 ? e & 1 : c & 1;
          v[e] = o[mt][nt][2 * upper + j];
        }
        float4* dst = reinterpret_cast<float4*>(o_s + (warp * kRows + h) * HEAD + 64 * c + 8 * g);
        dst[0] = make_float4(v[0], v[1], v[2], v[3]);
        dst[1] = make_float4(v[4], v[5], v[6], v[7]);
      }
    }
  }
  __syncthreads();

  const long long head0 = static_cast<long long>(seq) * p.num_heads + static_cast<long long>(kv_head) * group;
  T* out = static_cast<T*>(p.out) + seq * p.out_stride + static_cast<long long>(kv_head) * group * HEAD;
  auto store_out = [&](int h, int d, float4 v) {
    uint2 packed;
    packed.x = sm80::pack<T>(v.x, v.y);
    packed.y = sm80::pack<T>(v.z, v.w);
    *reinterpret_cast<uint2*>(out + h * HEAD + d) = packed;
  };
  constexpr int kQuads = HEAD / 4;
  for (int e = threadIdx.x; e < group * kQuads; e += blockDim.x) {
    const int h = e / kQuads, d = 4 * (e % kQuads);
    float m = neg_inf();
    for (int w = 0; w < warps; ++w) m = fmaxf(m, stat_m[w * kRows + h]);
    float l = 0.f;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int w = 0; w < warps; ++w) {
      const float wm = stat_m[w * kRows + h];
      const float f = merge_weight(wm, m);  // warps with no tokens add nothing
      l += stat_l[w * kRows + h] * f;
      const float4 v = *reinterpret_cast<const float4*>(o_s + (w * kRows + h) * HEAD + d);
      acc = make_float4(acc.x + v.x * f, acc.y + v.y * f, acc.z + v.z * f, acc.w + v.w * f);
    }
    const float inv = 1.f / l;
    acc = make_float4(acc.x * inv, acc.y * inv, acc.z * inv, acc.w * inv);
    if (num_splits == 1) {
      store_out(h, d, acc);
    } else {
      const long long idx = (head0 + h) * p.max_splits + split;
      *reinterpret_cast<float4*>(p.partial_out + idx * HEAD + d) = acc;
      if (d == 0) {
        p.partial_max[idx] = m;
        p.partial_sum[idx] = l;
      }
    }
  }
  if (num_splits == 1 || !p.fused_merge) return;

  // The last split to finish merges: every thread's partial writes are made visible device-wide
  // before one thread takes the ticket (the classic threadfence reduction).
  __threadfence();
  __syncthreads();
  int* ticket = p.tickets + static_cast<long long>(seq) * p.num_kv_heads + kv_head;
  if (threadIdx.x == 0) *merge_flag = atomicAdd(ticket, 1) == num_splits - 1;
  __syncthreads();
  if (!*merge_flag) return;
  __threadfence();
  // Output quads are fewer than threads: `ways` threads share each quad's splits (every thread keeps
  // up to 8 splits' loads in flight), and their running merges meet in shared memory (o_s is free now).
  const int items = group * kQuads;
  const int ways = items >= static_cast<int>(blockDim.x) ? 1 : static_cast<int>(blockDim.x) / items;
  const int slots = blockDim.x / ways;  // >= items whenever ways > 1
  const int way = threadIdx.x / slots;
  float* part = o_s;  // [ways][slots][6]: max, sum and four outputs of each way's merge
  for (int first = 0; first < items; first += slots) {
    const int e = first + static_cast<int>(threadIdx.x) % slots;
    const bool mine = e < items && way < ways;
    const int h = e / kQuads, d = 4 * (e % kQuads);
    float m = neg_inf(), l = 0.f;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    if (mine) {
      const long long idx0 = (head0 + h) * p.max_splits;
#pragma unroll 8
      for (int s = way; s < num_splits; s += ways) {
        const float sm = sm80::load_cg(p.partial_max + idx0 + s);  // finite: every split sees a token
        const float sl = sm80::load_cg(p.partial_sum + idx0 + s);
        const float4 so = sm80::load_cg(reinterpret_cast<const float4*>(p.partial_out + (idx0 + s) * HEAD + d));
        const float m_new = fmaxf(m, sm);
        const float fa = fast_exp2(m - m_new);
        const float fb = sl * fast_exp2(sm - m_new);
        l = l * fa + fb;
        acc = make_float4(acc.x * fa + so.x * fb, acc.y * fa + so.y * fb, acc.z * fa + so.z * fb,
                          acc.w * fa + so.w * fb);
        m = m_new;
      }
    }
    if (ways > 1) {  // block-uniform; the loop then runs once, so every thread meets the barrier
      if (mine) {
        float* mine_s = part + (way * slots + e) * 6;
        mine_s[0] = m;
        mine_s[1] = l;
        *reinterpret_cast<float2*>(mine_s + 2) = make_float2(acc.x, acc.y);
        *reinterpret_cast<float2*>(mine_s + 4) = make_float2(acc.z, acc.w);
      }
      __syncthreads();
      if (!mine || way != 0) continue;
      float mx = neg_inf();
      for (int w = 0; w < ways; ++w) mx = fmaxf(mx, part[(w * slots + e) * 6]);
      l = 0.f;
      acc = make_float4(0.f, 0.f, 0.f, 0.f);
      for (int w = 0; w < ways; ++w) {
        const float* other = part + (w * slots + e) * 6;
        const float f = merge_weight(other[0], mx);  // a way with no splits adds nothing
        l += other[1] * f;
        acc = make_float4(acc.x + other[2] * f, acc.y + other[3] * f, acc.z + other[4] * f, acc.w + other[5] * f);
      }
    } else if (!mine) {
      continue;
    }
    const float inv = 1.f / l;
    store_out(h, d, make_float4(acc.x * inv, acc.y * inv, acc.z * inv, acc.w * inv));
  }
  if (threadIdx.x == 0) *ticket = 0;  // ready for the next call (or graph replay)
}
#endif  // VOLTLLM_SM80_PATH

// grid: (num_kv_heads, num_seqs, max_splits), block: 32 * plan.warps threads,
// dynamic shared memory: DecodeV8Traits::smem_bytes(plan.warps).
template <typename T, int HEAD, int NT>
__global__ void __launch_bounds__(DecodeV8Traits<HEAD, NT>::kMaxThreads)
    paged_decode_v8_kernel(DecodeV8Params p) {
  begin_dependent_grid();
#ifdef VOLTLLM_SM80_PATH
  paged_decode_v8_block<T, HEAD, NT>(p);
#else
  __trap();  // SM80+ only: the Python layer runs v6 on older GPUs
#endif
}

}  // namespace voltllm
