// SiLU-and-mul: the gated MLP activation, out = silu(x[..., :d]) * x[..., d:].
#pragma once

#include "common.cuh"

namespace voltllm {

struct SiluAndMulParams {
  void* out;              // [num_tokens, d], rows out_stride apart
  const void* input;      // [num_tokens, 2 * d], rows input_stride apart: gate half, then up half
  long long out_stride;   // elements between rows of out
  long long input_stride; // elements between rows of input
  int d;                  // output width; a multiple of VEC
};

__device__ __forceinline__ float silu(float x) { return x / (1.f + __expf(-x)); }

// grid: (num_tokens), block: 256.
template <typename T, int VEC>
__global__ void silu_and_mul_kernel(SiluAndMulParams p) {
  begin_dependent_grid();
  static_assert(VEC == 1 || VEC == 8, "VEC is 1 (scalar) or 8 (16-byte vectors)");
  const T* gate = static_cast<const T*>(p.input) + blockIdx.x * p.input_stride;
  const T* up = gate + p.d;
  T* out = static_cast<T*>(p.out) + blockIdx.x * p.out_stride;
  for (int i = threadIdx.x * VEC; i < p.d; i += blockDim.x * VEC) {
    if constexpr (VEC == 8) {
      float g[8], u[8];
      load_floats(gate + i, g);
      load_floats(up + i, u);
#pragma unroll
      for (int j = 0; j < 8; ++j) g[j] = silu(g[j]) * u[j];
      store_floats(out + i, g);
    } else {
      out[i] = DType<T>::from_float(silu(DType<T>::to_float(gate[i])) * DType<T>::to_float(up[i]));
    }
  }
}

}  // namespace voltllm
