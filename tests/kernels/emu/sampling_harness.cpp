// C entry points that run the sampling kernels (csrc/sampling/radix_sampling.cuh, race_first_sampling.cuh)
// on the CPU emulator, for tests/kernels/test_sampling_emulated.py (loaded with ctypes; pointers are CPU
// torch tensors).
#include <algorithm>
#include <cstring>
#include <vector>

#include "cuda_emu.h"
// The kernel headers come after the emulator, which stands in for the CUDA toolchain.
#include "dispatch.h"
#include "sampling/radix_sampling.cuh"
#include "sampling/race_first_sampling.cuh"

extern "C" {

// dtype: 0 fp32, 1 fp16, 2 bf16. `threads` stands in for the split kernels' block size (a power of two,
// 32..256). top_k / top_p / min_p may be null (off for every row), as in the glue, which then launches
// nothing for them. The scratch starts as garbage, as the glue's torch.empty does.
void emu_radix_sampling(int dtype, long long* out, const void* logits, long long logits_stride,
                        const float* temperature, const int* top_k, const float* top_p, const float* min_p,
                        const unsigned long long* seeds, int rows, int vocab, int threads, unsigned seed) {
  int splits = 0;
  int split_tokens = 0;
  voltllm::split_sizes(rows, vocab, splits, split_tokens);
  std::vector<float> split_score(static_cast<size_t>(rows) * splits, -1.f);
  std::vector<int> split_index(split_score.size(), -1);
  std::vector<unsigned long long> histogram(static_cast<size_t>(rows) * voltllm::kSampleBins, 0x5a5a5a5aull);
  std::vector<unsigned> blocks_done(rows, 77u);
  std::vector<voltllm::SelectState> state(rows);
  const int capacity = std::min(voltllm::kMaxCandidates, vocab);
  std::vector<float> candidate_d(static_cast<size_t>(rows) * capacity, -3.f);
  std::vector<int> candidate_token(candidate_d.size(), -3);
  std::vector<unsigned> num_candidates(rows, 55u);
  std::vector<unsigned long long> kept_mass(rows, 99ull);
  voltllm::SampleParams p{};
  p.out = out;
  p.logits = logits;
  p.logits_stride = logits_stride;
  p.temperature = temperature;
  p.top_k = top_k;
  p.top_p = top_p;
  p.min_p = min_p;
  p.seeds = seeds;
  p.split_score = split_score.data();
  p.split_index = split_index.data();
  p.histogram = histogram.data();
  p.blocks_done = blocks_done.data();
  p.state = state.data();
  p.candidate_d = candidate_d.data();
  p.candidate_token = candidate_token.data();
  p.num_candidates = num_candidates.data();
  p.kept_mass = kept_mass.data();
  p.candidate_capacity = capacity;
  p.splits = splits;
  p.split_tokens = split_tokens;
  p.vocab = vocab;
  const dim3 grid(rows, splits);
  auto run = [&](auto t) {
    using T = decltype(t);
    // The glue's order.
    if (top_k != nullptr || top_p != nullptr || min_p != nullptr) {
      emu::launch(grid, dim3(threads), sizeof(voltllm::ArgmaxShared),
                  [&] { voltllm::row_max_partial_kernel<T>(p); }, seed);
      emu::launch(dim3(rows), dim3(32), 0, [&] { voltllm::row_max_merge_kernel(p); }, seed);
    }
    for (int mass = 0; mass < 2; ++mass) {
      if (mass && (top_k != nullptr || top_p != nullptr)) {
        emu::launch(grid, dim3(threads), sizeof(voltllm::SelectShared),
                    [&] { voltllm::gather_candidates_kernel<T>(p); }, seed);
        emu::launch(dim3(rows), dim3(threads), sizeof(voltllm::SelectShared),
                    [&] { voltllm::finish_candidates_kernel<T>(p); }, seed);
      }
      if ((mass ? static_cast<const void*>(top_p) : static_cast<const void*>(top_k)) == nullptr) continue;
      for (int level = 0; level < voltllm::kSelectDigits; ++level) {
        emu::launch(grid, dim3(threads), sizeof(voltllm::SelectShared), [&] {
          if (mass) {
            voltllm::select_digit_kernel<T, true>(p, level);
          } else {
            voltllm::select_digit_kernel<T, false>(p, level);
          }
        }, seed + level);
      }
    }
    emu::launch(grid, dim3(threads), sizeof(voltllm::ArgmaxShared), [&] { voltllm::race_partial_kernel<T>(p); },
                seed);
    emu::launch(dim3(rows), dim3(32), 0, [&] { voltllm::race_merge_kernel(p); }, seed);
  };
  if (dtype == 0) {
    run(float{});
  } else {
    emu::dispatch_dtype(dtype == 2, run);
  }
}

// race_first_sampling in the glue's order: `threads` is the split kernels' block (a power of two, 32..256),
// twice that race_finish_row_kernel's. temperature null: every row greedy; top_p null: off for every
// row. Returns the number of rows the last kernel (the row-wide select) finished, or -1 if a launch
// left a ticket nonzero (every launch must leave them as it found them: zero).
int emu_race_first_sampling(int dtype, long long* out, const void* logits, long long logits_stride,
                            const float* temperature, const float* top_p, const unsigned long long* seeds, int rows,
                            int vocab, int threads, int min_split_tokens, unsigned seed) {
  voltllm::RaceParams p{};
  voltllm::split_sizes(rows, vocab, p.splits, p.split_tokens, std::min(min_split_tokens, vocab));
  std::vector<float> split_max(static_cast<size_t>(rows) * p.splits, -1.f);
  std::vector<int> split_argmax(split_max.size(), -1);
  std::vector<voltllm::RaceEntry> split_top(split_max.size() * voltllm::kRaceCandidates, {-2.f, -2});
  std::vector<voltllm::RaceRowState> state(rows);
  std::memset(static_cast<void*>(state.data()), 0x5a, state.size() * sizeof(voltllm::RaceRowState));
  std::vector<unsigned> tickets(rows, 0u);
  p.out = out;
  p.logits = logits;
  p.logits_stride = logits_stride;
  p.temperature = temperature;
  p.top_p = top_p;
  p.seeds = seeds;
  p.split_max = split_max.data();
  p.split_argmax = split_argmax.data();
  p.split_top = split_top.data();
  p.state = state.data();
  p.tickets = tickets.data();
  p.vocab = vocab;
  const dim3 grid(rows, p.splits);
  auto tickets_zero = [&] { return std::all_of(tickets.begin(), tickets.end(), [](unsigned t) { return t == 0; }); };
  int finished_by_row_pass = 0;
  bool clean = true;
  auto run = [&](auto t) {
    using T = decltype(t);
    emu::launch(grid, dim3(threads), sizeof(voltllm::RaceShared), [&] { voltllm::race_top_kernel<T>(p); }, seed);
    clean = clean && tickets_zero();
    if (top_p == nullptr) return;
    emu::launch(grid, dim3(threads), sizeof(voltllm::RaceShared), [&] { voltllm::race_mass_kernel<T>(p); },
                seed + 1);
    clean = clean && tickets_zero();
    for (int r = 0; r < rows; ++r) {
      const bool top_p_row = temperature[r] > 0.f && top_p[r] < 1.f;
      finished_by_row_pass += top_p_row && !state[r].settled ? 1 : 0;
    }
    emu::launch(dim3(rows), dim3(2 * threads), sizeof(voltllm::SelectShared),
                [&] { voltllm::race_finish_row_kernel<T>(p); }, seed + 2);
  };
  if (dtype == 0) {
    run(float{});
  } else {
    emu::dispatch_dtype(dtype == 2, run);
  }
  return clean ? finished_by_row_pass : -1;
}

}  // extern "C"
