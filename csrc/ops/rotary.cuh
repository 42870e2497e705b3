// Rotary position embedding, applied in place to queries and keys.
//
// Scaled variants (linear, dynamic-NTK, llama3, YaRN) differ only in the cos/sin table, which the
// Python side builds; the kernel just looks rows up by position.
#pragma once

#include "common.cuh"

namespace voltllm {

struct RotaryParams {
  const long long* positions;   // [num_tokens] position of each token; must be < max_position
  void* query;                  // [num_tokens, num_heads, head_size], rows query_stride apart
  void* key;                    // [num_tokens, num_kv_heads, head_size], rows key_stride apart
  const float* cos_sin_cache;   // [max_position, rot_dim]: cos in [:rot_dim/2], sin in [rot_dim/2:]
  long long query_stride;       // elements between tokens of query
  long long key_stride;         // elements between tokens of key
  long long max_position;       // rows of cos_sin_cache; other positions are left unrotated
  int num_heads;                // query heads
  int num_kv_heads;             // key heads
  int head_size;                // elements per head
  int rot_dim;                  // rotated leading elements of each head (even, <= head_size)
};

// NEOX pairs element i with i + rot_dim/2 (GPT-NeoX, Llama); GPT-J pairs 2i with 2i+1.
template <typename T, bool IS_NEOX>
__device__ __forceinline__ void rotate_pair(T* head, int i, int half_dim, float c, float s) {
  const int a = IS_NEOX ? i : 2 * i;
  const int b = IS_NEOX ? i + half_dim : 2 * i + 1;
  const float x = DType<T>::to_float(head[a]);
  const float y = DType<T>::to_float(head[b]);
  head[a] = DType<T>::from_float(x * c - y * s);
  head[b] = DType<T>::from_float(y * c + x * s);
}

// grid: (num_tokens), block: 256. Threads stride over (head, pair) of queries, then of keys.
template <typename T, bool IS_NEOX>
__global__ void rotary_embedding_kernel(RotaryParams p) {
  begin_dependent_grid();
  const int token = blockIdx.x;
  const long long pos = p.positions[token];
  if (pos < 0 || pos >= p.max_position) return;
  const int half_dim = p.rot_dim / 2;
  const float* cos = p.cos_sin_cache + pos * p.rot_dim;
  const float* sin = cos + half_dim;
  T* q = static_cast<T*>(p.query) + token * p.query_stride;
  for (int k = threadIdx.x; k < p.num_heads * half_dim; k += blockDim.x) {
    const int head = k / half_dim, i = k % half_dim;
    rotate_pair<T, IS_NEOX>(q + head * p.head_size, i, half_dim, cos[i], sin[i]);
  }
  if (p.key == nullptr) return;
  T* key = static_cast<T*>(p.key) + token * p.key_stride;
  for (int k = threadIdx.x; k < p.num_kv_heads * half_dim; k += blockDim.x) {
    const int head = k / half_dim, i = k % half_dim;
    rotate_pair<T, IS_NEOX>(key + head * p.head_size, i, half_dim, cos[i], sin[i]);
  }
}

}  // namespace voltllm
