// Torch glue for the skinny decode GEMV (plain, and with the residual add + RMSNorm as its prologue):
// checks, device guard, stream, dtype, row-count and epilogue dispatch.
#include <algorithm>
#include <type_traits>
#include <utility>

#include "torch_glue/torch_glue.h"
#include "ops/gemv.cuh"

namespace voltllm {

using namespace glue;

namespace {

// Calls fn(T{}, rows, swiglu) with the dtype, the row count (1 or 2) and the epilogue as compile-time
// values, the template arguments both GEMV kernels take.
template <typename Fn>
void dispatch_gemv(at::ScalarType dtype, int64_t rows, bool swiglu, const char* op, Fn&& fn) {
  dispatch_dtype(dtype, op, [&](auto t) {
    auto with_rows = [&](auto r) {
      if (swiglu)
        fn(t, r, std::true_type{});
      else
        fn(t, r, std::false_type{});
    };
    if (rows == 1)
      with_rows(std::integral_constant<int, 1>{});
    else
      with_rows(std::integral_constant<int, 2>{});
  });
}

struct GemvShape {
  int64_t rows, n, k;
};

// The checks both GEMV ops share: x [rows <= 2, k] with contiguous, 16-byte aligned rows, weight
// [n, k] ([2n, k] for swiglu) contiguous, out [rows, n] of x's dtype (or float32 where `float_out` allows
// it: a plain GEMV), bias one entry per weight row.
GemvShape check_gemv(const at::Tensor& out, const at::Tensor& x, const at::Tensor& weight,
                     const std::optional<at::Tensor>& bias, bool swiglu, const char* op, bool float_out = false) {
  check_cuda(x, "x");
  check_cuda(out, "out");
  check_dtype(x, op);
  check_same_dtype(x, weight, op);
  if (float_out && out.scalar_type() == at::kFloat) {
    TORCH_CHECK(!swiglu, op, ": a float32 out takes a plain GEMV, not swiglu");
  } else {
    check_same_dtype(x, out, op);
  }
  check_cuda(weight, "weight");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && out.dim() == 2, op, ": x, weight and out must be 2-D");
  const int64_t rows = x.size(0), k = weight.size(1), n = swiglu ? weight.size(0) / 2 : weight.size(0);
  TORCH_CHECK(!swiglu || weight.size(0) % 2 == 0, op, ": swiglu needs a [2n, k] gate/up weight");
  TORCH_CHECK(x.size(1) == k, op, ": weight is [", num(weight.size(0)), ", ", num(k), "], x has ", num(x.size(1)),
              " features");
  TORCH_CHECK(out.size(0) == rows && out.size(1) == n, op, ": out must be [rows, n]");
  TORCH_CHECK(rows >= 1 && rows <= 2, op, ": 1 or 2 rows, got ", num(rows));
  TORCH_CHECK(weight.is_contiguous(), op, ": weight must be contiguous");
  TORCH_CHECK(x.stride(1) == 1 && out.stride(1) == 1, op, ": x and out rows must be contiguous");
  TORCH_CHECK(vec8_ok(x, k) && reinterpret_cast<uintptr_t>(weight.data_ptr()) % 16 == 0 && k % 8 == 0, op,
              ": k must be a multiple of 8 and x/weight 16-byte aligned");
  if (bias) {
    check_same_dtype(x, *bias, op);
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == weight.size(0) && bias->is_contiguous(), op,
                ": bias must have one entry per weight row");
  }
  return {rows, n, k};
}

}  // namespace

