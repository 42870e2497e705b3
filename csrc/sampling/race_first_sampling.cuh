// Race first, check after: one token per row under temperature and top-p in three launches (greedy and
// temperature-only rows in one), for batches in which no row uses top-k or min-p. It draws the token
// radix_sampling.cuh draws (the same race values g_i = x_i / T - log E_i, the same top-p set), with
// fewer passes over the row and no launch per select digit.
//
// The race's winner over *every* token is already the answer whenever it is in the top-p set, a set
// that holds at least p of the mass. So:
//
//   1. race_top_kernel: each block of a split pass finds its tokens' max (first index) and their best
//      kRaceCandidates race values; the row's last block merges the splits. Greedy rows get the first
//      argmax, temperature-only rows the race's winner: done. A top-p row keeps its candidates c_0 ..
//      c_{R-1} (best first) and their distances d_c = (max - x_c) / T.
//   2. race_mass_kernel: one split pass sums, in the select's fixed point (floor(e * 2^40), e = exp(-d)),
//      the row's mass and the mass below each candidate (the tokens with d < d_c). Candidate c is in the
//      top-p set iff mass{d < d_c} < target, the select's wanted mass max(1, floor(p * total)): the
//      set is {d <= K} for the smallest K whose {d <= K} reaches the target. The first candidate in race
//      order that is in the set is the race's winner over the set (every token with a better race value
//      is an earlier candidate, and out of it); the row's last block takes it.
//   3. race_finish_row_kernel: a row none of whose candidates is in the set (chance at most (1 - p)^R:
//      each candidate, given the ones before it were out, is a draw from what is left, which holds the
//      whole set) is finished by one block: the select over the row (its three digits in shared memory)
//      and the race over the set. Launched for every top-p batch; settled rows return at once.
//
// A pass's splits are merged by the row's last block to finish (a ticket per row, as the decode
// attention's split merge does), so every pass is one launch. The tickets are zero before a launch and
// every last block leaves its row's at zero (the glue keeps them per device and stream, zeroed once).
// The merges are exact (max and ranks by value, then index; masses in integers), so the token does not
// depend on the split sizes, hence not on the batch.
#pragma once

#include "sampling/radix_sampling.cuh"

