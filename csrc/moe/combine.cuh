// The top-k weighted sum: out[t] = sum over j of y[t * top_k + j] (each row already times its routing
// weight), added in j order in fp32 and rounded once to T.
#pragma once

#include "moe/moe_params.cuh"

namespace voltllm {

constexpr int kMoeCombineThreads = 128;  // each adds 4 features

// grid: (tokens, ceil(n / (4 * kMoeCombineThreads))), block: kMoeCombineThreads.
template <typename T>
__global__ void __launch_bounds__(kMoeCombineThreads) moe_combine_kernel(MoeCombineParams p) {
  begin_dependent_grid();
  const int token = blockIdx.x;
  const int h = (blockIdx.y * kMoeCombineThreads + threadIdx.x) * 4;
  if (h >= p.n) return;
  float4 sum = make_float4(0.f, 0.f, 0.f, 0.f);
  const float* y = p.y + static_cast<long long>(token) * p.top_k * p.n + h;
  for (int j = 0; j < p.top_k; ++j) {
    const float4 v = *reinterpret_cast<const float4*>(y + static_cast<long long>(j) * p.n);
    sum.x += v.x;
    sum.y += v.y;
    sum.z += v.z;
    sum.w += v.w;
  }
  using T2 = typename DType<T>::T2;
  T2* out = reinterpret_cast<T2*>(static_cast<T*>(p.out) + token * p.out_stride + h);
  out[0] = DType<T>::from_float2(make_float2(sum.x, sum.y));
  out[1] = DType<T>::from_float2(make_float2(sum.z, sum.w));
}

}  // namespace voltllm
