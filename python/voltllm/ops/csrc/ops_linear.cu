// Torch glue for the skinny decode GEMV: checks, device guard, stream, dtype, row-count and epilogue dispatch.
#include "torch_glue.h"
#include "gemv.cuh"

namespace voltllm {

using namespace glue;

namespace {

template <typename T, int ROWS>
void launch_gemv(const GemvParams& p, bool swiglu, cudaStream_t stream) {
  const int blocks = (p.n + kGemvWarps - 1) / kGemvWarps;
  if (swiglu)
    gemv_kernel<T, ROWS, true><<<blocks, 32 * kGemvWarps, 0, stream>>>(p);
  else
    gemv_kernel<T, ROWS, false><<<blocks, 32 * kGemvWarps, 0, stream>>>(p);
}

}  // namespace

void gemv(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
          bool swiglu) {
  check_cuda(x, "x");
  check_cuda(out, "out");
  check_dtype(x, "gemv");
  check_same_dtype(x, weight, "gemv");
  check_same_dtype(x, out, "gemv");
  check_cuda(weight, "weight");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && out.dim() == 2, "gemv: x, weight and out must be 2-D");
  const int64_t rows = x.size(0), k = weight.size(1), n = swiglu ? weight.size(0) / 2 : weight.size(0);
  TORCH_CHECK(!swiglu || weight.size(0) % 2 == 0, "gemv: swiglu needs a [2n, k] gate/up weight");
  TORCH_CHECK(x.size(1) == k, "gemv: weight is [", num(weight.size(0)), ", ", num(k), "], x has ",
              num(x.size(1)), " features");
  TORCH_CHECK(out.size(0) == rows && out.size(1) == n, "gemv: out must be [rows, n]");
  TORCH_CHECK(rows >= 1 && rows <= 2, "gemv: 1 or 2 rows, got ", num(rows));
  TORCH_CHECK(weight.is_contiguous(), "gemv: weight must be contiguous");
  TORCH_CHECK(x.stride(1) == 1 && out.stride(1) == 1, "gemv: x and out rows must be contiguous");
  TORCH_CHECK(vec8_ok(x, k) && reinterpret_cast<uintptr_t>(weight.data_ptr()) % 16 == 0 && k % 8 == 0,
              "gemv: k must be a multiple of 8 and x/weight 16-byte aligned");
  if (bias) {
    check_same_dtype(x, *bias, "gemv");
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == weight.size(0) && bias->is_contiguous(),
                "gemv: bias must have one entry per weight row");
  }
  const at::cuda::OptionalCUDAGuard guard(x.device());
  GemvParams p{};
  p.out = out.data_ptr();
  p.x = x.data_ptr();
  p.weight = weight.data_ptr();
  p.bias = bias ? bias->data_ptr() : nullptr;
  p.out_stride = out.stride(0);
  p.x_stride = x.stride(0);
  p.rows = static_cast<int>(rows);
  p.n = static_cast<int>(n);
  p.k = static_cast<int>(k);
  const auto stream = at::cuda::getCurrentCUDAStream();
  dispatch_dtype(x.scalar_type(), "gemv", [&](auto t) {
    using T = decltype(t);
    if (rows == 1)
      launch_gemv<T, 1>(p, swiglu, stream);
    else
      launch_gemv<T, 2>(p, swiglu, stream);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace voltllm
