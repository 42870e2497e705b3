// Torch glue for token sampling (sampling/radix_sampling.cuh): checks, device guard, stream, dtype dispatch.
#include <algorithm>

#include "torch_glue/torch_glue.h"
#include "sampling/radix_sampling.cuh"

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
      launch(finish_candidates_kernel, rows, kSplitThreads, sizeof(SelectShared), stream, p);
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

}  // namespace voltllm
