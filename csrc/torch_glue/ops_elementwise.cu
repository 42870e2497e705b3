// Torch glue for the KV-cache write, RMSNorm, rotary embedding, SiLU-and-mul and the fused attention
// prologue: checks, device guard, stream, dtype dispatch.
#include <algorithm>

#include "torch_glue/torch_glue.h"
#include "ops/activation.cuh"
#include "ops/kv_cache_write.cuh"
#include "ops/qk_norm_rope.cuh"
#include "ops/rms_norm.cuh"
#include "ops/rotary.cuh"

namespace voltllm {

using namespace glue;

void kv_cache_write(const at::Tensor& key, const at::Tensor& value, at::Tensor& kv_cache,
                    const at::Tensor& slot_mapping) {
  check_dtype(key, "kv_cache_write");
  check_rows(key, "key");
  check_rows(value, "value");
  check_same_dtype(key, value, "kv_cache_write");
  check_same_dtype(key, kv_cache, "kv_cache_write");
  TORCH_CHECK(key.dim() == 3 && value.sizes() == key.sizes(), "key/value must be [num_tokens, num_kv_heads, head_size]");
  check_kv_cache(kv_cache, key.size(2));
  TORCH_CHECK(kv_cache.size(3) == key.size(1), "kv_cache has ", num(kv_cache.size(3)), " kv heads, key has ", num(key.size(1)));
  check_cuda(slot_mapping, "slot_mapping");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1 &&
                  slot_mapping.size(0) == key.size(0) && slot_mapping.is_contiguous(),
              "slot_mapping must be a contiguous int64 [num_tokens] tensor");
  TORCH_CHECK(vec8_ok(key, key.size(1) * key.size(2)) && vec8_ok(value, key.size(1) * key.size(2)),
              "key/value rows must be 16-byte aligned");
  if (key.size(0) == 0) return;
  const at::cuda::OptionalCUDAGuard guard(key.device());
  KvWriteParams p{};
  p.key = key.data_ptr();
  p.value = value.data_ptr();
  p.slot_mapping = reinterpret_cast<const long long*>(slot_mapping.data_ptr<int64_t>());
  p.key_cache = kv_cache[0].data_ptr();
  p.value_cache = kv_cache[1].data_ptr();
  p.key_stride = key.stride(0);
  p.value_stride = value.stride(0);
  p.num_slots = kv_cache.size(1) * kBlockSize;
  p.num_tokens = key.size(0);
  p.row_elems = key.size(1) * key.size(2);
  const auto stream = at::cuda::getCurrentCUDAStream();
  dispatch_dtype(key.scalar_type(), "kv_cache_write", [&](auto t) {
    using T = decltype(t);
    launch(kv_cache_write_kernel<T>, p.num_tokens, 128, 0, stream, p);
  });
}

void rms_norm(at::Tensor& out, const at::Tensor& input, const at::Tensor& weight, double eps) {
  check_dtype(input, "rms_norm");
  check_rows(input, "input");
  check_rows(out, "out");
  TORCH_CHECK(input.dim() == 2 && out.sizes() == input.sizes(), "rms_norm: input/out must be [num_tokens, hidden]");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == input.size(1) && weight.is_contiguous(),
              "rms_norm: weight must be contiguous [hidden]");
  check_same_dtype(input, out, "rms_norm");
  check_same_dtype(input, weight, "rms_norm");
  if (input.size(0) == 0) return;
  const at::cuda::OptionalCUDAGuard guard(input.device());
  RmsNormParams p{};
  p.out = out.data_ptr();
  p.input = input.data_ptr();
  p.weight = weight.data_ptr();
  p.out_stride = out.stride(0);
  p.input_stride = input.stride(0);
  p.hidden = input.size(1);
  p.eps = static_cast<float>(eps);
  const bool vec = vec8_ok(input, p.hidden) && vec8_ok(out, p.hidden) &&
                   reinterpret_cast<uintptr_t>(weight.data_ptr()) % 16 == 0;
  const auto stream = at::cuda::getCurrentCUDAStream();
  dispatch_dtype(input.scalar_type(), "rms_norm", [&](auto t) {
    using T = decltype(t);
    if (vec)
      launch(rms_norm_kernel<T, 8>, input.size(0), 256, 0, stream, p);
    else
      launch(rms_norm_kernel<T, 1>, input.size(0), 256, 0, stream, p);
  });
}

