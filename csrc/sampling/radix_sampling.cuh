// One token per row from a step's logits: temperature, top-k, top-p and min-p without sorting the
// vocabulary, and noise that depends only on the row's seed and the token id.
//
// Every draw is the exponential race: the argmax over the kept tokens of log(weight) - log(E_i),
// E_i ~ Exp(1), is an exact draw in proportion to the weights; here the race value of token i is
// g_i = x_i / T - log(E_i) (race_value), whatever the filters (they only decide which tokens take part).
// E_i comes from a counter-based hash of (row seed, token id), so a row's draw depends on its seed alone,
// not on the batch, the block size or the order threads run in. (race_first_sampling.cuh draws top-p
// rows another way, with the same race values, so both give the same token.)
//
// Every pass over a row is split over blocks (`split_tokens` tokens each: many splits at batch 1, so
// that a draw uses the whole GPU, fewer as the batch grows), and a row costs about the same whatever
// its logits look like. Greedy rows (the first argmax of x) and rows with only a temperature (the race
// over x / T) take one split pass, race_partial_kernel writing each split's winner and
// race_merge_kernel picking the row's. Rows with a filter first find the row's max
// (row_max_partial_kernel, row_max_merge_kernel). A filter is expressed through each token's distance
// from the best logit in units of temperature, d = (max - x) * (1 / T) >= 0, and its relative
// probability e = exp(-d):
//
//   - top-k: a radix select over the bit patterns of d (a non-negative float's bits order like the
//     float) finds the k-th smallest d, K_k, one 11/11/10-bit digit per select_digit_kernel launch:
//     every block counts its tokens per bin into shared memory and adds its bins to the row's global
//     histogram; the row's last block to finish picks the digit's bin (a tiny grid-wide step);
//   - top-p: the same select with per-bin mass (fixed point, floor(e * 2^40): exact and order-free)
//     over {d <= K_k} finds the smallest K_p whose set {d <= K_p} holds at least p of that set's mass;
//   - min-p keeps e >= min_p;
//   - the race over the kept tokens (g_i, as every row's), split like the others.
//
// Most rows with top-p (or top-k) are decided by few tokens: after top-k, one split pass
// (gather_candidates_kernel) lists the tokens that can be in the top-p set at all (e >= (1 - p) / V:
// the others together hold less than 1 - p of the mass; with top-k alone, the top-k set) and sums the
// kept mass; a row whose list fits (kMaxCandidates) is finished by one block over the list
// (finish_candidates_kernel: the top-p select and the race) and skips the passes over the row. A nearly
// flat row lists nearly every token and takes the split top-p select and race.
//
// Ties at a threshold are kept whole (the sets are defined by values, not positions). The torch
// reference (voltllm/ops/sampling.py, `sample_tokens_ref`) computes the same sets and the same noise.
#pragma once

#include "common.cuh"

