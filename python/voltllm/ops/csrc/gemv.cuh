// Skinny matrix product for decode: out[m, n] = sum_k x[m, k] * weight[n, k] (+ bias[n]) for one or two
// rows m; optionally with the gated MLP's SiLU-and-mul as its epilogue.
//
// At batch sizes of a token or two a linear layer is a matrix-vector product bound by reading the
// weight once; general GEMM kernels tile for reuse that is not there. Here each warp owns one output
// feature n: its lanes issue all the 16-byte loads of a chunk of the weight row and of the matching x
// slices before using any (one memory round trip per chunk), accumulate in fp32, and reduce across the
// warp. x is small and read by every warp, so it is served from cache. Plain CUDA cores: the same code
// on Volta. (Folding SiLU-and-mul into the down projection's x loads instead was tried and dropped:
// every warp recomputed the activation of the whole row, and Llama-3-8B's down projection ran 3x
// slower. As the gate/up projection's epilogue it costs one activation per output.)
#pragma once

#include "activation.cuh"
#include "common.cuh"

namespace voltllm {

struct GemvParams {
  void* out;           // [rows, n], rows out_stride apart
  const void* x;       // [rows, k], rows x_stride apart
  const void* weight;  // [n, k] ([2n, k] for SWIGLU), contiguous
  const void* bias;    // [n] ([2n] for SWIGLU) or nullptr
  long long out_stride;
  long long x_stride;
  int rows;  // 1..ROWS
  int n;  // output features
  int k;  // a multiple of 8
};

constexpr int kGemvWarps = 4;  // output features per thread block

template <typename T>
__device__ __forceinline__ uint4 load16(const T* ptr) {
  return *reinterpret_cast<const uint4*>(ptr);
}

template <typename T>
__device__ __forceinline__ void to_floats(uint4 raw, float (&v)[8]) {
  Vec8<T> vec;
  vec.raw = raw;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = DType<T>::to_float2(vec.pair[i]);
    v[2 * i] = f.x;
    v[2 * i + 1] = f.y;
  }
}

// grid: ceil(n / kGemvWarps), block: 32 * kGemvWarps. ROWS is the most x rows handled (1 or 2).
// SWIGLU: the weight is a gate/up projection [gate; up] of 2n rows, and the warp of feature f computes
// both f and n + f and writes silu(gate) * up, so the gated MLP's activation needs no kernel of its
// own. Both products are rounded to T first, as the unfused projection would store them.
template <typename T, int ROWS, bool SWIGLU>
__global__ void __launch_bounds__(32 * kGemvWarps) gemv_kernel(GemvParams p) {
  constexpr int kMats = SWIGLU ? 2 : 1;  // weight rows per warp
  constexpr int kUnroll = ROWS == 1 && !SWIGLU ? 8 : 4;  // 16-byte loads per weight row in flight
  constexpr int kStep = 32 * 8 * kUnroll;
  const int lane = threadIdx.x & 31;
  const int feature = blockIdx.x * kGemvWarps + (threadIdx.x >> 5);
  if (feature >= p.n) return;
  const T* weight = static_cast<const T*>(p.weight);
  const T* w_rows[kMats];
#pragma unroll
  for (int m = 0; m < kMats; ++m) w_rows[m] = weight + static_cast<long long>(feature + m * p.n) * p.k;
  const T* x = static_cast<const T*>(p.x);
  float acc[kMats][ROWS];
#pragma unroll
  for (int m = 0; m < kMats; ++m)
#pragma unroll
    for (int r = 0; r < ROWS; ++r) acc[m][r] = 0.f;
  for (int base = lane * 8; base < p.k; base += kStep) {
    uint4 w_raw[kMats][kUnroll];
    uint4 x_raw[ROWS][kUnroll];
#pragma unroll
    for (int m = 0; m < kMats; ++m)
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int k = base + u * 256;
        if (k < p.k) w_raw[m][u] = load16(w_rows[m] + k);
      }
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int k = base + u * 256;
        if (k < p.k && r < p.rows) x_raw[r][u] = load16(x + r * p.x_stride + k);
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int k = base + u * 256;
      if (k >= p.k) break;
#pragma unroll
      for (int r = 0; r < ROWS; ++r) {
        if (r < p.rows) {
          float xv[8];
          to_floats<T>(x_raw[r][u], xv);
#pragma unroll
          for (int m = 0; m < kMats; ++m) {
            float w[8];
            to_floats<T>(w_raw[m][u], w);
#pragma unroll
            for (int j = 0; j < 8; ++j) acc[m][r] = fmaf(w[j], xv[j], acc[m][r]);
          }
        }
      }
    }
  }
  const T* bias = static_cast<const T*>(p.bias);
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    float value[kMats];
#pragma unroll
    for (int m = 0; m < kMats; ++m) {
      const float b = bias ? DType<T>::to_float(bias[feature + m * p.n]) : 0.f;
      value[m] = DType<T>::to_float(DType<T>::from_float(warp_sum(acc[m][r]) + b));
    }
    const float result = SWIGLU ? silu(value[0]) * value[kMats - 1] : value[0];
    if (lane == 0 && r < p.rows) {
      static_cast<T*>(p.out)[r * p.out_stride + feature] = DType<T>::from_float(result);
    }
  }
}

}  // namespace voltllm