void fused_add_rms_norm(at::Tensor& input, at::Tensor& residual, const at::Tensor& weight, double eps) {
  check_dtype(input, "fused_add_rms_norm");
  check_rows(input, "input");
  check_cuda(residual, "residual");
  TORCH_CHECK(input.dim() == 2 && residual.sizes() == input.sizes() && residual.is_contiguous(),
              "fused_add_rms_norm: input and a contiguous residual must be [num_tokens, hidden]");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == input.size(1) && weight.is_contiguous(),
              "fused_add_rms_norm: weight must be contiguous [hidden]");
  check_same_dtype(input, residual, "fused_add_rms_norm");
  check_same_dtype(input, weight, "fused_add_rms_norm");
  if (input.size(0) == 0) return;
  const at::cuda::OptionalCUDAGuard guard(input.device());
  RmsNormParams p{};
  p.out = input.data_ptr();
  p.input = input.data_ptr();
  p.residual = residual.data_ptr();
  p.weight = weight.data_ptr();
  p.out_stride = input.stride(0);
  p.input_stride = input.stride(0);
  p.hidden = input.size(1);
  p.eps = static_cast<float>(eps);
  const bool vec = vec8_ok(input, p.hidden) && vec8_ok(residual, p.hidden) &&
                   reinterpret_cast<uintptr_t>(weight.data_ptr()) % 16 == 0;
  const auto stream = at::cuda::getCurrentCUDAStream();
  dispatch_dtype(input.scalar_type(), "fused_add_rms_norm", [&](auto t) {
    using T = decltype(t);
    if (vec)
      launch(fused_add_rms_norm_kernel<T, 8>, input.size(0), 256, 0, stream, p);
    else
      launch(fused_add_rms_norm_kernel<T, 1>, input.size(0), 256, 0, stream, p);
  });
}

void rotary_embedding(const at::Tensor& positions, at::Tensor& query, const std::optional<at::Tensor>& key,
                      const at::Tensor& cos_sin_cache, int64_t head_size, bool is_neox) {
  check_dtype(query, "rotary_embedding");
  check_cuda(positions, "positions");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.dim() == 1 && positions.is_contiguous(),
              "rotary_embedding: positions must be a contiguous int64 [num_tokens] tensor");
  const int64_t num_tokens = positions.size(0);
  check_rows(query, "query");
  TORCH_CHECK(num_tokens == 0 || (query.size(0) == num_tokens && query.numel() % (num_tokens * head_size) == 0),
              "rotary_embedding: query must be [num_tokens, num_heads * head_size]");
  check_cuda(cos_sin_cache, "cos_sin_cache");
  TORCH_CHECK(cos_sin_cache.scalar_type() == at::kFloat && cos_sin_cache.dim() == 2 && cos_sin_cache.is_contiguous(),
              "rotary_embedding: cos_sin_cache must be a contiguous float32 [max_position, rot_dim] tensor");
  TORCH_CHECK(head_size > 0, "rotary_embedding: head_size must be positive");
  const int64_t rot_dim = cos_sin_cache.size(1);
  TORCH_CHECK(rot_dim % 2 == 0 && rot_dim <= head_size, "rotary_embedding: rot_dim ", num(rot_dim),
              " must be even and <= head_size ", num(head_size));
  RotaryParams p{};
  if (key.has_value()) {
    check_rows(*key, "key");
    check_same_dtype(query, *key, "rotary_embedding");
    TORCH_CHECK(key->size(0) == num_tokens, "rotary_embedding: key must have num_tokens rows");
    p.key = key->data_ptr();
    p.key_stride = key->stride(0);
    p.num_kv_heads = key->numel() / std::max<int64_t>(num_tokens, 1) / head_size;
  }
  if (num_tokens == 0) return;
  const at::cuda::OptionalCUDAGuard guard(query.device());
  p.positions = reinterpret_cast<const long long*>(positions.data_ptr<int64_t>());
  p.query = query.data_ptr();
  p.cos_sin_cache = cos_sin_cache.data_ptr<float>();
  p.query_stride = query.stride(0);
  p.max_position = cos_sin_cache.size(0);
  p.num_heads = query.numel() / num_tokens / head_size;
  p.head_size = head_size;
  p.rot_dim = rot_dim;
  const auto stream = at::cuda::getCurrentCUDAStream();
  dispatch_dtype(query.scalar_type(), "rotary_embedding", [&](auto t) {
    using T = decltype(t);
    if (is_neox)
      launch(rotary_embedding_kernel<T, true>, num_tokens, 256, 0, stream, p);
    else
      launch(rotary_embedding_kernel<T, false>, num_tokens, 256, 0, stream, p);
  });
}

