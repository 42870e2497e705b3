// Torch glue for token sampling (sampling/radix_sampling.cuh): checks, device guard, stream, dtype dispatch.
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

void radix_sampling(at::Tensor& out, const at::Tensor& logits, const at::Tensor& temperature, const at::Tensor& top_k,
                    const at::Tensor& top_p, const at::Tensor& min_p, const at::Tensor& seeds) {
  check_cuda(logits, "logits");
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1, "radix_sampling: logits must be [rows, vocab] with contiguous rows");
  const int64_t rows = logits.size(0);
  check_row_param(out, at::kLong, rows, "out");
  check_row_param(temperature, at::kFloat, rows, "temperature");
  check_row_param(top_k, at::kInt, rows, "top_k");
  check_row_param(top_p, at::kFloat, rows, "top_p");
  check_row_param(min_p, at::kFloat, rows, "min_p");
  check_row_param(seeds, at::kLong, rows, "seeds");
  if (rows == 0) return;
  const at::cuda::OptionalCUDAGuard guard(logits.device());
  SampleParams p{};
  p.out = reinterpret_cast<long long*>(out.data_ptr<int64_t>());
  p.logits = logits.data_ptr();
  p.logits_stride = logits.stride(0);
  p.temperature = temperature.data_ptr<float>();
  p.top_k = top_k.data_ptr<int>();
  p.top_p = top_p.data_ptr<float>();
  p.min_p = min_p.data_ptr<float>();
  p.seeds = reinterpret_cast<const unsigned long long*>(seeds.data_ptr<int64_t>());
  p.vocab = static_cast<int>(logits.size(1));
  p.race_splits = static_cast<int>((logits.size(1) + kRaceSplit - 1) / kRaceSplit);
  const auto scratch_options = logits.options().dtype(at::kFloat);
  at::Tensor race_score = at::empty({rows, p.race_splits}, scratch_options);
  at::Tensor race_index = at::empty({rows, p.race_splits}, scratch_options.dtype(at::kInt));
  p.race_score = race_score.data_ptr<float>();
  p.race_index = race_index.data_ptr<int>();
  const auto stream = at::cuda::getCurrentCUDAStream();
  // Temperature-only rows race split over many blocks; greedy and filtered rows take one block each.
  // Each kernel skips the rows that are not its own.
  auto run = [&](auto t) {
    using T = decltype(t);
    launch(race_partial_kernel<T>, dim3(rows, p.race_splits), kRaceThreads, race_smem_bytes(), stream, p);
    launch(race_merge_kernel, rows, 32, 0, stream, p);
    set_smem(radix_sampling_kernel<T>, static_cast<int>(sample_smem_bytes()));  // above 48 KB: opt in
    launch(radix_sampling_kernel<T>, rows, kSampleThreads, sample_smem_bytes(), stream, p);
  };
  if (logits.scalar_type() == at::kFloat) {
    run(float{});
  } else {
    dispatch_dtype(logits.scalar_type(), "radix_sampling", run);
  }
}

}  // namespace voltllm
