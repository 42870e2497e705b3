// Helpers shared by the torch glue files: checks and dtype / head-size dispatch.
#pragma once

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/all.h>

#include <optional>
#include <string>
#include <type_traits>
#include <utility>

#include "common.cuh"

namespace voltllm {
namespace glue {

// Numbers in error messages go through std::to_string: streaming integers into c10::str crashed (a
// libstdc++ locale mismatch between this extension and torch, seen with torch 2.11 + CUDA 13).
inline std::string num(int64_t v) { return std::to_string(v); }

// Calls fn with a T of the tensor's dtype; every other dtype is an error.
template <typename Fn>
void dispatch_dtype(at::ScalarType dtype, const char* op, Fn&& fn) {
  switch (dtype) {
    case at::ScalarType::Half:
      fn(__half{});
      break;
    case at::ScalarType::BFloat16:
      fn(__nv_bfloat16{});
      break;
    default:
      TORCH_CHECK(false, op, ": unsupported dtype ", dtype, " (float16 or bfloat16)");
  }
}

template <typename Fn>
void dispatch_head_size(int64_t head_size, const char* op, Fn&& fn) {
  switch (head_size) {
    case 64:
      fn(std::integral_constant<int, 64>{});
      break;
    case 128:
      fn(std::integral_constant<int, 128>{});
      break;
    case 256:
      fn(std::integral_constant<int, 256>{});
      break;
    default:
      TORCH_CHECK(false, op, ": unsupported head_size ", num(head_size), " (64, 128 or 256)");
  }
}

// Checked before dispatching, so that bad input is reported from plain host code. (The dispatch
// switches still end in an error for anything that slips past.)
inline void check_dtype(const at::Tensor& t, const char* op) {
  TORCH_CHECK(t.scalar_type() == at::kHalf || t.scalar_type() == at::kBFloat16, op, ": unsupported dtype ",
              t.scalar_type(), " (float16 or bfloat16)");
}

inline void check_cuda(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda(), name, " must be a CUDA tensor");
}

// Rows of a [rows, ...] tensor: the trailing dims must be contiguous and 16-byte aligned.
inline void check_rows(const at::Tensor& t, const char* name) {
  check_cuda(t, name);
  TORCH_CHECK(t.dim() >= 2, name, " must have at least 2 dims");
  for (int64_t d = t.dim() - 1, expect = 1; d >= 1; --d) {
    TORCH_CHECK(t.size(d) == 1 || t.stride(d) == expect, name, " must be contiguous past its first dim");
    expect *= t.size(d);
  }
}

inline bool vec8_ok(const at::Tensor& t, int64_t width) {
  return width % 8 == 0 && t.stride(0) % 8 == 0 && reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
}

// Whether two 2-D tensors' row spans (first byte of row 0 to the last byte of the last row) share a byte:
// the fused add+norm kernels write one while other blocks still read the other.
inline bool rows_overlap(const at::Tensor& a, const at::Tensor& b) {
  const auto span = [](const at::Tensor& t) {
    const auto first = reinterpret_cast<uintptr_t>(t.data_ptr());
    const auto bytes = static_cast<uintptr_t>(((t.size(0) - 1) * t.stride(0) + t.size(1)) * t.element_size());
    return std::pair<uintptr_t, uintptr_t>{first, first + bytes};
  };
  const auto [a0, a1] = span(a);
  const auto [b0, b1] = span(b);
  return a0 < b1 && b0 < a1;
}

inline void check_same_dtype(const at::Tensor& a, const at::Tensor& b, const char* what) {
  TORCH_CHECK(a.scalar_type() == b.scalar_type(), what, ": dtypes differ (", a.scalar_type(), " vs ",
              b.scalar_type(), ")");
}

inline void check_tensor_core_dtype(at::ScalarType dtype, const char* op) {
  if (dtype != at::ScalarType::BFloat16) return;
  const auto* prop = at::cuda::getCurrentDeviceProperties();
  TORCH_CHECK(prop->major >= 8, op, ": bfloat16 attention needs SM80 or newer (this GPU is SM", num(prop->major),
              num(prop->minor), "); use float16");
}

inline void check_kv_cache(const at::Tensor& kv_cache, int64_t head_size) {
  check_cuda(kv_cache, "kv_cache");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2,
              "kv_cache must be [2, num_blocks, block_size, num_kv_heads, head_size]");
  TORCH_CHECK(kv_cache.is_contiguous(), "kv_cache must be contiguous");
  TORCH_CHECK(kv_cache.size(2) == kBlockSize, "kv_cache block_size must be ", num(kBlockSize), ", got ",
              num(kv_cache.size(2)));
  TORCH_CHECK(kv_cache.size(4) == head_size, "kv_cache head_size ", num(kv_cache.size(4)), " != ", num(head_size));
}

