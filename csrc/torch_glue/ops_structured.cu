// Torch glue for the structured-output mask (structured/apply_token_bitmask.cuh): checks, device
// guard, stream, dtype dispatch.
#include "torch_glue/torch_glue.h"
#include "structured/apply_token_bitmask.cuh"

namespace voltllm {

using namespace glue;

void apply_token_bitmask(at::Tensor& logits, const at::Tensor& bitmask, const std::optional<at::Tensor>& rows) {
  check_cuda(logits, "logits");
  check_cuda(bitmask, "bitmask");
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1,
              "apply_token_bitmask: logits must be [rows, vocab] with contiguous rows");
  TORCH_CHECK(bitmask.scalar_type() == at::kInt && bitmask.dim() == 2 && bitmask.is_contiguous(),
              "apply_token_bitmask: bitmask must be a contiguous int32 [masks, words] tensor");
  TORCH_CHECK(bitmask.device() == logits.device(), "apply_token_bitmask: bitmask and logits are on different devices");
  const int64_t num_masks = bitmask.size(0), vocab = logits.size(1);
  TORCH_CHECK(bitmask.size(1) * 32 >= vocab, "apply_token_bitmask: ", num(bitmask.size(1)),
              " words cannot hold a bit for each of ", num(vocab), " tokens");
  TORCH_CHECK(num_masks <= 65535, "apply_token_bitmask: at most 65535 masks, got ", num(num_masks));
  const int* row_ptr = nullptr;
  if (rows.has_value()) {
    check_cuda(*rows, "rows");
    TORCH_CHECK(rows->scalar_type() == at::kInt && rows->dim() == 1 && rows->size(0) == num_masks &&
                    rows->is_contiguous(),
                "apply_token_bitmask: rows must be a contiguous int32 [", num(num_masks), "] tensor");
    TORCH_CHECK(rows->device() == logits.device(), "apply_token_bitmask: rows and logits are on different devices");
    row_ptr = rows->data_ptr<int>();
  } else {
    TORCH_CHECK(num_masks <= logits.size(0), "apply_token_bitmask: ", num(num_masks), " masks for ",
                num(logits.size(0)), " logits rows");
  }
  if (num_masks == 0 || vocab == 0) return;
  const at::cuda::OptionalCUDAGuard guard(logits.device());
  TokenBitmaskParams p{};
  p.logits = logits.data_ptr();
  p.logits_stride = logits.stride(0);
  p.bitmask = bitmask.data_ptr<int>();
  p.rows = row_ptr;
  p.words = static_cast<int>(bitmask.size(1));
  p.vocab = static_cast<int>(vocab);
  p.num_rows = static_cast<int>(logits.size(0));
  const dim3 grid(static_cast<unsigned>(apply_token_bitmask_blocks(p.vocab)), static_cast<unsigned>(num_masks));
  const auto stream = at::cuda::getCurrentCUDAStream();
  auto run = [&](auto t) {
    using T = decltype(t);
    launch(apply_token_bitmask_kernel<T>, grid, kBitmaskThreads, 0, stream, p);
  };
  if (logits.scalar_type() == at::kFloat) {
    run(float{});
  } else {
    dispatch_dtype(logits.scalar_type(), "apply_token_bitmask", run);
  }
}

}  // namespace voltllm