namespace voltllm {

constexpr int kRaceCandidates = 4;   // race winners a top-p row checks before it needs the row's select
constexpr int kRaceThreads = 256;    // the split kernels' block (a power of two, 32..256)
constexpr int kFinishThreads = 512;  // race_finish_row_kernel's block
constexpr int kRaceMinSplitTokens = 1024;  // the glue's default: ~150 blocks for one Qwen3 row

// A race value and its token. Ranked by value, then by the lower token (what an argmax over the row
// in token order gives).
struct RaceEntry {
  float g;
  int token;
};
constexpr int kNoToken = 0x7fffffff;  // an empty entry: ranks below every token of the same value

__device__ __forceinline__ bool ranks_above(const RaceEntry& a, const RaceEntry& b) {
  return a.g > b.g || (a.g == b.g && a.token < b.token);
}

// A top-p row between the launches.
struct RaceRowState {
  float max_logit;                              // the row's best logit ...
  int argmax;                                   // ... and its first index
  int settled;                                  // nonzero: out[r] holds the row's token
  float candidate_d[kRaceCandidates];           // (max - x_c) / T of the candidates, best first (+inf: none)
  int candidate_token[kRaceCandidates];
  unsigned long long total;                     // the row's fixed-point mass (race_mass_kernel)
  unsigned long long below[kRaceCandidates];    // the mass of the tokens with d < candidate_d[c]
};

struct RaceParams {
  long long* out;                   // [rows] the sampled token ids
  const void* logits;               // [rows, vocab] of T, rows `logits_stride` elements apart
  long long logits_stride;
  const float* temperature;         // [rows]; <= 0: greedy; null: every row greedy
  const float* top_p;               // [rows]; >= 1: off; null: off for every row
  const unsigned long long* seeds;  // [rows] the noise seed of each row's draw (null when every row is greedy)
  float* split_max;                 // [rows, splits] scratch: each split's max ...
  int* split_argmax;                // [rows, splits] ... and its first index
  RaceEntry* split_top;             // [rows, splits, kRaceCandidates] scratch: each split's best race values
  RaceRowState* state;              // [rows] scratch
  unsigned* tickets;                // [rows] zero before every launch, left zero after it
  int splits;                       // blocks per row of the split passes
  int split_tokens;                 // tokens per split (the last one may have fewer)
  int vocab;
};

// Shared memory of the race kernels.
struct RaceShared {
  float score[32];  // block_argmax's per-warp scratch
  int index[32];
  RaceEntry entries[32 * kRaceCandidates];  // each warp's best, then the block's
  unsigned long long scan[32];              // block_exclusive_scan's scratch
  bool last_block;
};
__device__ const int race_smem_bytes_probe = sizeof(RaceShared);  // for the sm70 gate's report

__device__ __forceinline__ bool race_greedy_row(const RaceParams& p, int r) {
  return p.temperature == nullptr || !(p.temperature[r] > 0.f);
}
__device__ __forceinline__ bool race_top_p_row(const RaceParams& p, int r) {
  return !race_greedy_row(p, r) && p.top_p != nullptr && p.top_p[r] < 1.f;
}

// Puts `entry` into a list ranked best first, if it ranks above the list's last.
template <int N>
__device__ __forceinline__ void insert_ranked(RaceEntry (&list)[N], RaceEntry entry) {
  if (!ranks_above(entry, list[N - 1])) return;
#pragma unroll
  for (int k = 0; k < N; ++k) {
    if (ranks_above(entry, list[k])) {
      const RaceEntry pushed = list[k];
      list[k] = entry;
      entry = pushed;
    }
  }
}

template <int N>
__device__ __forceinline__ void clear_ranked(RaceEntry (&list)[N]) {
#pragma unroll
  for (int k = 0; k < N; ++k) list[k] = RaceEntry{neg_inf(), kNoToken};
}

// The best N entries of the warp's lanes' lists (each ranked best first), to every lane in `best`:
// N rounds, each a warp-wide max of the lanes' heads, the winner's lane dropping its head. (Tokens are
// distinct, so only empty entries tie, and dropping any of those changes nothing.)
template <int N>
__device__ __forceinline__ void warp_best(RaceEntry (&list)[N], RaceEntry (&best)[N]) {
#pragma unroll
  for (int k = 0; k < N; ++k) {
    RaceEntry top = list[0];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const RaceEntry other{__shfl_xor_sync(0xffffffffu, top.g, o), __shfl_xor_sync(0xffffffffu, top.token, o)};
      if (ranks_above(other, top)) top = other;
    }
    best[k] = top;
    if (list[0].token == top.token && list[0].g == top.g) {
#pragma unroll
      for (int j = 0; j + 1 < N; ++j) list[j] = list[j + 1];
      list[N - 1] = RaceEntry{neg_inf(), kNoToken};
    }
  }
}

// The block's best N entries of its threads' lists, left in s.entries[0 .. N) (read after the call).
template <int N>
__device__ void block_best(RaceEntry (&list)[N], RaceShared& s) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int num_warps = blockDim.x >> 5;
  RaceEntry best[N];
  warp_best(list, best);
  if (lane == 0) {
#pragma unroll
    for (int k = 0; k < N; ++k) s.entries[warp * N + k] = best[k];
  }
  __syncthreads();
  if (warp == 0) {
    clear_ranked(list);
    for (int i = lane; i < num_warps * N; i += 32) insert_ranked(list, s.entries[i]);
    warp_best(list, best);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
#pragma unroll
    for (int k = 0; k < N; ++k) s.entries[k] = best[k];
  }
  __syncthreads();
}

// Counts this block done with its row's pass; true in the row's last block (in every thread), which
// then sees every block's writes and leaves the ticket at zero for the next launch.
__device__ __forceinline__ bool last_block_of_row(unsigned* ticket, int splits, RaceShared& s) {
  __threadfence();  // this block's partial results are visible before it counts itself done
  __syncthreads();
  if (threadIdx.x == 0) {
    s.last_block = atomicAdd(ticket, 1u) == static_cast<unsigned>(splits) - 1;
    if (s.last_block) *ticket = 0;
  }
  __syncthreads();
  if (!s.last_block) return false;
  __threadfence();
  return true;
}

