// The attention prologue of a decoder layer in one kernel: per-head RMSNorm of q and k (Qwen3; skipped
// without weights), NeoX rotary embedding of q and k, and the write of k and v into the paged cache.
//
// Unfused these are four or five tiny launches a layer (two norms, rotary, cache write), each reading
// and writing the same few kilobytes; at decode batch sizes their launch and latency cost more than
// their work. Here one warp owns one head of one token: it loads the head (head_size / 32 elements a
// lane), normalises it with a warp reduction, rotates it (the NeoX partner of element i, i ± half,
// lives in lane ^ 16), stores it back in place and, for key heads, copies key and value into their
// cache slot. Rounding follows the unfused sequence: the normalised head is rounded to T before the
// rotation reads it, as when rms_norm writes it out.
#pragma once

#include "common.cuh"

namespace voltllm {

struct QkNormRopeParams {
  void* qkv;                         // [num_tokens, (num_heads + 2 * num_kv_heads) * HEAD], rows qkv_stride apart
  const long long* positions;        // [num_tokens]; positions outside [0, max_position) are not rotated
  const float* cos_sin_cache;        // [max_position, HEAD]: cos in [:HEAD/2], sin in [HEAD/2:]
  const void* q_weight;              // [HEAD] or nullptr (no q/k norm)
  const void* k_weight;              // [HEAD] or nullptr
  void* key_cache;                   // [num_slots, num_kv_heads, HEAD]
  void* value_cache;                 // [num_slots, num_kv_heads, HEAD]
  const long long* slot_mapping;     // [num_tokens]; -1 (or >= num_slots) = not written
  long long qkv_stride;
  long long max_position;
  long long num_slots;
  int num_heads;
  int num_kv_heads;
  float eps;
};

// One head of one token through the prologue, by one warp: lane l holds elements [l * HEAD / 32, ...)
// of `x` in `v` on return, normalised by `weight` (skipped when nullptr) and rotated by `cos` / `sin`
// (positions' table rows; skipped when !rotate). Rounding follows the unfused sequence: the normalised
// head is rounded to T before the rotation reads it, as when rms_norm writes it out. The decode attention
// kernel runs the same function on its query and newest key (attention/paged_decode_wmma.cuh).
template <typename T, int HEAD>
__device__ __forceinline__ void norm_rope_head(const T* x, const T* weight, float eps, const float* cos,
                                               bool rotate, float (&v)[HEAD / 32]) {
  static_assert(HEAD % 64 == 0, "the NeoX partner must sit in lane ^ 16");
  constexpr int kPerLane = HEAD / 32;
  constexpr int kHalf = HEAD / 2;
  const int first = (threadIdx.x & 31) * kPerLane;
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) v[j] = DType<T>::to_float(x[first + j]);
  if (weight != nullptr) {
    float sq = 0.f;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) sq += v[j] * v[j];
    const float inv_rms = rsqrtf(warp_sum(sq) / HEAD + eps);
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      const float normed = v[j] * inv_rms * DType<T>::to_float(weight[first + j]);
      v[j] = DType<T>::to_float(DType<T>::from_float(normed));
    }
  }
  if (rotate) {
    const float* sin = cos + kHalf;
    const bool low = first < kHalf;  // lanes 0-15 hold the first half, 16-31 its partners
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      const float partner = __shfl_xor_sync(0xffffffffu, v[j], 16);
      const int i = (first + j) % kHalf;
      v[j] = low ? v[j] * cos[i] - partner * sin[i] : v[j] * cos[i] + partner * sin[i];
    }
  }
}

// grid: (num_tokens), block: 32 * min(num_heads + num_kv_heads, 16); warps stride over the token's
// q and k heads.
template <typename T, int HEAD>
__global__ void qk_norm_rope_kernel(QkNormRopeParams p) {
  begin_dependent_grid();
  constexpr int kPerLane = HEAD / 32;
  const int token = blockIdx.x;
  const int lane = threadIdx.x & 31;
  const int num_warps = blockDim.x >> 5;
  const long long pos = p.positions[token];
  const bool rotate = pos >= 0 && pos < p.max_position;
  const long long slot = p.slot_mapping[token];
  const bool write = slot >= 0 && slot < p.num_slots;
  T* row = static_cast<T*>(p.qkv) + token * p.qkv_stride;
  const int first = lane * kPerLane;  // this lane's elements: [first, first + kPerLane)
  const float* cos = p.cos_sin_cache + (rotate ? pos : 0) * HEAD;
  for (int head = threadIdx.x >> 5; head < p.num_heads + p.num_kv_heads; head += num_warps) {
    const bool is_key = head >= p.num_heads;
    T* x = row + head * HEAD;
    float v[kPerLane];
    norm_rope_head<T, HEAD>(x, static_cast<const T*>(is_key ? p.k_weight : p.q_weight), p.eps, cos, rotate, v);
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) x[first + j] = DType<T>::from_float(v[j]);
    if (is_key && write) {
      const int kv_head = head - p.num_heads;
      const long long at = (slot * p.num_kv_heads + kv_head) * HEAD + first;
      const T* value = row + (p.num_heads + p.num_kv_heads + kv_head) * HEAD + first;
      T* key_dst = static_cast<T*>(p.key_cache) + at;
      T* value_dst = static_cast<T*>(p.value_cache) + at;
#pragma unroll
      for (int j = 0; j < kPerLane; ++j) {
        key_dst[j] = DType<T>::from_float(v[j]);
        value_dst[j] = value[j];
      }
    }
  }
}

}  // namespace voltllm
