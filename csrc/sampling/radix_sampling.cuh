// One token per row from a step's logits: temperature, top-k, top-p and min-p without sorting the
// vocabulary, and noise that depends only on the row's seed and the token id.
//
// One thread block per row. Everything is expressed through each token's distance from the row's best
// logit in units of temperature, d = (max - x) / T >= 0 (computed as (max - x) * (1 / T) in fp32), so
// the token's probability relative to the best one is e = exp(-d):
//
//   1. a pass finds the row's max (greedy rows stop here with its first argmax);
//   2. top-k: a radix select over the bit patterns of d (a non-negative float's bits order like the
//      float) finds the k-th smallest d, K_k, in three passes of 11/11/10 bits with per-bin counts;
//   3. top-p: the same select over the tokens with d <= K_k, with per-bin probability mass (fixed point,
//      so the sums do not depend on the order the atomics land in), finds the smallest K_p whose set
//      {d <= K_p} holds at least top_p of that mass;
//   4. min-p keeps e >= min_p;
//   5. a last pass draws the token by the exponential race over the kept set: the argmax of
//      -d - log(E_i), E_i ~ Exp(1), is an exact draw from the kept tokens' renormalised probabilities.
//      E_i comes from a counter-based hash of (row seed, token id): a row's draw depends on its seed
//      alone, not on the batch, the block size or the order threads run in.
//
// Ties at a threshold are kept whole (the set is defined by values, not positions). The torch reference
// (voltllm/ops/sampling.py, `sample_tokens_ref`) computes the same sets and the same noise.
#pragma once

#include "common.cuh"

