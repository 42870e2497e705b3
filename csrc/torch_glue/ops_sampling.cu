// Torch glue for token sampling (sampling/radix_sampling.cuh, sampling/race_first_sampling.cuh): checks,
// device guard, stream, dtype dispatch, scratch.
#include <algorithm>
#include <map>
#include <mutex>
#include <utility>

#include "torch_glue/torch_glue.h"
#include "sampling/radix_sampling.cuh"
#include "sampling/race_first_sampling.cuh"

namespace voltllm {

using namespace glue;

namespace {

void check_row_param(const at::Tensor& t, at::ScalarType dtype, int64_t rows, const char* name) {
  check_cuda(t, name);
  TORCH_CHECK(t.scalar_type() == dtype && t.dim() == 1 && t.size(0) == rows && t.is_contiguous(), "radix_sampling: ",
              name, " must be a contiguous ", dtype, " [", num(rows), "] tensor");
}

}  // namespace

// A filter's per-row tensor, or null when the filter is off for every row (its passes are not launched).
template <typename V>
const V* optional_row_param(const std::optional<at::Tensor>& t, at::ScalarType dtype, int64_t rows, const char* name) {
  if (!t.has_value()) return nullptr;
  check_row_param(*t, dtype, rows, name);
  return t->data_ptr<V>();
}

void radix_sampling(at::Tensor& out, const at::Tensor& logits, const at::Tensor& temperature,
                    const std::optional<at::Tensor>& top_k, const std::optional<at::Tensor>& top_p,
                    const std::optional<at::Tensor>& min_p, const at::Tensor& seeds) {
  check_cuda(logits, "logits");
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1, "radix_sampling: logits must be [rows, vocab] with contiguous rows");
  const int64_t rows = logits.size(0);
  check_row_param(out, at::kLong, rows, "out");
  check_row_param(temperature, at::kFloat, rows, "temperature");
  check_row_param(seeds, at::kLong, rows, "seeds");
  if (rows == 0) return;
  const at::cuda::OptionalCUDAGuard guard(logits.device());
  SampleParams p{};
  p.out = reinterpret_cast<long long*>(out.data_ptr<int64_t>());
  p.logits = logits.data_ptr();
  p.logits_stride = logits.stride(0);
  p.temperature = temperature.data_ptr<float>();
  p.top_k = optional_row_param<int>(top_k, at::kInt, rows, "top_k");
  p.top_p = optional_row_param<float>(top_p, at::kFloat, rows, "top_p");
  p.min_p = optional_row_param<float>(min_p, at::kFloat, rows, "min_p");
  p.seeds = reinterpret_cast<const unsigned long long*>(seeds.data_ptr<int64_t>());
  p.vocab = static_cast<int>(logits.size(1));
  split_sizes(rows, p.vocab, p.splits, p.split_tokens);
  const auto options = logits.options();
  at::Tensor split_score = at::empty({rows, p.splits}, options.dtype(at::kFloat));
  at::Tensor split_index = at::empty({rows, p.splits}, options.dtype(at::kInt));
  // One split: a block's histogram is its row's, kept in shared memory.
  at::Tensor histogram = at::empty({p.splits > 1 ? rows : 0, kSampleBins}, options.dtype(at::kLong));
  at::Tensor blocks_done = at::empty({rows}, options.dtype(at::kInt));
  at::Tensor state = at::empty({rows, static_cast<int64_t>(sizeof(SelectState))}, options.dtype(at::kByte));
  p.split_score = split_score.data_ptr<float>();
  p.split_index = split_index.data_ptr<int>();
  p.histogram = reinterpret_cast<unsigned long long*>(histogram.data_ptr<int64_t>());
  p.blocks_done = reinterpret_cast<unsigned*>(blocks_done.data_ptr<int>());
  p.state = reinterpret_cast<SelectState*>(state.data_ptr<uint8_t>());
  const bool selects = p.top_k != nullptr || p.top_p != nullptr;
  p.candidate_capacity = std::min(kMaxCandidates, p.vocab);
  const int64_t list_rows = selects ? rows : 0;
  at::Tensor candidate_d = at::empty({list_rows, p.candidate_capacity}, options.dtype(at::kFloat));
  at::Tensor candidate_token = at::empty({list_rows, p.candidate_capacity}, options.dtype(at::kInt));
  at::Tensor num_candidates = at::empty({rows}, options.dtype(at::kInt));
  at::Tensor kept_mass = at::empty({rows}, options.dtype(at::kLong));
  p.candidate_d = candidate_d.data_ptr<float>();
  p.candidate_token = candidate_token.data_ptr<int>();
  p.num_candidates = reinterpret_cast<unsigned*>(num_candidates.data_ptr<int>());
  p.kept_mass = reinterpret_cast<unsigned long long*>(kept_mass.data_ptr<int64_t>());
  const auto stream = at::cuda::getCurrentCUDAStream();
  // Every pass is split over (rows, splits) blocks; each kernel skips the rows that are not its own
  // (radix_sampling.cuh says which rows take which kernels). A filter no row has launches nothing.
  const dim3 split_grid(static_cast<unsigned>(rows), static_cast<unsigned>(p.splits));
  auto run = [&](auto t) {
    using T = decltype(t);
    if (p.top_k != nullptr || p.top_p != nullptr || p.min_p != nullptr) {
      launch(row_max_partial_kernel<T>, split_grid, kSplitThreads, sizeof(ArgmaxShared), stream, p);
      launch(row_max_merge_kernel, rows, 32, 0, stream, p);
    }
    for (int level = 0; p.top_k != nullptr && level < kSelectDigits; ++level) {
      launch(select_digit_kernel<T, false>, split_grid, kSplitThreads, sizeof(SelectShared), stream, p, level);
    }
    if (selects) {
      launch(gather_candidates_kernel<T>, split_grid, kSplitThreads, sizeof(SelectShared), stream, p);
      launch(finish_candidates_kernel<T>, rows, kSplitThreads, sizeof(SelectShared), stream, p);
    }
    for (int level = 0; p.top_p != nullptr && level < kSelectDigits; ++level) {
      launch(select_digit_kernel<T, true>, split_grid, kSplitThreads, sizeof(SelectShared), stream, p, level);
    }
    launch(race_partial_kernel<T>, split_grid, kSplitThreads, sizeof(ArgmaxShared), stream, p);
    launch(race_merge_kernel, rows, 32, 0, stream, p);
  };
  if (logits.scalar_type() == at::kFloat) {
    run(float{});
  } else {
    dispatch_dtype(logits.scalar_type(), "radix_sampling", run);
  }
}

