// What the mixture-of-experts glue files (ops_moe*.cu) share: argument checks and the quantized kind
// dispatch. In its own namespace (moe_glue), so that `using namespace glue` in a glue file meets no
// second definition of a name.
#pragma once

#include <type_traits>

#include "torch_glue/torch_glue.h"
#include "quantization/quant_common.cuh"

namespace voltllm {
namespace moe_glue {

using glue::check_cuda;
using glue::num;

inline void check_int32_vector(const at::Tensor& t, const char* name, const char* op) {
  check_cuda(t, name);
  TORCH_CHECK(t.scalar_type() == at::kInt && t.dim() == 1 && t.is_contiguous(), op, ": ", name,
              " must be a contiguous int32 vector");
}

inline void check_contiguous_rows(const at::Tensor& t, int64_t width, const char* name, const char* op) {
  check_cuda(t, name);
  TORCH_CHECK(t.dim() == 2 && t.size(1) == width && t.is_contiguous(), op, ": ", name, " must be a contiguous [rows, ",
              num(width), "] tensor");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, op, ": ", name, " must be 16-byte aligned");
}

// Calls fn(std::integral_constant<int, KIND>{}) for a QuantKind number.
template <typename Fn>
void dispatch_kind(int64_t kind, const char* op, Fn&& fn) {
  switch (kind) {
    case kQuantInt4:
      fn(std::integral_constant<int, kQuantInt4>{});
      break;
    case kQuantInt8:
      fn(std::integral_constant<int, kQuantInt8>{});
      break;
    case kQuantFp8:
      fn(std::integral_constant<int, kQuantFp8>{});
      break;
    default:
      TORCH_CHECK(false, op, ": unknown quantized kind ", num(kind), " (0 int4, 1 int8, 2 fp8)");
  }
}

// The stacked packed experts [E, rows, k * bits / 8] uint8 and their group parameters [E, rows,
// num_groups] int32: k, the groups' chunk shift; the rules of the quantized linear kernels
// (ops_quant.cu's check_packed) for each expert's slice.
struct StackedShape {
  int64_t experts, rows, k, num_groups, chunk_group_shift;
};

inline StackedShape check_stacked(const at::Tensor& weight, const at::Tensor& group_params, int64_t kind,
                                  int64_t group_size, const char* op) {
  TORCH_CHECK(kind >= kQuantInt4 && kind <= kQuantFp8, op, ": unknown quantized kind ", num(kind));
  check_cuda(weight, "weight");
  check_cuda(group_params, "group_params");
  TORCH_CHECK(weight.scalar_type() == at::kByte && weight.dim() == 3 && weight.is_contiguous() &&
                  reinterpret_cast<uintptr_t>(weight.data_ptr()) % 16 == 0,
              op, ": weight must be a contiguous, 16-byte aligned uint8 [experts, rows, k * bits / 8]");
  TORCH_CHECK(group_params.scalar_type() == at::kInt && group_params.dim() == 3 && group_params.is_contiguous(), op,
              ": group_params must be a contiguous int32 [experts, rows, num_groups]");
  const int64_t bits = kind == kQuantInt4 ? 4 : 8, chunk = 128 / bits;
  const int64_t experts = weight.size(0), rows = weight.size(1), k = weight.size(2) * 8 / bits;
  const int64_t num_groups = group_params.size(2);
  TORCH_CHECK(group_params.size(0) == experts && group_params.size(1) == rows, op,
              ": group_params must have the weight's experts and rows");
  TORCH_CHECK(k % 64 == 0 && k > 0, op, ": k must be a positive multiple of 64, got ", num(k));
  int64_t shift = 0;
  if (num_groups != 1) {
    TORCH_CHECK(group_size > 0 && group_size % chunk == 0 && num_groups * group_size == k, op, ": ",
                num(num_groups), " groups of ", num(group_size), " do not tile k = ", num(k));
    const int64_t chunks = group_size / chunk;
    TORCH_CHECK((chunks & (chunks - 1)) == 0, op, ": group size ", num(group_size),
                " is not a power-of-two number of ", num(chunk), "-code chunks");
    while ((int64_t{1} << shift) < chunks) ++shift;
  }
  return {experts, rows, k, num_groups, shift};
}

}  // namespace moe_glue
}  // namespace voltllm
