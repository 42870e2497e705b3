// C entry point that runs the fused attention prologue (qk_norm_rope.cuh) on the CPU emulator, for
// tests/kernels/test_qk_norm_rope_emulated.py (loaded with ctypes; pointers are CPU torch tensors).
#include "cuda_emu.h"
// The kernel header comes after the emulator, which stands in for the CUDA toolchain.
#include "qk_norm_rope.cuh"

namespace {

template <typename T, int HEAD>
void run(const voltllm::QkNormRopeParams& p, int num_tokens, unsigned seed) {
  const int warps = p.num_heads + p.num_kv_heads < 16 ? p.num_heads + p.num_kv_heads : 16;
  emu::launch(dim3(num_tokens), dim3(32 * warps), 0, [&] { voltllm::qk_norm_rope_kernel<T, HEAD>(p); }, seed);
}

template <typename T>
void run_head(int head, const voltllm::QkNormRopeParams& p, int num_tokens, unsigned seed) {
  switch (head) {
    case 64: return run<T, 64>(p, num_tokens, seed);
    case 128: return run<T, 128>(p, num_tokens, seed);
    case 256: return run<T, 256>(p, num_tokens, seed);
    default: emu::fail("head size");
  }
}

}  // namespace

extern "C" {

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
  if (bf16) {
    run_head<__nv_bfloat16>(head, p, num_tokens, seed);
  } else {
    run_head<__half>(head, p, num_tokens, seed);
  }
}

}  // extern "C"
