// One token per row from a step's logits: temperature, top-k, top-p and min-p without sorting the
// vocabulary, and noise that depends only on the row's seed and the token id.
//
// Every draw is the exponential race: the argmax over the kept tokens of log(weight) - log(E_i),
// E_i ~ Exp(1), is an exact draw in proportion to the weights. E_i comes from a counter-based hash of
// (row seed, token id), so a row's draw depends on its seed alone, not on the batch, the block size or
// the order threads run in.
//
// Rows with only a temperature race over x / T directly, split over many blocks (race_partial_kernel
// writes each split's winner, race_merge_kernel picks the row's): one pass, and a batch-1 step uses the
// whole GPU. Rows with a filter (and greedy rows) take radix_sampling_kernel, one block per row, where
// everything is expressed through each token's distance from the row's best logit in units of
// temperature, d = (max - x) * (1 / T) >= 0, and its relative probability e = exp(-d):
//
//   1. a pass finds the row's max (greedy rows stop here with its first argmax);
//   2. top-k: a radix select over the bit patterns of d (a non-negative float's bits order like the
//      float) finds the k-th smallest d, K_k, in three passes of 11/11/10 bits with per-bin counts;
//   3. top-p: one pass sums the mass of {d <= K_k} (fixed point, floor(e * 2^40): exact and order-free)
//      and gathers into shared memory the tokens that can be in the top-p set at all (e >= (1 - p) / V:
//      the rest together hold less than 1 - p of the mass). The same radix select, with per-bin mass,
//      then runs over those candidates (or over the row when there are too many) and finds the
//      smallest K_p whose set {d <= K_p} holds at least p of the mass;
//   4. min-p keeps e >= min_p;
//   5. the race over the kept tokens, with weight e (log weight -d).
//
// Ties at a threshold are kept whole (the sets are defined by values, not positions). The torch
// reference (voltllm/ops/sampling.py, `sample_tokens_ref`) computes the same sets and the same noise.
#pragma once

#include "common.cuh"