void silu_and_mul(at::Tensor& out, const at::Tensor& input) {
  check_dtype(input, "silu_and_mul");
  check_rows(input, "input");
  check_rows(out, "out");
  TORCH_CHECK(input.dim() == 2 && out.dim() == 2 && input.size(0) == out.size(0) && input.size(1) == 2 * out.size(1),
              "silu_and_mul: input must be [num_tokens, 2 * d] and out [num_tokens, d]");
  check_same_dtype(input, out, "silu_and_mul");
  if (input.size(0) == 0) return;
  const at::cuda::OptionalCUDAGuard guard(input.device());
  SiluAndMulParams p{};
  p.out = out.data_ptr();
  p.input = input.data_ptr();
  p.out_stride = out.stride(0);
  p.input_stride = input.stride(0);
  p.d = out.size(1);
  const bool vec = vec8_ok(input, p.d) && vec8_ok(out, p.d);
  const auto stream = at::cuda::getCurrentCUDAStream();
  dispatch_dtype(input.scalar_type(), "silu_and_mul", [&](auto t) {
    using T = decltype(t);
    if (vec)
      launch(silu_and_mul_kernel<T, 8>, input.size(0), 256, 0, stream, p);
    else
      launch(silu_and_mul_kernel<T, 1>, input.size(0), 256, 0, stream, p);
  });
}

void qk_norm_rope_kv_write(at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos_sin_cache,
                           const std::optional<at::Tensor>& q_weight, const std::optional<at::Tensor>& k_weight,
                           double eps, int64_t num_heads, at::Tensor& kv_cache, const at::Tensor& slot_mapping) {
  const char* op = "qk_norm_rope_kv_write";
  check_cuda(qkv, "qkv");
  check_dtype(qkv, op);
  check_same_dtype(qkv, kv_cache, op);
  TORCH_CHECK(kv_cache.dim() == 5, op, ": kv_cache must be [2, num_blocks, block_size, num_kv_heads, head_size]");
  const int64_t head_size = kv_cache.size(4), num_kv_heads = kv_cache.size(3), num_tokens = qkv.size(0);
  check_kv_cache(kv_cache, head_size);
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1 && qkv.size(1) == (num_heads + 2 * num_kv_heads) * head_size, op,
              ": qkv must be [num_tokens, (num_heads + 2 * num_kv_heads) * head_size] with contiguous rows");
  check_qk_prologue(qkv, positions, cos_sin_cache, q_weight, k_weight, slot_mapping, num_tokens, head_size, op);
  if (num_tokens == 0) return;
  const at::cuda::OptionalCUDAGuard guard(qkv.device());
  QkNormRopeParams p{};
  p.qkv = qkv.data_ptr();
  p.positions = reinterpret_cast<const long long*>(positions.data_ptr<int64_t>());
  p.cos_sin_cache = cos_sin_cache.data_ptr<float>();
  p.q_weight = q_weight ? q_weight->data_ptr() : nullptr;
  p.k_weight = k_weight ? k_weight->data_ptr() : nullptr;
  p.key_cache = kv_cache[0].data_ptr();
  p.value_cache = kv_cache[1].data_ptr();
  p.slot_mapping = reinterpret_cast<const long long*>(slot_mapping.data_ptr<int64_t>());
  p.qkv_stride = qkv.stride(0);
  p.max_position = cos_sin_cache.size(0);
  p.num_slots = kv_cache.size(1) * kBlockSize;
  p.num_heads = static_cast<int>(num_heads);
  p.num_kv_heads = static_cast<int>(num_kv_heads);
  p.eps = static_cast<float>(eps);
  const int threads = 32 * static_cast<int>(std::min<int64_t>(num_heads + num_kv_heads, 16));
  const auto stream = at::cuda::getCurrentCUDAStream();
  dispatch_dtype(qkv.scalar_type(), op, [&](auto t) {
    using T = decltype(t);
    dispatch_head_size(head_size, op, [&](auto h) {
      constexpr int H = decltype(h)::value;
      launch(qk_norm_rope_kernel<T, H>, num_tokens, threads, 0, stream, p);
    });
  });
}

}  // namespace voltllm
