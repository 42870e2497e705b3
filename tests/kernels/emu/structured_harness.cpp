// C entry point that runs the structured-output mask kernel (csrc/structured/apply_token_bitmask.cuh) on
// the CPU emulator, for tests/kernels/test_structured_emulated.py (loaded with ctypes; pointers are CPU
// torch tensors).
#include "cuda_emu.h"
// The kernel headers come after the emulator, which stands in for the CUDA toolchain.
#include "dispatch.h"
#include "structured/apply_token_bitmask.cuh"

extern "C" {

// dtype: 0 fp32, 1 fp16, 2 bf16. rows may be NULL (mask m is logits row m). The glue's launch shape.
void emu_apply_token_bitmask(int dtype, void* logits, long long logits_stride, int num_rows, const int* bitmask,
                             const int* rows, int num_masks, int words, int vocab, unsigned seed) {
  voltllm::TokenBitmaskParams p{logits, logits_stride, bitmask, rows, words, vocab, num_rows};
  const dim3 grid(voltllm::apply_token_bitmask_blocks(vocab), num_masks);
  auto run = [&](auto t) {
    using T = decltype(t);
    emu::launch(grid, dim3(voltllm::kBitmaskThreads), 0, [&] { voltllm::apply_token_bitmask_kernel<T>(p); }, seed);
  };
  if (dtype == 0) {
    run(float{});
  } else {
    emu::dispatch_dtype(dtype == 2, run);
  }
}

}  // extern "C"
