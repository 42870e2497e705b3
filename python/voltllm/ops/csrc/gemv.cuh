// Skinny matrix product for decode: out[m, n] = sum_k x[m, k] * weight[n, k] (+ bias[n]) for one or two
// rows m.
//
// At batch sizes of a token or two a linear layer is a matrix-vector product bound by reading the
// weight once; general GEMM kernels tile for reuse that is not there. Here each warp owns one output
// feature n: its lanes issue all the 16-byte loads of a chunk of the weight row and of the matching x
// slices before using any (one memory round trip per chunk), accumulate in fp32, and reduce across the
// warp. x is small and read by every warp, so it is served from cache. Plain CUDA cores: the same code
// on Volta. (Folding SiLU-and-mul into the x loads was tried and dropped: every warp recomputes the
// activation of the whole row, which made the Llama-3-8B down projection 3x slower; see
// benches/NOTES-kernels.md.)
#pragma once

#include "common.cuh"

namespace voltllm {

struct GemvParams {
  void* out;           // [rows, n], rows out_stride apart
  const void* x;       // [rows, k], rows x_stride apart
  const void* weight;  // [n, k], contiguous
  const void* bias;    // [n] or nullptr
  long long out_stride;
  long long x_stride;
  int rows;  // 1..ROWS
  int n;
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
template <typename T, int ROWS>
__global__ void __launch_bounds__(32 * kGemvWarps) gemv_kernel(GemvParams p) {
  constexpr int kUnroll = ROWS == 1 ? 8 : 4;  // 16-byte weight loads each lane has in flight
  constexpr int kStep = 32 * 8 * kUnroll;
  const int lane = threadIdx.x & 31;
  const int feature = blockIdx.x * kGemvWarps + (threadIdx.x >> 5);
  if (feature >= p.n) return;
  const T* w_row = static_cast<const T*>(p.weight) + static_cast<long long>(feature) * p.k;
  const T* x = static_cast<const T*>(p.x);
  float acc[ROWS];
#pragma unroll
  for (int r = 0; r < ROWS; ++r) acc[r] = 0.f;
  for (int base = lane * 8; base < p.k; base += kStep) {
    uint4 w_raw[kUnroll];
    uint4 x_raw[ROWS][kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int k = base + u * 256;
      if (k < p.k) w_raw[u] = load16(w_row + k);
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
      float w[8];
      to_floats<T>(w_raw[u], w);
#pragma unroll
      for (int r = 0; r < ROWS; ++r) {
        if (r < p.rows) {
          float xv[8];
          to_floats<T>(x_raw[r][u], xv);
#pragma unroll
          for (int j = 0; j < 8; ++j) acc[r] = fmaf(w[j], xv[j], acc[r]);
        }
      }
    }
  }
  const float bias = p.bias ? DType<T>::to_float(static_cast<const T*>(p.bias)[feature]) : 0.f;
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    const float total = warp_sum(acc[r]);
    if (lane == 0 && r < p.rows) {
      static_cast<T*>(p.out)[r * p.out_stride + feature] = DType<T>::from_float(total + bias);
    }
  }
}

}  // namespace voltllm