// The first pass for rows that keep N race candidates (0: greedy, 1: temperature only, kRaceCandidates:
// top-p): block (row, split) reduces its tokens, the row's last block the splits.
template <typename T, int N>
__device__ void race_top_pass(const RaceParams& p, int r, RaceShared& s) {
  const T* row = static_cast<const T*>(p.logits) + static_cast<long long>(r) * p.logits_stride;
  const float inv_t = N > 0 ? 1.f / p.temperature[r] : 1.f;
  const unsigned long long seed = N > 0 ? p.seeds[r] : 0ull;
  constexpr int kList = N > 0 ? N : 1;
  RaceEntry list[kList];
  clear_ranked(list);
  const int begin = blockIdx.y * p.split_tokens;
  float best = neg_inf();
  int index = begin;
  for_each_logit_in(row, begin, min(p.vocab, begin + p.split_tokens), [&](int i, float x) {
    if (x > best) {  // ascending per thread: the first of equal values
      best = x;
      index = i;
    }
    if constexpr (N > 0) insert_ranked(list, RaceEntry{race_value(x, inv_t, seed, i), i});
  });
  index = block_argmax(best, index, s.score, s.index);
  if constexpr (N > 0) block_best(list, s);
  const long long split = static_cast<long long>(r) * p.splits + blockIdx.y;
  if (threadIdx.x == 0) {
    p.split_max[split] = best;
    p.split_argmax[split] = index;
    for (int k = 0; k < N; ++k) p.split_top[split * kRaceCandidates + k] = s.entries[k];
  }
  if (!last_block_of_row(p.tickets + r, p.splits, s)) return;
  // The row's splits, merged: the max (the lowest index of equal maxima) and the best N race values.
  const long long first = static_cast<long long>(r) * p.splits;
  best = neg_inf();
  index = kNoToken;
  clear_ranked(list);
  for (int i = threadIdx.x; i < p.splits; i += blockDim.x) {
    const float v = __ldcg(p.split_max + first + i);
    const int at = __ldcg(p.split_argmax + first + i);
    if (v > best || (v == best && at < index)) {
      best = v;
      index = at;
    }
    for (int k = 0; k < N; ++k) {
      const RaceEntry* e = p.split_top + (first + i) * kRaceCandidates + k;
      insert_ranked(list, RaceEntry{__ldcg(&e->g), __ldcg(&e->token)});
    }
  }
  index = block_argmax(best, index, s.score, s.index);
  if constexpr (N > 0) block_best(list, s);
  if (threadIdx.x != 0) return;
  RaceRowState& st = p.state[r];
  if (N != kRaceCandidates || best == neg_inf()) {  // greedy, temperature only, or a row of -inf
    p.out[r] = N == 0 || best == neg_inf() ? index : s.entries[0].token;
    st.settled = 1;
    return;
  }
  st.settled = 0;
  st.max_logit = best;
  st.argmax = index;
  st.total = 0;
  for (int k = 0; k < kRaceCandidates; ++k) {
    const RaceEntry e = s.entries[k];
    const bool real = e.token != kNoToken;
    st.candidate_token[k] = e.token;
    st.candidate_d[k] = real ? (best - logit_at(row, e.token)) * inv_t : __int_as_float(0x7f800000);
    st.below[k] = 0;
  }
}

// Pass 1, every row. Launch: grid (rows, splits), kRaceThreads threads, sizeof(RaceShared).
template <typename T>
__global__ void __launch_bounds__(kRaceThreads) race_top_kernel(RaceParams p) {
  begin_dependent_grid();
  VOLTLLM_DYNAMIC_SMEM(smem_raw);
  RaceShared& s = *reinterpret_cast<RaceShared*>(smem_raw);
  const int r = blockIdx.x;
  if (race_greedy_row(p, r)) {
    race_top_pass<T, 0>(p, r, s);
  } else if (race_top_p_row(p, r)) {
    race_top_pass<T, kRaceCandidates>(p, r, s);
  } else {
    race_top_pass<T, 1>(p, r, s);
  }
}

