// RMSNorm and fused residual-add + RMSNorm (one pass over the row for the statistics).
#pragma once

#include "common.cuh"

namespace voltllm {

struct RmsNormParams {
  void* out;              // [num_tokens, hidden], rows out_stride apart (may alias input)
  const void* input;      // [num_tokens, hidden], rows input_stride apart
  void* residual;         // [num_tokens, hidden] contiguous; fused variant only (updated in place)
  const void* weight;     // [hidden]
  long long out_stride;   // elements between rows of out
  long long input_stride; // elements between rows of input
  int hidden;             // row length; a multiple of VEC
  float eps;              // added to the mean square
};

// out = input / rms(input) * weight. grid: (num_tokens), block: 256 (any multiple of 32).
template <typename T, int VEC>
__global__ void rms_norm_kernel(RmsNormParams p) {
  begin_dependent_grid();
  static_assert(VEC == 1 || VEC == 8, "VEC is 1 (scalar) or 8 (16-byte vectors)");
  __shared__ float scratch[32];
  const T* in = static_cast<const T*>(p.input) + blockIdx.x * p.input_stride;
  T* out = static_cast<T*>(p.out) + blockIdx.x * p.out_stride;
  const T* w = static_cast<const T*>(p.weight);
  float sq = 0.f;
  for (int i = threadIdx.x * VEC; i < p.hidden; i += blockDim.x * VEC) {
    if constexpr (VEC == 8) {
      float v[8];
      load_floats(in + i, v);
#pragma unroll
      for (int j = 0; j < 8; ++j) sq += v[j] * v[j];
    } else {
      const float v = DType<T>::to_float(in[i]);
      sq += v * v;
    }
  }
  const float inv_rms = rsqrtf(block_sum(sq, scratch) / p.hidden + p.eps);
  for (int i = threadIdx.x * VEC; i < p.hidden; i += blockDim.x * VEC) {
    if constexpr (VEC == 8) {
      float v[8], wv[8];
      load_floats(in + i, v);
      load_floats(w + i, wv);
#pragma unroll
      for (int j = 0; j < 8; ++j) v[j] = v[j] * inv_rms * wv[j];
      store_floats(out + i, v);
    } else {
      out[i] = DType<T>::from_float(DType<T>::to_float(in[i]) * inv_rms * DType<T>::to_float(w[i]));
    }
  }
}

// residual += input; input = residual / rms(residual) * weight (in place, as the decoder layer
// needs it). The sum is rounded to T before the statistics, so the result equals the unfused
// sequence run in T. grid: (num_tokens), block: 256.
template <typename T, int VEC>
__global__ void fused_add_rms_norm_kernel(RmsNormParams p) {
  begin_dependent_grid();
  static_assert(VEC == 1 || VEC == 8, "VEC is 1 (scalar) or 8 (16-byte vectors)");
  __shared__ float scratch[32];
  T* x = static_cast<T*>(p.out) + blockIdx.x * p.out_stride;
  T* res = static_cast<T*>(p.residual) + blockIdx.x * static_cast<long long>(p.hidden);
  const T* w = static_cast<const T*>(p.weight);
  float sq = 0.f;
  for (int i = threadIdx.x * VEC; i < p.hidden; i += blockDim.x * VEC) {
    if constexpr (VEC == 8) {
      *reinterpret_cast<uint4*>(res + i) = add_rounded_and_square(x + i, res + i, sq);
    } else {
      const T s = DType<T>::from_float(DType<T>::to_float(x[i]) + DType<T>::to_float(res[i]));
      res[i] = s;
      const float r = DType<T>::to_float(s);
      sq += r * r;
    }
  }
  // Each thread re-reads only the elements it wrote itself, so no barrier is needed for `res`.
  const float inv_rms = rsqrtf(block_sum(sq, scratch) / p.hidden + p.eps);
  for (int i = threadIdx.x * VEC; i < p.hidden; i += blockDim.x * VEC) {
    if constexpr (VEC == 8) {
      float r[8], wv[8];
      load_floats(res + i, r);
      load_floats(w + i, wv);
#pragma unroll
      for (int j = 0; j < 8; ++j) r[j] = r[j] * inv_rms * wv[j];
      store_floats(x + i, r);
    } else {
      x[i] = DType<T>::from_float(DType<T>::to_float(res[i]) * inv_rms * DType<T>::to_float(w[i]));
    }
  }
}

}  // namespace voltllm
