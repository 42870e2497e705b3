// Torch glue for paged decode attention: checks, device guard, stream, dtype dispatch.
#include "torch_glue.h"

#include <cmath>

#include "paged_decode_attention.cuh"

namespace voltllm {

using namespace glue;

void paged_decode_attention(at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache,
                            const at::Tensor& block_tables, const at::Tensor& seq_lens, int64_t max_seq_len,
                            double scale, int64_t sliding_window) {
  const auto shape = check_attention(out, query, kv_cache, block_tables, seq_lens, "paged_decode_attention");
  const int64_t num_seqs = query.size(0);
  TORCH_CHECK(seq_lens.size(0) == num_seqs, "paged_decode_attention: one query token per sequence expected");
  TORCH_CHECK(shape.num_heads / shape.num_kv_heads <= 16,
              "paged_decode_attention: at most 16 query heads per kv head");
  TORCH_CHECK(max_seq_len >= 1, "paged_decode_attention: max_seq_len must be >= 1");
  TORCH_CHECK(max_seq_len <= block_tables.size(1) * kBlockSize, "paged_decode_attention: max_seq_len ",
              num(max_seq_len), " exceeds the block table (", num(block_tables.size(1)), " blocks)");
  if (num_seqs == 0) return;
  const at::cuda::OptionalCUDAGuard guard(query.device());
  const auto stream = at::cuda::getCurrentCUDAStream();
  const int num_sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;

  // Split the context so that the grid fills the GPU about four times over; a split is at least
  // 8 blocks per warp-group pass (128 tokens) so warps are not left idle.
  const int64_t span = sliding_window > 0 ? std::min<int64_t>(max_seq_len, sliding_window + kBlockSize) : max_seq_len;
  const int64_t base_blocks = num_seqs * shape.num_kv_heads;
  const int64_t want = (4 * num_sms + base_blocks - 1) / base_blocks;
  // The reduce kernel keeps one weight per split in shared memory: at most 4096 splits (16 KB).
  const int64_t most = std::min<int64_t>(4096, std::max<int64_t>(1, (span + 127) / 128));
  int64_t splits = std::min(want, most);
  int64_t partition = (span + splits - 1) / splits;
  partition = (partition + 63) / 64 * 64;
  splits = (span + partition - 1) / partition;

  DecodeParams p{};
  at::Tensor partial_out, partial_stats;
  if (splits > 1) {
    const auto f32 = query.options().dtype(at::kFloat);
    partial_out = at::empty({num_seqs, shape.num_heads, splits, shape.head_size}, f32);
    partial_stats = at::empty({2, num_seqs, shape.num_heads, splits}, f32);
    p.partial_out = partial_out.data_ptr<float>();
    p.partial_max = partial_stats[0].data_ptr<float>();
    p.partial_sum = partial_stats[1].data_ptr<float>();
  }
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
  p.max_splits = splits;
  // The kernel recomputes each sequence's split count from its own length with the same partition.
  p.partition_size = partition;
  p.sliding_window = sliding_window > 0 ? sliding_window : 0;
  p.scale_log2 = static_cast<float>(scale * 1.4426950408889634 /* log2(e) */);

  dispatch_dtype(query.scalar_type(), "paged_decode_attention", [&](auto t) {
    using T = decltype(t);
    dispatch_head_size(shape.head_size, "paged_decode_attention", [&](auto h) {
      constexpr int H = decltype(h)::value;
      using Tr = DecodeTraits<H>;
      set_smem(paged_decode_attention_kernel<T, H>, Tr::kSmemBytes);
      const dim3 grid(shape.num_kv_heads, num_seqs, splits);
      paged_decode_attention_kernel<T, H><<<grid, Tr::kThreads, Tr::kSmemBytes, stream>>>(p);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      if (splits > 1) {
        const int reduce_smem = static_cast<int>(splits * sizeof(float));
        paged_decode_reduce_kernel<T, H><<<dim3(shape.num_heads, num_seqs), H, reduce_smem, stream>>>(p);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      }
    });
  });
}

}  // namespace voltllm
