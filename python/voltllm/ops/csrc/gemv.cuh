// Skinny matrix product for decode: out[m, n] = sum_k x[m, k] * weight[n, k] (+ bias[n]) for a few rows m.
//
// At batch sizes of a few tokens a linear layer is a matrix-vector product bound by reading the weight
// once; general GEMM kernels tile for reuse that is not there and reach a fraction of the bandwidth on
// such shapes. Here each warp owns one output feature n: its lanes stream the weight row with 16-byte
// loads (all of a chunk issued before any is used, to keep bytes in flight), multiply by the matching
// slice of every x row (small, shared by all warps, so it is served from cache), accumulate in fp32,
// and reduce across the warp. Plain CUDA cores: nothing here needs tensor cores, so it is the same
// code on Volta.
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

constexpr int kGemvWarps = 4;   // output features per thread block
constexpr int kGemvUnroll = 4;  // 16-byte weight loads each lane has in flight

// grid: ceil(n / kGemvWarps), block: 32 * kGemvWarps. ROWS is the most x rows handled (1, 2, 4 or 8).
template <typename T, int ROWS>
__global__ void __launch_bounds__(32 * kGemvWarps) gemv_kernel(GemvParams p) {
  const int lane = threadIdx.x & 31;
  const int feature = blockIdx.x * kGemvWarps + (threadIdx.x >> 5);
  if (feature >= p.n) return;
  const T* w_row = static_cast<const T*>(p.weight) + static_cast<long long>(feature) * p.k;
  const T* x = static_cast<const T*>(p.x);
  float acc[ROWS];
#pragma unroll
  for (int r = 0; r < ROWS; ++r) acc[r] = 0.f;
  constexpr int kStep = 32 * 8 * kGemvUnroll;
  for (int base = lane * 8; base < p.k; base += kStep) {
    float w[kGemvUnroll][8];
#pragma unroll
    for (int u = 0; u < kGemvUnroll; ++u) {
      const int k = base + u * 32 * 8;
      if (k < p.k) {
        load_floats(w_row + k, w[u]);
      } else {
#pragma unroll
        for (int j = 0; j < 8; ++j) w[u][j] = 0.f;
      }
    }
#pragma unroll
    for (int u = 0; u < kGemvUnroll; ++u) {
      const int k = base + u * 32 * 8;
      if (k >= p.k) break;
#pragma unroll
      for (int r = 0; r < ROWS; ++r) {
        if (r < p.rows) {
          float xv[8];
          load_floats(x + r * p.x_stride + k, xv);
#pragma unroll
          for (int j = 0; j < 8; ++j) acc[r] = fmaf(w[u][j], xv[j], acc[r]);
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