namespace voltllm {

constexpr int kSampleBins = 2048;               // 11-bit digits
constexpr int kSampleThreads = 1024;            // the block size the glue launches (any multiple of 32 works)
constexpr float kSampleMassScale = 1099511627776.0f;  // 2^40: e in (0, 1] as a fixed-point integer (exact)

struct SampleParams {
  long long* out;                   // [rows] the sampled token ids
  const void* logits;               // [rows, vocab] of T, rows `logits_stride` elements apart
  long long logits_stride;
  const float* temperature;         // [rows]; <= 0: greedy
  const int* top_k;                 // [rows]; <= 0 or >= vocab: off
  const float* top_p;               // [rows]; >= 1: off
  const float* min_p;               // [rows]; <= 0: off
  const unsigned long long* seeds;  // [rows] the noise seed of each row's draw
  int vocab;
};

// Shared memory of one block: the histogram (counts and masses) and the reduction scratch.
struct SampleShared {
  unsigned long long mass[kSampleBins];
  unsigned count[kSampleBins];
  float score[32];
  int index[32];
  unsigned long long scan[32];
  unsigned long long total;
  unsigned long long remaining;
  unsigned chosen_bin;
};

__host__ __device__ constexpr size_t sample_smem_bytes() { return sizeof(SampleShared); }
__device__ const int radix_sampling_smem_bytes = sizeof(SampleShared);  // for the sm70 gate's report

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

// Block-wide (value, index) argmax; ties go to the lower index. Every thread gets the winner's index.
__device__ __forceinline__ int block_argmax(float value, int index, SampleShared& s) {
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
    s.score[warp] = value;
    s.index[warp] = index;
  }
  __syncthreads();
  float best = s.score[0];
  int best_index = s.index[0];
  for (int w = 1; w < num_warps; ++w) {
    if (s.score[w] > best || (s.score[w] == best && s.index[w] < best_index)) {
      best = s.score[w];
      best_index = s.index[w];
    }
  }
  __syncthreads();
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

// The smallest key K among the row's tokens with key <= `ceiling` such that the weight of {key <= K}
// reaches `target` (counts when !MASS; fixed-point masses e = exp(-d) when MASS, where a `target` of 0
// means `top_p` of the total). Three passes over the row, one per digit, most significant first.
template <typename T, bool MASS>
__device__ unsigned radix_select(const T* row, int vocab, float max_logit, float inv_t, unsigned ceiling,
                                 unsigned long long target, float top_p, SampleShared& s) {
  unsigned prefix = 0;
  unsigned prefix_mask = 0;
  unsigned long long remaining = target;
#pragma unroll
  for (int level = 0; level < 3; ++level) {
    const int shift = level == 0 ? 21 : level == 1 ? 10 : 0;
    const unsigned digit_mask = level == 2 ? 0x3ffu : 0x7ffu;
    for (int b = threadIdx.x; b < kSampleBins; b += blockDim.x) {
      s.count[b] = 0;
      s.mass[b] = 0;
    }
    __syncthreads();
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
      const float d = (max_logit - logit_at(row, i)) * inv_t;
      const unsigned key = __float_as_uint(d);
      if (key > ceiling || (key & prefix_mask) != prefix) continue;
      const unsigned bin = (key >> shift) & digit_mask;
      if constexpr (MASS) {
        atomicAdd(&s.mass[bin], static_cast<unsigned long long>(expf(-d) * kSampleMassScale));
      } else {
        atomicAdd(&s.count[bin], 1u);
      }
    }
    __syncthreads();
    // Each thread owns a run of consecutive bins; a scan over the runs finds the bin where the weight
    // of the smaller keys reaches what is still wanted.
    const int per_thread = kSampleBins / blockDim.x;
    const int first = threadIdx.x * per_thread;
    unsigned long long run = 0;
    for (int b = first; b < first + per_thread; ++b) run += MASS ? s.mass[b] : s.count[b];
    unsigned long long total;
    const unsigned long long before = block_exclusive_scan(run, s, total);
    if (MASS && level == 0 && target == 0) {
      remaining = static_cast<unsigned long long>(static_cast<double>(top_p) * static_cast<double>(total));
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
        acc += MASS ? s.mass[b] : s.count[b];
        if (acc >= remaining) {
          s.chosen_bin = b;
          s.remaining = remaining - (acc - (MASS ? s.mass[b] : s.count[b]));
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

// Launch: one block per row, kSampleThreads threads (a multiple of 32 that divides kSampleBins), and
// sample_smem_bytes() of dynamic shared memory.
template <typename T>
__global__ void __launch_bounds__(kSampleThreads) radix_sampling_kernel(SampleParams p) {
  begin_dependent_grid();
  VOLTLLM_DYNAMIC_SMEM(smem_raw);
  SampleShared& s = *reinterpret_cast<SampleShared*>(smem_raw);
  const int r = blockIdx.x;
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
  const int argmax = block_argmax(best, best_index, s);
  const float temperature = p.temperature[r];
  const float max_logit = logit_at(row, argmax);
  if (temperature <= 0.f || max_logit == neg_inf()) {
    if (threadIdx.x == 0) p.out[r] = argmax;
    return;
  }
  const float inv_t = 1.f / temperature;

  unsigned ceiling = 0xffffffffu;  // keep tokens whose key (the bits of d) is <= ceiling
  const int top_k = p.top_k[r];
  if (top_k > 0 && top_k < p.vocab) {
    ceiling = radix_select<T, false>(row, p.vocab, max_logit, inv_t, ceiling, top_k, 1.f, s);
  }
  const float top_p = p.top_p[r];
  if (top_p < 1.f) {
    ceiling = radix_select<T, true>(row, p.vocab, max_logit, inv_t, ceiling, 0, top_p, s);
  }
  const float min_p = p.min_p[r];
  const unsigned long long seed = p.seeds[r];

  float score = neg_inf();
  int index = argmax;
  for (int i = threadIdx.x; i < p.vocab; i += blockDim.x) {
    const float d = (max_logit - logit_at(row, i)) * inv_t;
    if (__float_as_uint(d) > ceiling || (min_p > 0.f && expf(-d) < min_p)) continue;
    const float race = -d - logf(exponential_noise(seed, i));
    if (race > score) {
      score = race;
      index = i;
    }
  }
  const int sampled = block_argmax(score, index, s);
  if (threadIdx.x == 0) p.out[r] = sampled;
}

}  // namespace voltllm