namespace voltllm {

constexpr int kSampleBins = 2048;                     // 11-bit digits
constexpr float kSampleMassScale = 1099511627776.0f;  // 2^40: e in (0, 1] as a fixed-point integer (exact)
constexpr int kMinSplitTokens = 4096;                 // the fewest tokens a block of a split pass takes
constexpr int kSplitThreads = 256;                    // the split kernels' block (a power of two, 32..256)
constexpr int kSplitBlocksWanted = 1024;              // grid size the glue aims at (rows x splits)
constexpr int kLoadBatch = 4;                         // loads a thread issues before it uses them
constexpr int kMaxCandidates = 8192;                  // a row's candidate list (fewer for a smaller vocabulary)
constexpr int kSelectDigits = 3;                      // digits of a select: bits 31..21, 20..10, 9..0

// A filtered row's progress, carried from one launch to the next in global memory.
struct SelectState {
  float max_logit;                // the row's best logit; -inf once the row is settled (its logits are
                                  // all -inf, or finish_candidates_kernel drew its token)
  int argmax;                     // its first index
  unsigned ceiling;               // keys (bits of d) <= ceiling are kept: top-k's K_k, then top-p's K_p
  unsigned prefix;                // the digits the select in progress has fixed so far ...
  unsigned prefix_mask;           // ... and which bits they are
  unsigned long long remaining;   // the weight it still wants among the keys with that prefix
};

struct SampleParams {
  long long* out;                   // [rows] the sampled token ids
  const void* logits;               // [rows, vocab] of T, rows `logits_stride` elements apart
  long long logits_stride;
  const float* temperature;         // [rows]; <= 0: greedy
  const int* top_k;                 // [rows]; <= 0 or >= vocab: off; null: off for every row
  const float* top_p;               // [rows]; >= 1: off; null: off for every row
  const float* min_p;               // [rows]; <= 0: off; null: off for every row
  const unsigned long long* seeds;  // [rows] the noise seed of each row's draw
  float* split_score;               // [rows, splits] scratch: each split's best value (max or race) ...
  int* split_index;                 // [rows, splits] ... and its token
  unsigned long long* histogram;    // [rows, kSampleBins] scratch, zeroed by row_max_merge_kernel (splits > 1)
  unsigned* blocks_done;            // [rows] scratch: blocks of the current digit that have added theirs
  SelectState* state;               // [rows] scratch
  float* candidate_d;               // [rows, candidate_capacity] scratch: a row's candidates' d ...
  int* candidate_token;             // [rows, candidate_capacity] ... and tokens, in no order
  unsigned* num_candidates;         // [rows] scratch (may exceed the capacity: then the row has no list)
  unsigned long long* kept_mass;    // [rows] scratch: the mass of the tokens top-k kept
  int candidate_capacity;           // min(kMaxCandidates, vocab)
  int splits;                       // blocks per row of every split pass (split_sizes below)
  int split_tokens;                 // tokens per split (the last one may have fewer)
  int vocab;
};

// Shared memory of select_digit_kernel: the block's histogram, each 64-bit bin as two 32-bit words
// (64-bit shared atomics are compare-and-swap loops; 32-bit adds are native), and the scan scratch.
struct SelectShared {
  unsigned lo[kSampleBins];
  unsigned hi[kSampleBins];
  unsigned long long scan[32];
  float scan_score[32];  // block_argmax's per-warp scratch
  int scan_index[32];
  unsigned long long remaining;
  unsigned chosen_bin;
  bool last_block;
};

// Shared memory of the other split kernels: one (value, index) per warp.
struct ArgmaxShared {
  float score[32];
  int index[32];
};
__device__ const int select_smem_bytes_probe = sizeof(SelectShared);  // for the sm70 gate's report

// Splits per row and tokens per split for `rows` rows of `vocab` tokens: about kSplitBlocksWanted
// blocks in all, at least `min_split_tokens` tokens a block. The draw does not depend on it.
__host__ __device__ inline void split_sizes(long long rows, int vocab, int& splits, int& split_tokens,
                                            int min_split_tokens = kMinSplitTokens) {
  const long long most = (vocab + min_split_tokens - 1) / min_split_tokens;
  long long wanted = (kSplitBlocksWanted + rows - 1) / rows;
  wanted = wanted < 1 ? 1 : wanted > most ? most : wanted;
  split_tokens = static_cast<int>((vocab + wanted - 1) / wanted);
  splits = static_cast<int>((vocab + split_tokens - 1) / split_tokens);
}
__device__ const int argmax_smem_bytes_probe = sizeof(ArgmaxShared);

__device__ __forceinline__ unsigned long long splitmix64(unsigned long long x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebULL;
  x ^= x >> 31;
  return x;
}

// E ~ Exp(1) for token `token` of a row seeded `seed`: v uniform in (0, 1] from 32 hash bits (| 1 keeps
// it off 0; the conversion rounds to nearest, as torch's does), E = -log(1 - v).
__device__ __forceinline__ float exponential_noise(unsigned long long seed, int token) {
  const unsigned long long h = splitmix64(seed + static_cast<unsigned long long>(token + 1) * 0x9e3779b97f4a7c15ULL);
  const float v = __uint2float_rn(static_cast<unsigned>(h >> 32) | 1u) * 2.3283064365386963e-10f;  // 2^-32
  return -log1pf(-v);
}

// Token `token`'s race value, x / T - log E. The product is never fused into the subtraction, so that
// every kernel that races (and the torch reference) computes the same bits.
__device__ __forceinline__ float race_value(float x, float inv_t, unsigned long long seed, int token) {
  return __fmul_rn(x, inv_t) - logf(exponential_noise(seed, token));
}

template <typename T>
__device__ __forceinline__ float logit_at(const T* row, int i) {
  if constexpr (is_same<T, float>::value) {
    return row[i];
  } else {
    return DType<T>::to_float(row[i]);
  }
}

// Row classes. Greedy rows take the first argmax and temperature-only rows race over x / T, both in the
// race kernels alone; the others ("filtered") go through the max, the selects their filters ask for,
// and the race over the kept set.
__device__ __forceinline__ bool greedy_row(const SampleParams& p, int r) { return !(p.temperature[r] > 0.f); }
__device__ __forceinline__ bool top_k_on(const SampleParams& p, int r) {
  return p.top_k != nullptr && p.top_k[r] > 0 && p.top_k[r] < p.vocab;
}
__device__ __forceinline__ bool top_p_on(const SampleParams& p, int r) { return p.top_p != nullptr && p.top_p[r] < 1.f; }
__device__ __forceinline__ float min_p_of(const SampleParams& p, int r) { return p.min_p != nullptr ? p.min_p[r] : 0.f; }
__device__ __forceinline__ bool filtered_row(const SampleParams& p, int r) {
  return !greedy_row(p, r) && (top_k_on(p, r) || top_p_on(p, r) || min_p_of(p, r) > 0.f);
}

__device__ __forceinline__ unsigned long long fixed_mass(float d) {
  return static_cast<unsigned long long>(expf(-d) * kSampleMassScale);
}

// Block-wide (value, index) argmax; ties go to the lower index. Every thread gets the winner's index
// (and `value` the winner's value). `score`/`index` hold one entry per warp.
__device__ __forceinline__ int block_argmax(float& value, int index, float* score, int* indices) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int num_warps = blockDim.x >> 5;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float v = __shfl_xor_sync(0xffffffffu, value, o);
    const int i = __shfl_xor_sync(0xffffffffu, index, o);
    if (v > value || (v == value && i < index)) {
      value = v;
      index = i;
    }
  }
  if (lane == 0) {
    score[warp] = value;
    indices[warp] = index;
  }
  __syncthreads();
  float best = score[0];
  int best_index = indices[0];
  for (int w = 1; w < num_warps; ++w) {
    if (score[w] > best || (score[w] == best && indices[w] < best_index)) {
      best = score[w];
      best_index = indices[w];
    }
  }
  __syncthreads();
  value = best;
  return best_index;
}