// Pass 2, top-p rows: block (row, split) adds its tokens' mass and their mass below each candidate to
// the row's; the row's last block takes the first candidate in the top-p set, if any. Launch: grid
// (rows, splits), kRaceThreads threads, sizeof(RaceShared).
template <typename T>
__global__ void __launch_bounds__(kRaceThreads) race_mass_kernel(RaceParams p) {
  begin_dependent_grid();
  const int r = blockIdx.x;
  if (!race_top_p_row(p, r)) return;
  RaceRowState& st = p.state[r];
  if (st.settled) return;  // a row of -inf logits
  VOLTLLM_DYNAMIC_SMEM(smem_raw);
  RaceShared& s = *reinterpret_cast<RaceShared*>(smem_raw);
  const T* row = static_cast<const T*>(p.logits) + static_cast<long long>(r) * p.logits_stride;
  const float max_logit = st.max_logit;
  const float inv_t = 1.f / p.temperature[r];
  float candidate_d[kRaceCandidates];
#pragma unroll
  for (int k = 0; k < kRaceCandidates; ++k) candidate_d[k] = st.candidate_d[k];
  unsigned long long total = 0;
  unsigned long long below[kRaceCandidates] = {};
  const int begin = blockIdx.y * p.split_tokens;
  for_each_logit_in(row, begin, min(p.vocab, begin + p.split_tokens), [&](int, float x) {
    const float d = (max_logit - x) * inv_t;
    const unsigned long long w = fixed_mass(d);
    total += w;
#pragma unroll
    for (int k = 0; k < kRaceCandidates; ++k) below[k] += d < candidate_d[k] ? w : 0ull;
  });
  unsigned long long sum;
  block_exclusive_scan(total, s.scan, sum);
  if (threadIdx.x == 0 && sum != 0) atomicAdd(&st.total, sum);
#pragma unroll
  for (int k = 0; k < kRaceCandidates; ++k) {
    block_exclusive_scan(below[k], s.scan, sum);
    if (threadIdx.x == 0 && sum != 0) atomicAdd(&st.below[k], sum);
  }
  if (!last_block_of_row(p.tickets + r, p.splits, s) || threadIdx.x != 0) return;
  const unsigned long long mass = __ldcg(&st.total);
  unsigned long long target =
      static_cast<unsigned long long>(static_cast<double>(p.top_p[r]) * static_cast<double>(mass));
  target = target < 1 ? 1 : target > mass ? mass : target;
  for (int k = 0; k < kRaceCandidates; ++k) {
    if (__ldcg(&st.below[k]) < target) {  // (an empty candidate has d = +inf: below = total, never kept)
      p.out[r] = st.candidate_token[k];
      st.settled = 1;
      return;
    }
  }
}

// This thread's d values of a whole row (batched loads), for select_in_block.
template <typename T>
struct RowDs {
  const T* row;
  int vocab;
  float max_logit;
  float inv_t;
  template <typename Fn>
  __device__ __forceinline__ void operator()(Fn&& fn) const {
    for_each_logit_in(row, 0, vocab, [&](int, float x) { fn((max_logit - x) * inv_t); });
  }
};

// Pass 3, top-p rows that pass 2 left: one block selects the row's top-p set (the three digits of
// select_digit_kernel, in shared memory) and races it. Launch: one block of kFinishThreads threads per
// row, sizeof(SelectShared).
template <typename T>
__global__ void __launch_bounds__(kFinishThreads) race_finish_row_kernel(RaceParams p) {
  begin_dependent_grid();
  const int r = blockIdx.x;
  if (!race_top_p_row(p, r)) return;
  RaceRowState& st = p.state[r];
  if (st.settled) return;
  VOLTLLM_DYNAMIC_SMEM(smem_raw);
  SelectShared& s = *reinterpret_cast<SelectShared*>(smem_raw);
  const T* row = static_cast<const T*>(p.logits) + static_cast<long long>(r) * p.logits_stride;
  const float max_logit = st.max_logit;
  const float inv_t = 1.f / p.temperature[r];
  const RowDs<T> row_ds{row, p.vocab, max_logit, inv_t};
  const unsigned ceiling = select_in_block(row_ds, 0xffffffffu, p.top_p[r], st.total, s);
  const unsigned long long seed = p.seeds[r];
  float score = neg_inf();
  int index = st.argmax;
  for_each_logit_in(row, 0, p.vocab, [&](int i, float x) {
    if (__float_as_uint((max_logit - x) * inv_t) > ceiling) return;
    const float race = race_value(x, inv_t, seed, i);
    if (race > score || (race == score && i < index)) {
      score = race;
      index = i;
    }
  });
  index = block_argmax(score, index, s.scan_score, s.scan_index);
  if (threadIdx.x == 0) {
    p.out[r] = index;
    st.settled = 1;
  }
}

}  // namespace voltllm
