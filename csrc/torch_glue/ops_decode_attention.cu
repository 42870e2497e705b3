// Torch glue for paged decode attention: checks, device guard, stream, split planning, dtype dispatch.
#include "torch_glue/torch_glue.h"

#include <cmath>
#include <utility>

#include "attention/paged_decode_wmma.cuh"

namespace voltllm {

using namespace glue;

namespace {

struct Split {
  int64_t splits;     // context splits per (sequence, kv head)
  int64_t partition;  // tokens per split, a multiple of 64
};

// Tokens a split covers at least: four KV blocks per warp. CUDA graphs are captured with the split sized
// for max_model_len, and the kernel splits each sequence by its own length with that partition, so this
// is also what keeps a short sequence at a small batch in one split (no partials, no merge).
constexpr int64_t kMinSplitTokens = 256;

// Splits the context so that the grid is one full wave of resident blocks: long-lived blocks amortise
// their setup (query load, row map, merge) over many KV blocks, and no second, partial wave is left.
// Batches that fill the GPU on their own are not split. A split is at least kMinSplitTokens, and there
// are at most 4096 splits (a bound on the partial buffers).
Split choose_split(int64_t span, int64_t base_blocks, int64_t resident_blocks) {
  const int64_t want = std::max<int64_t>(1, resident_blocks / base_blocks);
  const int64_t most = std::min<int64_t>(4096, std::max<int64_t>(1, (span + kMinSplitTokens - 1) / kMinSplitTokens));
  const int64_t splits = std::min(want, most);
  const int64_t partition = ((span + splits - 1) / splits + 63) / 64 * 64;
  return {(span + partition - 1) / partition, partition};
}

// The decode op's argument checks.
AttentionShape check_decode(const at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache,
                            const at::Tensor& block_tables, const at::Tensor& seq_lens, int64_t max_seq_len,
                            const char* op) {
  const auto shape = check_attention(out, query, kv_cache, block_tables, seq_lens, op);
  TORCH_CHECK(seq_lens.size(0) == query.size(0), op, ": one query token per sequence expected");
  TORCH_CHECK(shape.num_heads / shape.num_kv_heads <= 16, op, ": at most 16 query heads per kv head");
  TORCH_CHECK(max_seq_len >= 1, op, ": max_seq_len must be >= 1");
  TORCH_CHECK(max_seq_len <= block_tables.size(1) * kBlockSize, op, ": max_seq_len ", num(max_seq_len),
              " exceeds the block table (", num(block_tables.size(1)), " blocks)");
  return shape;
}

// Context positions one sequence's splits must cover: with a window, only its last blocks.
int64_t decode_span(int64_t max_seq_len, int64_t sliding_window) {
  return sliding_window > 0 ? std::min<int64_t>(max_seq_len, sliding_window + kBlockSize) : max_seq_len;
}

// The kernel parameters from the op's arguments (splits and partials come later).
DecodeParams decode_params(at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache,
                           const at::Tensor& block_tables, const at::Tensor& seq_lens, const AttentionShape& shape,
                           double scale, int64_t sliding_window) {
  DecodeParams p{};
  p.out = out.data_ptr();
  p.query = query.data_ptr();
  p.key_cache = kv_cache[0].data_ptr();
  p.value_cache = kv_cache[1].data_ptr();
  p.block_tables = block_tables.data_ptr<int>();
  p.seq_lens = seq_lens.data_ptr<int>();
  p.query_stride = query.stride(0);
  p.out_stride = out.stride(0);
  p.num_heads = shape.num_heads;
  p.num_kv_heads = shape.num_kv_heads;
  p.max_blocks_per_seq = block_tables.size(1);
  p.sliding_window = sliding_window > 0 ? sliding_window : 0;
  p.scale_log2 = static_cast<float>(scale * 1.4426950408889634 /* log2(e) */);
  return p;
}

// Sets the split geometry, and with more than one split allocates the partials (returned: they must
// live until the launches that use them are enqueued).
std::pair<at::Tensor, at::Tensor> set_splits(DecodeParams& p, const at::Tensor& query, const AttentionShape& shape,
                                             int64_t num_seqs, int64_t splits, int64_t partition) {
  p.max_splits = static_cast<int>(splits);
  // The kernel recomputes each sequence's split count from its own length with this partition.
  p.partition_size = static_cast<int>(partition);
  if (splits <= 1) return {};
  const auto f32 = query.options().dtype(at::kFloat);
  at::Tensor partial_out = at::empty({num_seqs, shape.num_heads, splits, shape.head_size}, f32);
  at::Tensor partial_stats = at::empty({2, num_seqs, shape.num_heads, splits}, f32);
  p.partial_out = partial_out.data_ptr<float>();
  p.partial_max = partial_stats[0].data_ptr<float>();
  p.partial_sum = partial_stats[1].data_ptr<float>();
  return {partial_out, partial_stats};
}

// Merges the splits set_splits made room for.
template <typename T, int H>
void launch_split_merge(const DecodeParams& p, const AttentionShape& shape, int64_t num_seqs, cudaStream_t stream) {
  launch(paged_decode_reduce_kernel<T, H>, dim3(shape.num_heads, num_seqs, H / kReduceDims),
         kReduceDims * reduce_groups(p.max_splits), kReduceSmemBytes, stream, p);
}

}  // namespace

void paged_decode_attention(at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache,
                            const at::Tensor& block_tables, const at::Tensor& seq_lens, int64_t max_seq_len,
                            double scale, int64_t sliding_window) {
  const auto shape = check_decode(out, query, kv_cache, block_tables, seq_lens, max_seq_len, "paged_decode_attention");
  const int64_t num_seqs = query.size(0);
  if (num_seqs == 0) return;
  const at::cuda::OptionalCUDAGuard guard(query.device());
  const auto stream = at::cuda::getCurrentCUDAStream();
  const int num_sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int64_t span = decode_span(max_seq_len, sliding_window);

  DecodeParams p = decode_params(out, query, kv_cache, block_tables, seq_lens, shape, scale, sliding_window);

  dispatch_dtype(query.scalar_type(), "paged_decode_attention", [&](auto t) {
    using T = decltype(t);
    dispatch_head_size(shape.head_size, "paged_decode_attention", [&](auto h) {
      constexpr int H = decltype(h)::value;
      using Tr = DecodeWmmaTraits<H>;
      auto* kernel = paged_decode_wmma_kernel<T, H>;
      set_smem(kernel, Tr::kSmemBytes);
      int blocks_per_sm = 0;
      C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks_per_sm, kernel, Tr::kThreads,
                                                                   Tr::kSmemBytes));
      const auto split = choose_split(span, num_seqs * shape.num_kv_heads,
                                      static_cast<int64_t>(num_sms) * std::max(blocks_per_sm, 1));
      const auto partials = set_splits(p, query, shape, num_seqs, split.splits, split.partition);
      const dim3 grid(shape.num_kv_heads, num_seqs, split.splits);
      launch(kernel, grid, Tr::kThreads, Tr::kSmemBytes, stream, p);
      if (split.splits > 1) launch_split_merge<T, H>(p, shape, num_seqs, stream);
    });
  });
}

}  // namespace voltllm