// Block-wide exclusive prefix sum of one value per thread (in thread order); `total` gets the sum.
// `scan` holds one entry per warp.
__device__ __forceinline__ unsigned long long block_exclusive_scan(unsigned long long v, unsigned long long* scan,
                                                                  unsigned long long& total) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int num_warps = blockDim.x >> 5;
  unsigned long long inclusive = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const unsigned long long up = __shfl_up_sync(0xffffffffu, inclusive, o);
    if (lane >= o) inclusive += up;
  }
  if (lane == 31) scan[warp] = inclusive;
  __syncthreads();
  unsigned long long before = 0;
  total = 0;
  for (int w = 0; w < num_warps; ++w) {
    if (w < warp) before += scan[w];
    total += scan[w];
  }
  __syncthreads();
  return before + inclusive - v;
}

// One warp reduces a row's per-split (value, index) pairs to the best value's lowest index (to every lane).
__device__ __forceinline__ int merge_splits(const SampleParams& p, int r, float& score) {
  score = neg_inf();
  int index = 0x7fffffff;
  const long long base = static_cast<long long>(r) * p.splits;
  for (int split = threadIdx.x; split < p.splits; split += 32) {
    const float v = p.split_score[base + split];
    const int i = p.split_index[base + split];
    if (v > score || (v == score && i < index)) {
      score = v;
      index = i;
    }
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float v = __shfl_xor_sync(0xffffffffu, score, o);
    const int i = __shfl_xor_sync(0xffffffffu, index, o);
    if (v > score || (v == score && i < index)) {
      score = v;
      index = i;
    }
  }
  return index;
}

