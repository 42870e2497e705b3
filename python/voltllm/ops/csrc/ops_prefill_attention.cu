// Torch glue for paged prefill attention: checks, device guard, stream, dtype dispatch.
#include "torch_glue.h"

#include <cmath>

#include "paged_prefill_attention.cuh"

namespace voltllm {

using namespace glue;

void paged_prefill_attention(at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache,
                             const at::Tensor& block_tables, const at::Tensor& seq_lens,
                             const at::Tensor& query_start_loc, int64_t num_row_tiles, double scale,
                             int64_t sliding_window) {
  const auto shape = check_attention(out, query, kv_cache, block_tables, seq_lens, "paged_prefill_attention");
  const int64_t num_seqs = seq_lens.size(0);
  check_cuda(query_start_loc, "query_start_loc");
  TORCH_CHECK(query_start_loc.scalar_type() == at::kInt && query_start_loc.dim() == 1 &&
                  query_start_loc.size(0) == num_seqs + 1 && query_start_loc.is_contiguous(),
              "paged_prefill_attention: query_start_loc must be a contiguous int32 [num_seqs + 1] tensor");
  TORCH_CHECK(num_row_tiles >= 0, "paged_prefill_attention: num_row_tiles must be >= 0");
  if (num_seqs == 0 || num_row_tiles == 0 || query.size(0) == 0) return;
  const at::cuda::OptionalCUDAGuard guard(query.device());
  const auto stream = at::cuda::getCurrentCUDAStream();
  at::Tensor cu_tiles = at::empty({num_seqs + 1}, query_start_loc.options());
  prefill_tile_map_kernel<<<1, 32, 0, stream>>>(query_start_loc.data_ptr<int>(), cu_tiles.data_ptr<int>(),
                                                num_seqs, PrefillTraits<128>::kBlockM);
  C10_CUDA_KERNEL_LAUNCH_CHECK();

  PrefillParams p{};
  p.out = out.data_ptr();
  p.query = query.data_ptr();
  p.key_cache = kv_cache[0].data_ptr();
  p.value_cache = kv_cache[1].data_ptr();
  p.block_tables = block_tables.data_ptr<int>();
  p.seq_lens = seq_lens.data_ptr<int>();
  p.query_start_loc = query_start_loc.data_ptr<int>();
  p.cu_tiles = cu_tiles.data_ptr<int>();
  p.query_stride = query.stride(0);
  p.out_stride = out.stride(0);
  p.num_seqs = num_seqs;
  p.num_heads = shape.num_heads;
  p.num_kv_heads = shape.num_kv_heads;
  p.max_blocks_per_seq = block_tables.size(1);
  p.sliding_window = sliding_window > 0 ? sliding_window : 0;
  p.scale_log2 = static_cast<float>(scale * 1.4426950408889634 /* log2(e) */);

  dispatch_dtype(query.scalar_type(), "paged_prefill_attention", [&](auto t) {
    using T = decltype(t);
    dispatch_head_size(shape.head_size, "paged_prefill_attention", [&](auto h) {
      constexpr int H = decltype(h)::value;
      using Tr = PrefillTraits<H>;
      static_assert(Tr::kBlockM == PrefillTraits<128>::kBlockM, "one BLOCK_M for every head size");
      set_smem(paged_prefill_attention_kernel<T, H>, Tr::kSmemBytes);
      const dim3 grid(num_row_tiles, shape.num_heads);
      paged_prefill_attention_kernel<T, H><<<grid, Tr::kThreads, Tr::kSmemBytes, stream>>>(p);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
}

int64_t prefill_block_m() { return PrefillTraits<128>::kBlockM; }

}  // namespace voltllm