namespace {

// race_first_sampling's tickets: per (device, stream), at least `rows` zeroed counters, which every
// launch leaves at zero (so they are zeroed once, not per call). Two streams never share them, so draws
// on different streams cannot count each other's blocks. Kept for the process's lifetime (never
// destroyed: a static tensor freed at exit would outlive the CUDA context).
unsigned* race_tickets(const at::Tensor& like, int64_t rows) {
  static std::mutex mutex;
  static auto* by_stream = new std::map<std::pair<int, int64_t>, at::Tensor>();
  const std::pair<int, int64_t> key{like.get_device(), at::cuda::getCurrentCUDAStream().id()};
  const std::lock_guard<std::mutex> lock(mutex);
  at::Tensor& tickets = (*by_stream)[key];
  if (!tickets.defined() || tickets.size(0) < rows) {
    tickets = at::zeros({std::max<int64_t>(rows, 256)}, like.options().dtype(at::kInt));
  }
  return reinterpret_cast<unsigned*>(tickets.data_ptr<int>());
}

// Bytes of `count` elements of E, rounded up to 16 (the scratch tensor is carved in that order).
template <typename E>
int64_t race_scratch_bytes(int64_t count) {
  return (count * static_cast<int64_t>(sizeof(E)) + 15) / 16 * 16;
}

}  // namespace