// Calls fn(i, x_i) for this thread's tokens of [begin, end): ascending, blockDim.x apart. Loads go
// kLoadBatch at a time before any is used, so that a thread keeps several in flight.
template <typename T, typename Fn>
__device__ __forceinline__ void for_each_logit_in(const T* row, int begin, int end, Fn&& fn) {
  const int stride = blockDim.x;
  for (int base = begin + threadIdx.x; base < end; base += kLoadBatch * stride) {
    float x[kLoadBatch];
#pragma unroll
    for (int u = 0; u < kLoadBatch; ++u) {
      const int i = base + u * stride;
      x[u] = i < end ? logit_at(row, i) : 0.f;
    }
#pragma unroll
    for (int u = 0; u < kLoadBatch; ++u) {
      const int i = base + u * stride;
      if (i < end) fn(i, x[u]);
    }
  }
}

// for_each_logit_in over block (row, split)'s tokens.
template <typename T, typename Fn>
__device__ __forceinline__ void for_each_logit(const SampleParams& p, const T* row, Fn&& fn) {
  const int begin = blockIdx.y * p.split_tokens;
  for_each_logit_in(row, begin, min(p.vocab, begin + p.split_tokens), fn);
}

__device__ __forceinline__ void write_split(const SampleParams& p, int r, float score, int index) {
  if (threadIdx.x == 0) {
    p.split_score[static_cast<long long>(r) * p.splits + blockIdx.y] = score;
    p.split_index[static_cast<long long>(r) * p.splits + blockIdx.y] = index;
  }
}

// Filtered rows, first pass: block (row, split) writes the max of its tokens and its first index.
// Launch: grid (rows, splits), kSplitThreads threads, sizeof(ArgmaxShared).
template <typename T>
__global__ void __launch_bounds__(kSplitThreads) row_max_partial_kernel(SampleParams p) {
  begin_dependent_grid();
  const int r = blockIdx.x;
  if (!filtered_row(p, r)) return;
  VOLTLLM_DYNAMIC_SMEM(smem_raw);
  ArgmaxShared& s = *reinterpret_cast<ArgmaxShared*>(smem_raw);
  const T* row = static_cast<const T*>(p.logits) + static_cast<long long>(r) * p.logits_stride;
  float best = neg_inf();
  int index = blockIdx.y * p.split_tokens;
  for_each_logit(p, row, [&](int i, float x) {
    if (x > best) {  // ascending per thread: the first of equal values
      best = x;
      index = i;
    }
  });
  index = block_argmax(best, index, s.score, s.index);
  write_split(p, r, best, index);
}

// Filtered rows, second step: one warp per row merges the splits into the row's select state and zeroes
// its histogram. A row whose logits are all -inf gets its token (the first) here. Launch: one block of
// 32 threads per row.
__global__ void __launch_bounds__(32) row_max_merge_kernel(SampleParams p) {
  begin_dependent_grid();
  const int r = blockIdx.x;
  if (!filtered_row(p, r)) return;
  float best;
  const int argmax = merge_splits(p, r, best);
  const bool settled = best == neg_inf();
  if (threadIdx.x == 0) {
    if (settled) p.out[r] = argmax;
    SelectState& st = p.state[r];
    st.max_logit = settled ? neg_inf() : best;
    st.argmax = argmax;
    st.ceiling = 0xffffffffu;
    st.prefix = 0;
    st.prefix_mask = 0;
    st.remaining = top_k_on(p, r) ? static_cast<unsigned long long>(p.top_k[r]) : 0ull;
    p.blocks_done[r] = 0;
    p.num_candidates[r] = 0;
    p.kept_mass[r] = 0;
  }
  if (settled || !(top_k_on(p, r) || top_p_on(p, r)) || p.splits == 1) return;
  unsigned long long* hist = p.histogram + static_cast<long long>(r) * kSampleBins;
  for (int b = threadIdx.x; b < kSampleBins; b += 32) hist[b] = 0;
}

constexpr unsigned kNoBin = 0xffffffffu;

// A thread's pending histogram add: consecutive tokens of a thread that fall in one bin are summed in a
// register and added once. On a flat row nearly every token lands in one bin of the first digit, and
// atomics on one address serialize; elsewhere bins change often and this costs one compare.
struct PendingBin {
  unsigned bin = kNoBin;
  unsigned long long weight = 0;
  __device__ __forceinline__ void add(unsigned b, unsigned long long w, SelectShared& s) {
    if (b != bin) {
      flush(s);
      bin = b;
    }
    weight += w;
  }
  // The low word's add returns the old word: a wrap carries into the high word, so hi:lo stays exact.
  __device__ __forceinline__ void flush(SelectShared& s) {
    if (weight == 0) return;
    const unsigned low = static_cast<unsigned>(weight);
    const unsigned old = atomicAdd(&s.lo[bin], low);
    const unsigned high = static_cast<unsigned>(weight >> 32) + (old + low < old ? 1u : 0u);
    if (high != 0) atomicAdd(&s.hi[bin], high);
    weight = 0;
  }
};