namespace voltllm {

constexpr int kSampleBins = 2048;                     // 11-bit digits
constexpr int kSampleThreads = 1024;                  // radix_sampling_kernel's block (a power of two, 32..1024)
constexpr int kSampleCandidates = 8192;               // top-p candidates gathered in shared memory
constexpr float kSampleMassScale = 1099511627776.0f;  // 2^40: e in (0, 1] as a fixed-point integer (exact)
constexpr int kRaceSplit = 4096;                      // tokens per block of the temperature-only race
constexpr int kRaceThreads = 256;

struct SampleParams {
  long long* out;                   // [rows] the sampled token ids
  const void* logits;               // [rows, vocab] of T, rows `logits_stride` elements apart
  long long logits_stride;
  const float* temperature;         // [rows]; <= 0: greedy
  const int* top_k;                 // [rows]; <= 0 or >= vocab: off
  const float* top_p;               // [rows]; >= 1: off
  const float* min_p;               // [rows]; <= 0: off
  const unsigned long long* seeds;  // [rows] the noise seed of each row's draw
  float* race_score;                // [rows, race_splits] scratch: each split's winning race value
  int* race_index;                  // [rows, race_splits] scratch: and its token
  int race_splits;                  // ceil(vocab / kRaceSplit)
  int vocab;
};

// Shared memory of radix_sampling_kernel: the histogram, the top-p candidates, the reduction scratch.
struct SampleShared {
  union {
    unsigned long long mass[kSampleBins];
    unsigned count[kSampleBins];
  } hist;
  float candidate_d[kSampleCandidates];
  int candidate_token[kSampleCandidates];
  float score[32];
  int index[32];
  unsigned long long scan[32];
  unsigned long long remaining;
  unsigned chosen_bin;
  unsigned num_candidates;
};

__host__ __device__ constexpr size_t sample_smem_bytes() { return sizeof(SampleShared); }
__device__ const int radix_sampling_smem_bytes = sizeof(SampleShared);  // for the sm70 gate's report

struct RaceShared {
  float score[32];
  int index[32];
};
__host__ __device__ constexpr size_t race_smem_bytes() { return sizeof(RaceShared); }
__device__ const int race_smem_bytes_probe = sizeof(RaceShared);  // for the sm70 gate's report

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

template <typename T>
__device__ __forceinline__ float logit_at(const T* row, int i) {
  if constexpr (is_same<T, float>::value) {
    return row[i];
  } else {
    return DType<T>::to_float(row[i]);
  }
}

// Whether row `r` samples with a temperature and no filter (the split race's rows).
__device__ __forceinline__ bool temperature_only(const SampleParams& p, int r) {
  const int k = p.top_k[r];
  return p.temperature[r] > 0.f && (k <= 0 || k >= p.vocab) && p.top_p[r] >= 1.f && p.min_p[r] <= 0.f;
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
__device__ __forceinline__ unsigned long long block_exclusive_scan(unsigned long long v, SampleShared& s,
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
  if (lane == 31) s.scan[warp] = inclusive;
  __syncthreads();
  unsigned long long before = 0;
  total = 0;
  for (int w = 0; w < num_warps; ++w) {
    if (w < warp) before += s.scan[w];
    total += s.scan[w];
  }
  __syncthreads();
  return before + inclusive - v;
}

__device__ __forceinline__ unsigned long long fixed_mass(float d) {
  return static_cast<unsigned long long>(expf(-d) * kSampleMassScale);
}

// The tokens a select or race reads: the whole row (d computed from the logits) ...
template <typename T>
struct RowTokens {
  const T* row;
  int n;
  float max_logit;
  float inv_t;
  __device__ int size() const { return n; }
  __device__ float d(int i) const { return (max_logit - logit_at(row, i)) * inv_t; }
  __device__ int token(int i) const { return i; }
};

// ... or the top-p candidates gathered in shared memory.
struct CandidateTokens {
  const float* ds;
  const int* tokens;
  int n;
  __device__ int size() const { return n; }
  __device__ float d(int i) const { return ds[i]; }
  __device__ int token(int i) const { return tokens[i]; }
};

constexpr unsigned kNoBin = 0xffffffffu;

// Adds each lane's weight `w` to bin `bin` of the histogram (kNoBin: nothing). Called by whole warps.
// When every lane with a bin has the same one (a flat row puts nearly every token in one bin of the
// first digit), the warp sums first and one lane adds: 32 atomics on one address would serialize.
template <bool MASS>
__device__ __forceinline__ void add_to_histogram(unsigned bin, unsigned long long w, SampleShared& s) {
  const unsigned with_bin = __ballot_sync(0xffffffffu, bin != kNoBin);
  if (with_bin == 0u) return;
  const unsigned peers = __match_any_sync(0xffffffffu, bin);
  if (__all_sync(0xffffffffu, bin == kNoBin || peers == with_bin)) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) w += __shfl_xor_sync(0xffffffffu, w, o);
    if ((threadIdx.x & 31) != __ffs(with_bin) - 1) return;
  } else if (bin == kNoBin) {
    return;
  }
  if constexpr (MASS) {
    atomicAdd(&s.hist.mass[bin], w);
  } else {
    atomicAdd(&s.hist.count[bin], static_cast<unsigned>(w));
  }
}

// The smallest key K among `tokens` with key <= `ceiling` such that the weight of {key <= K} reaches
// `target` (counts when !MASS, fixed-point masses when MASS). Three passes, one per digit, most
// significant first.
template <bool MASS, typename Tokens>
__device__ unsigned radix_select(const Tokens& tokens, unsigned ceiling, unsigned long long target, SampleShared& s) {
  unsigned prefix = 0;
  unsigned prefix_mask = 0;
  unsigned long long remaining = target;
#pragma unroll
  for (int level = 0; level < 3; ++level) {
    const int shift = level == 0 ? 21 : level == 1 ? 10 : 0;
    const unsigned digit_mask = level == 2 ? 0x3ffu : 0x7ffu;
    for (int b = threadIdx.x; b < kSampleBins; b += blockDim.x) s.hist.mass[b] = 0;
    __syncthreads();
    for (int base = 0; base < tokens.size(); base += blockDim.x) {  // warp-uniform: add_to_histogram
      const int i = base + threadIdx.x;
      unsigned bin = kNoBin;
      unsigned long long w = 0;
      if (i < tokens.size()) {
        const float d = tokens.d(i);
        const unsigned key = __float_as_uint(d);
        if (key <= ceiling && (key & prefix_mask) == prefix) {
          bin = (key >> shift) & digit_mask;
          w = MASS ? fixed_mass(d) : 1;
        }
      }
      add_to_histogram<MASS>(bin, w, s);
    }
    __syncthreads();
    // Each thread owns a run of consecutive bins; a scan over the runs finds the bin where the weight
    // of the smaller keys reaches what is still wanted.
    const int per_thread = kSampleBins / blockDim.x;
    const int first = threadIdx.x * per_thread;
    unsigned long long run = 0;
    for (int b = first; b < first + per_thread; ++b) run += MASS ? s.hist.mass[b] : s.hist.count[b];
    unsigned long long total;
    const unsigned long long before = block_exclusive_scan(run, s, total);
    if (remaining > total) remaining = total;  // fixed-point rounding at the last bin: keep everything
    if (threadIdx.x == 0) {
      s.chosen_bin = kSampleBins - 1;  // overwritten below: some run always holds the wanted weight
      s.remaining = remaining;
    }
    __syncthreads();
    if (before < remaining && remaining <= before + run) {
      unsigned long long acc = before;
      for (int b = first; b < first + per_thread; ++b) {
        const unsigned long long w = MASS ? s.hist.mass[b] : s.hist.count[b];
        acc += w;
        if (acc >= remaining) {
          s.chosen_bin = b;
          s.remaining = remaining - (acc - w);
          break;
        }
      }
    }
    __syncthreads();
    const unsigned bin = s.chosen_bin;
    remaining = s.remaining;
    __syncthreads();
    prefix |= bin << shift;
    prefix_mask |= digit_mask << shift;
  }
  return prefix;
}