void race_first_sampling(at::Tensor& out, const at::Tensor& logits, const std::optional<at::Tensor>& temperature,
                         const std::optional<at::Tensor>& top_p, const std::optional<at::Tensor>& seeds,
                         int64_t min_split_tokens) {
  check_cuda(logits, "logits");
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1,
              "race_first_sampling: logits must be [rows, vocab] with contiguous rows");
  const int64_t rows = logits.size(0);
  check_row_param(out, at::kLong, rows, "out");
  TORCH_CHECK(temperature.has_value() || !top_p.has_value(),
              "race_first_sampling: top_p needs a temperature (no temperature: every row greedy)");
  TORCH_CHECK(!temperature.has_value() || seeds.has_value(),
              "race_first_sampling: rows with a temperature need their seeds");
  TORCH_CHECK(min_split_tokens >= 1, "race_first_sampling: min_split_tokens must be positive, got ",
              num(min_split_tokens));
  if (rows == 0) return;
  TORCH_CHECK(logits.size(1) >= 1 && logits.size(1) < kNoToken, "race_first_sampling: bad vocabulary size ",
              num(logits.size(1)));
  const at::cuda::OptionalCUDAGuard guard(logits.device());
  RaceParams p{};
  p.out = reinterpret_cast<long long*>(out.data_ptr<int64_t>());
  p.logits = logits.data_ptr();
  p.logits_stride = logits.stride(0);
  p.temperature = optional_row_param<float>(temperature, at::kFloat, rows, "temperature");
  p.top_p = optional_row_param<float>(top_p, at::kFloat, rows, "top_p");
  p.seeds = reinterpret_cast<const unsigned long long*>(optional_row_param<int64_t>(seeds, at::kLong, rows, "seeds"));
  p.vocab = static_cast<int>(logits.size(1));
  split_sizes(rows, p.vocab, p.splits, p.split_tokens,
              static_cast<int>(std::min<int64_t>(min_split_tokens, p.vocab)));
  // One scratch tensor, carved: split maxima and argmaxes, split candidates, row states.
  const int64_t split_count = rows * p.splits;
  const int64_t max_bytes = race_scratch_bytes<float>(split_count), argmax_bytes = race_scratch_bytes<int>(split_count);
  const int64_t top_bytes = race_scratch_bytes<RaceEntry>(split_count * kRaceCandidates);
  const int64_t state_bytes = race_scratch_bytes<RaceRowState>(rows);
  at::Tensor scratch =
      at::empty({max_bytes + argmax_bytes + top_bytes + state_bytes}, logits.options().dtype(at::kByte));
  uint8_t* base = scratch.data_ptr<uint8_t>();
  p.split_max = reinterpret_cast<float*>(base);
  p.split_argmax = reinterpret_cast<int*>(base + max_bytes);
  p.split_top = reinterpret_cast<RaceEntry*>(base + max_bytes + argmax_bytes);
  p.state = reinterpret_cast<RaceRowState*>(base + max_bytes + argmax_bytes + top_bytes);
  p.tickets = race_tickets(logits, rows);
  const auto stream = at::cuda::getCurrentCUDAStream();
  const dim3 split_grid(static_cast<unsigned>(rows), static_cast<unsigned>(p.splits));
  auto run = [&](auto t) {
    using T = decltype(t);
    launch(race_top_kernel<T>, split_grid, kRaceThreads, sizeof(RaceShared), stream, p);
    if (p.top_p != nullptr) {
      launch(race_mass_kernel<T>, split_grid, kRaceThreads, sizeof(RaceShared), stream, p);
      launch(race_finish_row_kernel<T>, rows, kFinishThreads, sizeof(SelectShared), stream, p);
    }
  };
  if (logits.scalar_type() == at::kFloat) {
    run(float{});
  } else {
    dispatch_dtype(logits.scalar_type(), "race_first_sampling", run);
  }
}

}  // namespace voltllm