__device__ __forceinline__ unsigned long long shared_bin(const SelectShared& s, int b) {
  return (static_cast<unsigned long long>(s.hi[b]) << 32) | s.lo[b];
}

// The bits of digit `level` (most significant first) and where they sit.
__device__ __forceinline__ int digit_shift(int level) { return level == 0 ? 21 : level == 1 ? 10 : 0; }
__device__ __forceinline__ unsigned digit_mask(int level) { return level == 2 ? 0x3ffu : 0x7ffu; }

// The bin of a histogram (bin b's weight: weight(b)) where the weight of the smaller bins reaches
// `remaining` (with share >= 0, `remaining` is instead share * the histogram's total, at least 1): left
// in s.chosen_bin, and what is still wanted inside it in s.remaining (both read after the call).
template <typename Weight>
__device__ void find_bin(Weight&& weight, unsigned long long remaining, double share, SelectShared& s) {
  const int per_thread = kSampleBins / blockDim.x;
  const int first = threadIdx.x * per_thread;
  unsigned long long run = 0;
  for (int b = first; b < first + per_thread; ++b) run += weight(b);
  unsigned long long total;
  const unsigned long long before = block_exclusive_scan(run, s.scan, total);
  if (share >= 0.0) {
    remaining = static_cast<unsigned long long>(share * static_cast<double>(total));
    remaining = remaining < 1 ? 1 : remaining;
  }
  if (remaining > total) remaining = total;  // fixed-point rounding at the last bin: keep everything
  if (threadIdx.x == 0) {
    s.chosen_bin = kSampleBins - 1;  // overwritten below: some run always holds the wanted weight
    s.remaining = remaining;
  }
  __syncthreads();
  if (before < remaining && remaining <= before + run) {
    unsigned long long acc = before;
    for (int b = first; b < first + per_thread; ++b) {
      const unsigned long long w = weight(b);
      acc += w;
      if (acc >= remaining) {
        s.chosen_bin = b;
        s.remaining = remaining - (acc - w);
        break;
      }
    }
  }
  __syncthreads();
}

// The row's last block of a digit: picks the bin where the weight of the smaller keys reaches what is
// still wanted, fixes it in the state, and leaves the histogram and the block count zeroed for the
// next digit. At the first digit of a top-p select the wanted weight is top_p of the whole set's.
template <bool MASS>
__device__ void choose_bin(const SampleParams& p, int r, int level, SelectState& st, SelectShared& s) {
  // The row's histogram: in global memory (other blocks' atomics: read from L2), or with one split
  // this block's own.
  volatile unsigned long long* hist = p.histogram + static_cast<long long>(r) * kSampleBins;
  auto weight = [&](int b) { return p.splits > 1 ? hist[b] : shared_bin(s, b); };
  find_bin(weight, st.remaining, MASS && level == 0 ? static_cast<double>(p.top_p[r]) : -1.0, s);
  if (p.splits > 1) {
    for (int b = threadIdx.x; b < kSampleBins; b += blockDim.x) hist[b] = 0;  // ready for the next digit
  }
  if (threadIdx.x != 0) return;
  const unsigned prefix = st.prefix | (s.chosen_bin << digit_shift(level));
  if (level == kSelectDigits - 1) {  // the select is done: its threshold becomes the ceiling
    st.ceiling = prefix;
    st.prefix = 0;
    st.prefix_mask = 0;
    st.remaining = 0;
  } else {
    st.prefix = prefix;
    st.prefix_mask |= digit_mask(level) << digit_shift(level);
    st.remaining = s.remaining;
  }
  p.blocks_done[r] = 0;
}