void gemv(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
          bool swiglu) {
  // Plain locals, not a structured binding: the dispatch lambda captures rows (C++17 cannot).
  const GemvShape shape = check_gemv(out, x, weight, bias, swiglu, "gemv", /*float_out=*/true);
  const int64_t rows = shape.rows, n = shape.n, k = shape.k;
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
  const int blocks = static_cast<int>((n + kGemvWarps - 1) / kGemvWarps);
  const bool float_out = out.scalar_type() == at::kFloat;
  dispatch_gemv(x.scalar_type(), rows, swiglu, "gemv", [&](auto t, auto r, auto glu) {
    using T = decltype(t);
    constexpr int kRows = decltype(r)::value;
    if constexpr (!decltype(glu)::value) {
      if (float_out) {
        launch(gemv_kernel<T, kRows, false, float>, blocks, 32 * kGemvWarps, 0, stream, p);
        return;
      }
    }
    launch(gemv_kernel<T, kRows, decltype(glu)::value>, blocks, 32 * kGemvWarps, 0, stream, p);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void add_rms_norm_gemv(at::Tensor& out, at::Tensor& residual_out, const at::Tensor& hidden,
                       const at::Tensor& residual, const at::Tensor& norm_weight, double eps,
                       const at::Tensor& weight, const std::optional<at::Tensor>& bias, bool swiglu) {
  const char* op = "add_rms_norm_gemv";
  const GemvShape shape = check_gemv(out, hidden, weight, bias, swiglu, op);
  const int64_t rows = shape.rows, n = shape.n, k = shape.k;
  check_cuda(residual, "residual");
  check_cuda(residual_out, "residual_out");
  check_cuda(norm_weight, "norm_weight");
  check_same_dtype(hidden, residual, op);
  check_same_dtype(hidden, residual_out, op);
  check_same_dtype(hidden, norm_weight, op);
  TORCH_CHECK(residual.sizes() == hidden.sizes() && residual_out.sizes() == hidden.sizes(), op,
              ": residual and residual_out must have the shape of hidden");
  TORCH_CHECK(residual.stride(1) == 1 && residual_out.stride(1) == 1 && vec8_ok(residual, k) &&
                  vec8_ok(residual_out, k),
              op, ": residual rows must be contiguous and 16-byte aligned");
  TORCH_CHECK(norm_weight.dim() == 1 && norm_weight.size(0) == k && norm_weight.is_contiguous() &&
                  reinterpret_cast<uintptr_t>(norm_weight.data_ptr()) % 16 == 0,
              op, ": norm_weight must be a contiguous, 16-byte aligned [k]");
  TORCH_CHECK(k <= kGemvNormMaxK, op, ": hidden size ", num(k), " is over ", num(kGemvNormMaxK));
  // Block 0 writes residual_out, and every block out, while other blocks still read hidden and residual.
  TORCH_CHECK(!rows_overlap(residual_out, residual) && !rows_overlap(residual_out, hidden) &&
                  !rows_overlap(out, residual) && !rows_overlap(out, hidden) && !rows_overlap(out, residual_out),
              op, ": out and residual_out must not overlap each other, hidden or residual");
  const at::cuda::OptionalCUDAGuard guard(hidden.device());
  GemvNormParams p{};
  p.out = out.data_ptr();
  p.residual_out = residual_out.data_ptr();
  p.hidden = hidden.data_ptr();
  p.residual_in = residual.data_ptr();
  p.norm_weight = norm_weight.data_ptr();
  p.weight = weight.data_ptr();
  p.bias = bias ? bias->data_ptr() : nullptr;
  p.out_stride = out.stride(0);
  p.residual_out_stride = residual_out.stride(0);
  p.hidden_stride = hidden.stride(0);
  p.residual_in_stride = residual.stride(0);
  p.eps = static_cast<float>(eps);
  p.rows = static_cast<int>(rows);
  p.n = static_cast<int>(n);
  p.k = static_cast<int>(k);
  const auto stream = at::cuda::getCurrentCUDAStream();
  // Persistent: no more blocks than stay resident (the kernel's launch bounds guarantee this many per
  // SM), so that every block computes the norm once and then streams several features.
  const int resident = kGemvNormBlocksPerSm * at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int blocks = std::min(static_cast<int>((n + kGemvNormWarps - 1) / kGemvNormWarps), resident);
  const int smem = gemv_norm_smem_bytes(static_cast<int>(rows), static_cast<int>(k));
  dispatch_gemv(hidden.scalar_type(), rows, swiglu, op, [&](auto t, auto r, auto glu) {
    launch(gemv_norm_kernel<decltype(t), decltype(r)::value, decltype(glu)::value>, blocks, 32 * kGemvNormWarps,
           smem, stream, p);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace voltllm