// Above 48 KB a kernel must opt in to dynamic shared memory. Cheap (no stream work), and legal
// during CUDA graph capture, so it is simply done before every launch: per device, no cache to go stale.
template <typename Kernel>
void set_smem(Kernel kernel, int bytes) {
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
}

// Whether kernels on the current device are launched as programmatic dependent launches: SM90 and
// newer. See begin_dependent_grid in common.cuh. (No switch: the plain stream order it replaced was
// measured in benches/RESULTS.md, 856 -> 1,007 tokens/s at batch 1 on the H200.)
inline bool dependent_launch_enabled() {
  return at::cuda::getCurrentDeviceProperties()->major >= 9;
}

// kernel<<<grid, block, smem, stream>>>(args...), as a programmatic dependent launch where enabled,
// so that the kernel is scheduled while the one before it still runs. Every kernel launched through
// here must start with begin_dependent_grid() (which waits for that kernel's results).
template <typename... Params, typename... Args>
void launch(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream, Args&&... args) {
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  config.attrs = attribute;
  config.numAttrs = dependent_launch_enabled() ? 1 : 0;
  C10_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...));
}

// The attention prologue's inputs besides qkv (qk_norm_rope_kv_write, and the decode kernel that folds the
// prologue in): optional per-head q/k norm weights (both or neither), int64 positions and cache slots of
// the `num_tokens` tokens, and the fp32 rotary table of `head_size` columns.
inline void check_qk_prologue(const at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos_sin_cache,
                              const std::optional<at::Tensor>& q_weight, const std::optional<at::Tensor>& k_weight,
                              const at::Tensor& slot_mapping, int64_t num_tokens, int64_t head_size, const char* op) {
  for (const auto* w : {&q_weight, &k_weight}) {
    if (*w) {
      check_cuda(**w, "q/k norm weight");
      check_same_dtype(qkv, **w, op);
      TORCH_CHECK((*w)->dim() == 1 && (*w)->size(0) == head_size && (*w)->is_contiguous(), op,
                  ": q/k norm weights must be [head_size]");
    }
  }
  TORCH_CHECK(q_weight.has_value() == k_weight.has_value(), op, ": give both q and k norm weights or neither");
  check_cuda(positions, "positions");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.dim() == 1 && positions.size(0) == num_tokens &&
                  positions.is_contiguous(),
              op, ": positions must be a contiguous int64 [num_tokens] tensor");
  check_cuda(cos_sin_cache, "cos_sin_cache");
  TORCH_CHECK(cos_sin_cache.scalar_type() == at::kFloat && cos_sin_cache.dim() == 2 && cos_sin_cache.is_contiguous() &&
                  cos_sin_cache.size(1) == head_size,
              op, ": cos_sin_cache must be a contiguous float32 [max_position, head_size] tensor");
  check_cuda(slot_mapping, "slot_mapping");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1 &&
                  slot_mapping.size(0) == num_tokens && slot_mapping.is_contiguous(),
              op, ": slot_mapping must be a contiguous int64 [num_tokens] tensor");
}

struct AttentionShape {
  int64_t num_heads, num_kv_heads, head_size;
};

inline AttentionShape check_attention(const at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache,
                               const at::Tensor& block_tables, const at::Tensor& seq_lens, const char* op) {
  check_rows(query, "query");
  check_rows(out, "out");
  TORCH_CHECK(query.dim() == 3, op, ": query must be [num_tokens, num_heads, head_size]");
  TORCH_CHECK(out.sizes() == query.sizes(), op, ": out must have the shape of query");
  check_same_dtype(query, out, op);
  check_same_dtype(query, kv_cache, op);
  check_dtype(query, op);
  TORCH_CHECK(query.size(2) == 64 || query.size(2) == 128 || query.size(2) == 256, op, ": unsupported head_size ",
              num(query.size(2)), " (64, 128 or 256)");
  check_kv_cache(kv_cache, query.size(2));
  const int64_t num_heads = query.size(1), num_kv_heads = kv_cache.size(3);
  TORCH_CHECK(num_heads % num_kv_heads == 0, op, ": num_heads ", num(num_heads), " is not a multiple of num_kv_heads ",
              num(num_kv_heads));
  TORCH_CHECK(query.stride(0) % 8 == 0 && out.stride(0) % 8 == 0, op, ": query/out rows must be 16-byte aligned");
  check_cuda(block_tables, "block_tables");
  check_cuda(seq_lens, "seq_lens");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.dim() == 2 && block_tables.is_contiguous(),
              op, ": block_tables must be a contiguous int32 [num_seqs, max_blocks_per_seq] tensor");
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.dim() == 1 && seq_lens.is_contiguous() &&
                  seq_lens.size(0) == block_tables.size(0),
              op, ": seq_lens must be a contiguous int32 [num_seqs] tensor");
  check_tensor_core_dtype(query.scalar_type(), op);
  return {num_heads, num_kv_heads, query.size(2)};
}

}  // namespace glue
}  // namespace voltllm