// One digit of a filtered row's top-k (MASS = false: counts) or top-p (MASS = true: fixed-point
// masses) select. Block (row, split) builds the histogram of its tokens with key <= ceiling and the
// digits fixed so far, adds its nonzero bins to the row's, and the last block to finish picks the bin.
// Launch: grid (rows, splits), kSplitThreads threads, sizeof(SelectShared); the digits in order, each
// its own launch (level 0, 1, 2).
template <typename T, bool MASS>
__global__ void __launch_bounds__(kSplitThreads) select_digit_kernel(SampleParams p, int level) {
  begin_dependent_grid();
  const int r = blockIdx.x;
  if (greedy_row(p, r) || !(MASS ? top_p_on(p, r) : top_k_on(p, r))) return;  // (a filtered row, then)
  SelectState& st = p.state[r];
  const float max_logit = st.max_logit;
  if (max_logit == neg_inf()) return;  // settled by row_max_merge_kernel
  VOLTLLM_DYNAMIC_SMEM(smem_raw);
  SelectShared& s = *reinterpret_cast<SelectShared*>(smem_raw);
  for (int b = threadIdx.x; b < kSampleBins; b += blockDim.x) s.lo[b] = s.hi[b] = 0;
  __syncthreads();
  const T* row = static_cast<const T*>(p.logits) + static_cast<long long>(r) * p.logits_stride;
  const float inv_t = 1.f / p.temperature[r];
  const unsigned ceiling = st.ceiling;
  const unsigned prefix = st.prefix;
  const unsigned prefix_mask = st.prefix_mask;
  const int shift = digit_shift(level);
  const unsigned mask = digit_mask(level);
  PendingBin pending;
  for_each_logit(p, row, [&](int, float x) {
    const float d = (max_logit - x) * inv_t;
    const unsigned key = __float_as_uint(d);
    if (key > ceiling || (key & prefix_mask) != prefix) return;
    const unsigned long long w = MASS ? fixed_mass(d) : 1ull;
    if (w != 0) pending.add((key >> shift) & mask, w, s);  // (a mass that rounds to 0 adds nothing)
  });
  pending.flush(s);
  __syncthreads();
  if (p.splits > 1) {
    unsigned long long* hist = p.histogram + static_cast<long long>(r) * kSampleBins;
    for (int b = threadIdx.x; b < kSampleBins; b += blockDim.x) {
      const unsigned long long w = shared_bin(s, b);
      if (w != 0) atomicAdd(&hist[b], w);
    }
    __threadfence();  // this block's bins are in the row's histogram before it counts itself done
    __syncthreads();
    if (threadIdx.x == 0) s.last_block = atomicAdd(&p.blocks_done[r], 1u) == static_cast<unsigned>(p.splits) - 1;
    __syncthreads();
    if (!s.last_block) return;
    __threadfence();  // every block's bins are visible to the reads below
  }
  choose_bin<MASS>(p, r, level, st, s);
}