// One pass: the fixed-point mass of the row's tokens with key <= `ceiling` (returned, to every thread),
// and the top-p candidates among them (e >= keep_e) gathered into shared memory in any order
// (s.num_candidates may exceed the capacity: then only the count is meaningful).
template <typename T>
__device__ unsigned long long gather_top_p_candidates(const RowTokens<T>& row, unsigned ceiling, float keep_e,
                                                      SampleShared& s) {
  const int lane = threadIdx.x & 31;
  if (threadIdx.x == 0) s.num_candidates = 0;
  __syncthreads();
  unsigned long long mass = 0;
  for (int base = 0; base < row.size(); base += blockDim.x) {  // warp-uniform trip count: the ballot below
    const int i = base + threadIdx.x;
    bool candidate = false;
    float d = 0.f;
    if (i < row.size()) {
      d = row.d(i);
      if (__float_as_uint(d) <= ceiling) {
        mass += fixed_mass(d);
        candidate = expf(-d) >= keep_e;
      }
    }
    const unsigned ballot = __ballot_sync(0xffffffffu, candidate);
    unsigned slot = 0;
    if (lane == 0 && ballot != 0u) slot = atomicAdd(&s.num_candidates, static_cast<unsigned>(__popc(ballot)));
    slot = __shfl_sync(0xffffffffu, slot, 0) + __popc(ballot & ((1u << lane) - 1u));
    if (candidate && slot < kSampleCandidates) {
      s.candidate_d[slot] = d;
      s.candidate_token[slot] = i;
    }
  }
  unsigned long long total;
  block_exclusive_scan(mass, s, total);
  return total;
}

// The race over `tokens` with key <= ceiling and e >= min_p: the sampled token (to every thread).
template <typename Tokens>
__device__ int filtered_race(const Tokens& tokens, unsigned ceiling, float min_p, unsigned long long seed, int fallback,
                             SampleShared& s) {
  float score = neg_inf();
  int index = fallback;
  for (int i = threadIdx.x; i < tokens.size(); i += blockDim.x) {
    const float d = tokens.d(i);
    if (__float_as_uint(d) > ceiling || (min_p > 0.f && expf(-d) < min_p)) continue;
    const int token = tokens.token(i);
    const float race = -d - logf(exponential_noise(seed, token));
    if (race > score || (race == score && token < index)) {
      score = race;
      index = token;
    }
  }
  return block_argmax(score, index, s.score, s.index);
}

