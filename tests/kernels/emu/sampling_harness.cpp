// C entry point that runs the sampling kernel (csrc/sampling/radix_sampling.cuh) on the CPU emulator, for
// tests/kernels/test_sampling_emulated.py (loaded with ctypes; pointers are CPU torch tensors).
#include <vector>

#include "cuda_emu.h"
// The kernel headers come after the emulator, which stands in for the CUDA toolchain.
#include "dispatch.h"
#include "sampling/radix_sampling.cuh"

extern "C" {

// dtype: 0 fp32, 1 fp16, 2 bf16. `threads` stands in for the block size (a power of two, 32..1024).
void emu_radix_sampling(int dtype, long long* out, const void* logits, long long logits_stride,
                        const float* temperature, const int* top_k, const float* top_p, const float* min_p,
                        const unsigned long long* seeds, int rows, int vocab, int threads, unsigned seed) {
  const int splits = (vocab + voltllm::kRaceSplit - 1) / voltllm::kRaceSplit;
  std::vector<float> race_score(static_cast<size_t>(rows) * splits);
  std::vector<int> race_index(race_score.size());
  voltllm::SampleParams p{out,  logits, logits_stride,     temperature,       top_k, top_p,
                          min_p, seeds, race_score.data(), race_index.data(), splits, vocab};
  auto run = [&](auto t) {
    using T = decltype(t);
    // The glue's order: the split race (both halves), then the filtered rows.
    emu::launch(dim3(rows, splits), dim3(threads < 256 ? threads : 256), voltllm::race_smem_bytes(),
                [&] { voltllm::race_partial_kernel<T>(p); }, seed);
    emu::launch(dim3(rows), dim3(32), 0, [&] { voltllm::race_merge_kernel(p); }, seed);
    emu::launch(dim3(rows), dim3(threads), voltllm::sample_smem_bytes(), [&] { voltllm::radix_sampling_kernel<T>(p); },
                seed);
  };
  if (dtype == 0) {
    run(float{});
  } else {
    emu::dispatch_dtype(dtype == 2, run);
  }
}

}  // extern "C"