// Rows with top-k or top-p after top-k's select: block (row, split) appends its candidates (key <=
// ceiling, and e >= (1 - p) / V with top-p) to the row's list, a warp at a time, and adds the mass of
// its tokens with key <= ceiling to the row's. A warp that finds the list overflowed stops: the row
// then has no list and takes the split passes, which sum its mass themselves (a nearly flat row
// overflows within its first few thousand tokens). Launch: grid (rows, splits), kSplitThreads threads,
// sizeof(SelectShared).
template <typename T>
__global__ void __launch_bounds__(kSplitThreads) gather_candidates_kernel(SampleParams p) {
  begin_dependent_grid();
  const int r = blockIdx.x;
  if (greedy_row(p, r) || !(top_k_on(p, r) || top_p_on(p, r))) return;
  const SelectState& st = p.state[r];
  const float max_logit = st.max_logit;
  if (max_logit == neg_inf()) return;  // settled by row_max_merge_kernel
  VOLTLLM_DYNAMIC_SMEM(smem_raw);
  SelectShared& s = *reinterpret_cast<SelectShared*>(smem_raw);
  const T* row = static_cast<const T*>(p.logits) + static_cast<long long>(r) * p.logits_stride;
  const float inv_t = 1.f / p.temperature[r];
  const unsigned ceiling = st.ceiling;
  const bool top_p = top_p_on(p, r);
  const float keep_e = top_p ? (1.f - p.top_p[r]) / p.vocab : 0.f;
  const long long list = static_cast<long long>(r) * p.candidate_capacity;
  const unsigned capacity = static_cast<unsigned>(p.candidate_capacity);
  const int lane = threadIdx.x & 31;
  unsigned long long mass = 0;
  const int begin = blockIdx.y * p.split_tokens;
  const int end = min(p.vocab, begin + p.split_tokens);
  for (int base = begin; base < end; base += blockDim.x) {  // warp-uniform trip count: the ballot below
    const int i = base + threadIdx.x;
    bool candidate = false;
    float d = 0.f;
    if (i < end) {
      d = (max_logit - logit_at(row, i)) * inv_t;
      if (__float_as_uint(d) <= ceiling) {
        if (top_p) mass += fixed_mass(d);
        candidate = expf(-d) >= keep_e;
      }
    }
    const unsigned ballot = __ballot_sync(0xffffffffu, candidate);
    if (ballot == 0u) continue;
    unsigned slot = 0;
    if (lane == 0) slot = atomicAdd(&p.num_candidates[r], static_cast<unsigned>(__popc(ballot)));
    slot = __shfl_sync(0xffffffffu, slot, 0);
    if (slot + __popc(ballot) > capacity) break;  // overflowed (warp-uniform): the count says so for good
    slot += __popc(ballot & ((1u << lane) - 1u));
    if (candidate) {
      p.candidate_d[list + slot] = d;
      p.candidate_token[list + slot] = i;
    }
  }
  if (!top_p) return;
  unsigned long long total;
  block_exclusive_scan(mass, s.scan, total);
  if (threadIdx.x == 0 && total != 0) atomicAdd(&p.kept_mass[r], total);
}

// This thread's d values of a row's candidate list, for select_in_block.
struct CandidateDs {
  const float* ds;
  int n;
  template <typename Fn>
  __device__ __forceinline__ void operator()(Fn&& fn) const {
    for (int i = threadIdx.x; i < n; i += blockDim.x) fn(ds[i]);
  }
};

// The select of select_digit_kernel (MASS), all three digits in this block, over the d values that
// for_each_d(fn) hands to fn (this thread's share of them, the same ones on every call: CandidateDs, or
// race_first_sampling.cuh's RowDs): the smallest key K among those with key <= ceiling whose {key <= K}
// holds `share` of `total`, the kept mass of the row.
template <typename ForEachD>
__device__ unsigned select_in_block(ForEachD&& for_each_d, unsigned ceiling, double share, unsigned long long total,
                                    SelectShared& s) {
  unsigned prefix = 0;
  unsigned prefix_mask = 0;
  unsigned long long remaining = static_cast<unsigned long long>(share * static_cast<double>(total));
  remaining = remaining < 1 ? 1 : remaining;
  for (int level = 0; level < kSelectDigits; ++level) {
    for (int b = threadIdx.x; b < kSampleBins; b += blockDim.x) s.lo[b] = s.hi[b] = 0;
    __syncthreads();
    PendingBin pending;
    for_each_d([&](float d) {
      const unsigned key = __float_as_uint(d);
      if (key > ceiling || (key & prefix_mask) != prefix) return;
      const unsigned long long w = fixed_mass(d);
      if (w != 0) pending.add((key >> digit_shift(level)) & digit_mask(level), w, s);
    });
    pending.flush(s);
    __syncthreads();
    find_bin([&](int b) { return shared_bin(s, b); }, remaining, -1.0, s);
    prefix |= s.chosen_bin << digit_shift(level);
    prefix_mask |= digit_mask(level) << digit_shift(level);
    remaining = s.remaining;
    __syncthreads();
  }
  return prefix;
}