// Greedy rows and rows with a filter. Launch: one block per row, a power-of-two block of 32..1024
// threads (kSampleThreads), sample_smem_bytes() of dynamic shared memory.
template <typename T>
__global__ void __launch_bounds__(kSampleThreads) radix_sampling_kernel(SampleParams p) {
  begin_dependent_grid();
  const int r = blockIdx.x;
  if (temperature_only(p, r)) return;  // the split race's row
  VOLTLLM_DYNAMIC_SMEM(smem_raw);
  SampleShared& s = *reinterpret_cast<SampleShared*>(smem_raw);
  const T* row = static_cast<const T*>(p.logits) + static_cast<long long>(r) * p.logits_stride;

  float best = neg_inf();
  int best_index = 0;
  for (int i = threadIdx.x; i < p.vocab; i += blockDim.x) {
    const float x = logit_at(row, i);
    if (x > best) {  // strided ascending order: the first maximum of this thread's tokens
      best = x;
      best_index = i;
    }
  }
  const int argmax = block_argmax(best, best_index, s.score, s.index);
  const float temperature = p.temperature[r];
  if (temperature <= 0.f || best == neg_inf()) {
    if (threadIdx.x == 0) p.out[r] = argmax;
    return;
  }
  const RowTokens<T> tokens{row, p.vocab, best, 1.f / temperature};
  const unsigned long long seed = p.seeds[r];
  const float min_p = p.min_p[r];

  unsigned ceiling = 0xffffffffu;  // keep tokens whose key (the bits of d) is <= ceiling
  const int top_k = p.top_k[r];
  if (top_k > 0 && top_k < p.vocab) ceiling = radix_select<false>(tokens, ceiling, top_k, s);
  const float top_p = p.top_p[r];
  int sampled;
  if (top_p < 1.f) {
    const unsigned long long mass = gather_top_p_candidates(tokens, ceiling, (1.f - top_p) / p.vocab, s);
    unsigned long long target = static_cast<unsigned long long>(static_cast<double>(top_p) * static_cast<double>(mass));
    target = target < 1 ? 1 : target;
    const int num_candidates = static_cast<int>(s.num_candidates);
    if (num_candidates <= kSampleCandidates) {
      const CandidateTokens candidates{s.candidate_d, s.candidate_token, num_candidates};
      ceiling = radix_select<true>(candidates, ceiling, target, s);
      sampled = filtered_race(candidates, ceiling, min_p, seed, argmax, s);
    } else {
      ceiling = radix_select<true>(tokens, ceiling, target, s);
      sampled = filtered_race(tokens, ceiling, min_p, seed, argmax, s);
    }
  } else {
    sampled = filtered_race(tokens, ceiling, min_p, seed, argmax, s);
  }
  if (threadIdx.x == 0) p.out[r] = sampled;
}

// Temperature-only rows, first half: block (row, split) races its kRaceSplit tokens over x / T and
// writes its winner. Launch: grid (rows, race_splits) (rows on x: up to 2^31 - 1 of them),
// kRaceThreads threads, race_smem_bytes().
template <typename T>
__global__ void __launch_bounds__(kRaceThreads) race_partial_kernel(SampleParams p) {
  begin_dependent_grid();
  const int r = blockIdx.x;
  const int split = blockIdx.y;
  if (!temperature_only(p, r)) return;
  VOLTLLM_DYNAMIC_SMEM(smem_raw);
  RaceShared& s = *reinterpret_cast<RaceShared*>(smem_raw);
  const T* row = static_cast<const T*>(p.logits) + static_cast<long long>(r) * p.logits_stride;
  const float inv_t = 1.f / p.temperature[r];
  const unsigned long long seed = p.seeds[r];
  const int begin = split * kRaceSplit;
  const int end = min(p.vocab, begin + kRaceSplit);
  float score = neg_inf();
  int index = begin;
  for (int i = begin + threadIdx.x; i < end; i += blockDim.x) {
    const float race = logit_at(row, i) * inv_t - logf(exponential_noise(seed, i));
    if (race > score) {  // ascending per thread: the first of equal values
      score = race;
      index = i;
    }
  }
  index = block_argmax(score, index, s.score, s.index);
  if (threadIdx.x == 0) {
    p.race_score[static_cast<long long>(r) * p.race_splits + split] = score;
    p.race_index[static_cast<long long>(r) * p.race_splits + split] = index;
  }
}

// Temperature-only rows, second half: one warp per row picks the best split's winner. Launch: one
// block of 32 threads per row.
__global__ void __launch_bounds__(32) race_merge_kernel(SampleParams p) {
  begin_dependent_grid();
  const int r = blockIdx.x;
  if (!temperature_only(p, r)) return;
  float score = neg_inf();
  int index = 0;
  for (int split = threadIdx.x; split < p.race_splits; split += 32) {
    const float v = p.race_score[static_cast<long long>(r) * p.race_splits + split];
    const int i = p.race_index[static_cast<long long>(r) * p.race_splits + split];
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
  if (threadIdx.x == 0) p.out[r] = index;
}

}  // namespace voltllm
