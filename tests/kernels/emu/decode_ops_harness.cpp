// C entry points that run the decode-path kernels written beside attention (the fused attention prologue
// qk_norm_rope.cuh, the GEMV gemv.cuh, plain and with the add + RMSNorm prologue) on the CPU emulator, for tests/kernels/test_decode_ops_emulated.py
// (loaded with ctypes; pointers are CPU torch tensors).
#include "cuda_emu.h"
// The kernel headers come after the emulator, which stands in for the CUDA toolchain.
#include "dispatch.h"
#include "ops/gemv.cuh"
#include "ops/qk_norm_rope.cuh"

namespace {

template <typename T, int ROWS, bool SWIGLU, typename Out = T>
void run_gemv(const voltllm::GemvParams& p, unsigned seed) {
  const int blocks = (p.n + voltllm::kGemvWarps - 1) / voltllm::kGemvWarps;
  emu::launch(dim3(blocks), dim3(32 * voltllm::kGemvWarps), 0,
              [&] { voltllm::gemv_kernel<T, ROWS, SWIGLU, Out>(p); }, seed);
}

// float_out: the plain GEMV storing float32 (the glue's choice for a float32 out).
template <typename T>
void run_gemv_rows(const voltllm::GemvParams& p, bool swiglu, bool float_out, unsigned seed) {
  if (float_out) {
    p.rows == 1 ? run_gemv<T, 1, false, float>(p, seed) : run_gemv<T, 2, false, float>(p, seed);
  } else if (p.rows == 1) {
    swiglu ? run_gemv<T, 1, true>(p, seed) : run_gemv<T, 1, false>(p, seed);
  } else {
    swiglu ? run_gemv<T, 2, true>(p, seed) : run_gemv<T, 2, false>(p, seed);
  }
}

template <typename T, int ROWS>
void run_gemv_norm(const voltllm::GemvNormParams& p, bool swiglu, int blocks, unsigned seed) {
  const size_t smem = voltllm::gemv_norm_smem_bytes(ROWS, p.k);
  const dim3 block(32 * voltllm::kGemvNormWarps);
  if (swiglu) {
    emu::launch(dim3(blocks), block, smem, [&] { voltllm::gemv_norm_kernel<T, ROWS, true>(p); }, seed);
  } else {
    emu::launch(dim3(blocks), block, smem, [&] { voltllm::gemv_norm_kernel<T, ROWS, false>(p); }, seed);
  }
}

template <typename T>
void run_gemv_norm_rows(const voltllm::GemvNormParams& p, bool swiglu, int blocks, unsigned seed) {
  if (p.rows == 1) {
    run_gemv_norm<T, 1>(p, swiglu, blocks, seed);
  } else {
    run_gemv_norm<T, 2>(p, swiglu, blocks, seed);
  }
}

}  // namespace

extern "C" {

// `blocks` stands in for the glue's resident-block count: fewer blocks than ceil(n / warps) make each
// warp loop over several features.
void emu_add_rms_norm_gemv(int bf16, void* out, void* residual_out, const void* hidden, const void* residual_in,
                           const void* norm_weight, const void* weight, const void* bias, long long out_stride,
                           long long residual_out_stride, long long hidden_stride, long long residual_in_stride,
                           float eps, int rows, int n, int k, int swiglu, int blocks, unsigned seed) {
  voltllm::GemvNormParams p{};
  p.out = out;
  p.residual_out = residual_out;
  p.hidden = hidden;
  p.residual_in = residual_in;
  p.norm_weight = norm_weight;
  p.weight = weight;
  p.bias = bias;
  p.out_stride = out_stride;
  p.residual_out_stride = residual_out_stride;
  p.hidden_stride = hidden_stride;
  p.residual_in_stride = residual_in_stride;
  p.eps = eps;
  p.rows = rows;
  p.n = n;
  p.k = k;
  emu::dispatch_dtype(bf16, [&](auto t) { run_gemv_norm_rows<decltype(t)>(p, swiglu != 0, blocks, seed); });
}

void emu_gemv(int bf16, void* out, const void* x, const void* weight, const void* bias, long long out_stride,
              long long x_stride, int rows, int n, int k, int swiglu, int float_out, unsigned seed) {
  voltllm::GemvParams p{};
  p.out = out;
  p.x = x;
  p.weight = weight;
  p.bias = bias;
  p.out_stride = out_stride;
  p.x_stride = x_stride;
  p.rows = rows;
  p.n = n;
  p.k = k;
  emu::dispatch_dtype(bf16, [&](auto t) { run_gemv_rows<decltype(t)>(p, swiglu != 0, float_out != 0, seed); });
}

void emu_qk_norm_rope(int bf16, int head, void* qkv, const long long* positions, const float* cos_sin,
                      const void* q_weight, const void* k_weight, void* key_cache, void* value_cache,
                      const long long* slot_mapping, long long qkv_stride, long long max_position,
                      long long num_slots, int num_heads, int num_kv_heads, float eps, int num_tokens,
                      unsigned seed) {
  voltllm::QkNormRopeParams p{};
  p.qkv = qkv;
  p.positions = positions;
  p.cos_sin_cache = cos_sin;
  p.q_weight = q_weight;
  p.k_weight = k_weight;
  p.key_cache = key_cache;
  p.value_cache = value_cache;
  p.slot_mapping = slot_mapping;
  p.qkv_stride = qkv_stride;
  p.max_position = max_position;
  p.num_slots = num_slots;
  p.num_heads = num_heads;
  p.num_kv_heads = num_kv_heads;
  p.eps = eps;
  const int warps = num_heads + num_kv_heads < 16 ? num_heads + num_kv_heads : 16;
  emu::dispatch_dtype(bf16, [&](auto t) {
    emu::dispatch_head(head, [&](auto h) {
      emu::launch(dim3(num_tokens), dim3(32 * warps), 0,
                  [&] { voltllm::qk_norm_rope_kernel<decltype(t), decltype(h)::value>(p); }, seed);
    });
  });
}

}  // extern "C"