// Rows whose candidate list fits: the top-p select over the list, then the race over its kept tokens
// (key <= ceiling, e >= min_p); the row is settled here (the passes after it skip it). Launch: one
// block of kSplitThreads threads per row, sizeof(SelectShared).
template <typename T>
__global__ void __launch_bounds__(kSplitThreads) finish_candidates_kernel(SampleParams p) {
  begin_dependent_grid();
  const int r = blockIdx.x;
  if (greedy_row(p, r) || !(top_k_on(p, r) || top_p_on(p, r))) return;
  SelectState& st = p.state[r];
  if (st.max_logit == neg_inf()) return;  // settled by row_max_merge_kernel
  const int n = static_cast<int>(p.num_candidates[r]);
  if (n > p.candidate_capacity) return;  // no list: the split passes take the row
  VOLTLLM_DYNAMIC_SMEM(smem_raw);
  SelectShared& s = *reinterpret_cast<SelectShared*>(smem_raw);
  const long long list = static_cast<long long>(r) * p.candidate_capacity;
  const float* ds = p.candidate_d + list;
  const int* tokens = p.candidate_token + list;
  unsigned ceiling = st.ceiling;
  if (top_p_on(p, r)) ceiling = select_in_block(CandidateDs{ds, n}, ceiling, p.top_p[r], p.kept_mass[r], s);
  const T* row = static_cast<const T*>(p.logits) + static_cast<long long>(r) * p.logits_stride;
  const float inv_t = 1.f / p.temperature[r];
  const float min_p = min_p_of(p, r);
  const unsigned long long seed = p.seeds[r];
  float score = neg_inf();
  int index = st.argmax;
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const float d = ds[i];
    if (__float_as_uint(d) > ceiling || (min_p > 0.f && expf(-d) < min_p)) continue;
    const int token = tokens[i];
    const float race = race_value(logit_at(row, token), inv_t, seed, token);
    if (race > score || (race == score && token < index)) {  // the list is in no order: ties by token
      score = race;
      index = token;
    }
  }
  index = block_argmax(score, index, s.scan_score, s.scan_index);
  if (threadIdx.x == 0) {
    p.out[r] = index;
    st.max_logit = neg_inf();  // settled
  }
}

// Every row, the draw's first half: block (row, split) races its tokens and writes its winner. Greedy
// rows take x itself (the first max), temperature-only rows race every token, filtered rows the tokens
// with key <= ceiling and e >= min_p (a split with none writes -inf and the row's argmax, what a row with
// no kept token at all then draws). Launch: grid (rows, splits),
// kSplitThreads threads, sizeof(ArgmaxShared).
template <typename T>
__global__ void __launch_bounds__(kSplitThreads) race_partial_kernel(SampleParams p) {
  begin_dependent_grid();
  const int r = blockIdx.x;
  const bool greedy = greedy_row(p, r);
  const bool filtered = filtered_row(p, r);
  float max_logit = 0.f;
  unsigned ceiling = 0xffffffffu;
  int fallback = blockIdx.y * p.split_tokens;
  if (filtered) {
    const SelectState& st = p.state[r];
    max_logit = st.max_logit;
    if (max_logit == neg_inf()) return;  // settled by row_max_merge_kernel
    ceiling = st.ceiling;
    fallback = st.argmax;
  }
  VOLTLLM_DYNAMIC_SMEM(smem_raw);
  ArgmaxShared& s = *reinterpret_cast<ArgmaxShared*>(smem_raw);
  const T* row = static_cast<const T*>(p.logits) + static_cast<long long>(r) * p.logits_stride;
  const float inv_t = greedy ? 1.f : 1.f / p.temperature[r];
  const float min_p = min_p_of(p, r);
  const unsigned long long seed = p.seeds[r];
  float score = neg_inf();
  int index = fallback;
  for_each_logit(p, row, [&](int i, float x) {
    float race;
    if (greedy) {
      race = x;
    } else {
      if (filtered) {
        const float d = (max_logit - x) * inv_t;
        if (__float_as_uint(d) > ceiling || (min_p > 0.f && expf(-d) < min_p)) return;
      }
      race = race_value(x, inv_t, seed, i);
    }
    if (race > score) {  // ascending per thread: the first of equal values
      score = race;
      index = i;
    }
  });
  index = block_argmax(score, index, s.score, s.index);
  write_split(p, r, score, index);
}

// Every row, the draw's second half: one warp per row picks the best split's winner. Launch: one block
// of 32 threads per row.
__global__ void __launch_bounds__(32) race_merge_kernel(SampleParams p) {
  begin_dependent_grid();
  const int r = blockIdx.x;
  if (filtered_row(p, r) && p.state[r].max_logit == neg_inf()) return;  // settled by row_max_merge_kernel
  float score;
  const int index = merge_splits(p, r, score);
  if (threadIdx.x == 0) p.out[r] = index;
}

}  // namespace voltllm
