// Torch glue for paged prefill attention (v6, v8 and v9): checks, device guard, stream, dtype dispatch.
#include "torch_glue.h"

#include <cmath>

#include "paged_prefill_attention.cuh"
#include "paged_prefill_attention_v8.cuh"
#include "paged_prefill_attention_v9.cuh"

namespace voltllm {

using namespace glue;

namespace {

// The checks both prefill variants share.
AttentionShape check_prefill(const at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache,
                             const at::Tensor& block_tables, const at::Tensor& seq_lens,
                             const at::Tensor& query_start_loc, int64_t num_row_tiles, const char* op) {
  const auto shape = check_attention(out, query, kv_cache, block_tables, seq_lens, op);
  check_cuda(query_start_loc, "query_start_loc");
  TORCH_CHECK(query_start_loc.scalar_type() == at::kInt && query_start_loc.dim() == 1 &&
                  query_start_loc.size(0) == seq_lens.size(0) + 1 && query_start_loc.is_contiguous(),
              op, ": query_start_loc must be a contiguous int32 [num_seqs + 1] tensor");
  TORCH_CHECK(num_row_tiles >= 0, op, ": num_row_tiles must be >= 0");
  return shape;
}

}  // namespace

void paged_prefill_attention(at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache,
                             const at::Tensor& block_tables, const at::Tensor& seq_lens,
                             const at::Tensor& query_start_loc, int64_t num_row_tiles, double scale,
                             int64_t sliding_window) {
  const auto shape = check_prefill(out, query, kv_cache, block_tables, seq_lens, query_start_loc, num_row_tiles,
                                   "paged_prefill_attention");
  const int64_t num_seqs = seq_lens.size(0);
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

int64_t prefill_block_m_v8(int64_t head_size) {
  TORCH_CHECK(head_size == 64 || head_size == 128 || head_size == 256,
              "prefill_block_m_v8: unsupported head_size ", num(head_size), " (64, 128 or 256)");
  return head_size == 256 ? PrefillV8Traits<256>::kBlockM : PrefillV8Traits<128>::kBlockM;
}

void paged_prefill_attention_v8(at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache,
                                const at::Tensor& block_tables, const at::Tensor& seq_lens,
                                const at::Tensor& query_start_loc, int64_t num_row_tiles, double scale,
                                int64_t sliding_window) {
  const char* op = "paged_prefill_attention_v8";
  const auto shape = check_prefill(out, query, kv_cache, block_tables, seq_lens, query_start_loc, num_row_tiles, op);
  const int64_t num_seqs = seq_lens.size(0);
  if (num_seqs == 0 || num_row_tiles == 0 || query.size(0) == 0) return;
  const at::cuda::OptionalCUDAGuard guard(query.device());
  TORCH_CHECK(at::cuda::getCurrentDeviceProperties()->major >= 8, op,
              ": needs SM80 or newer (the v6 kernel serves older GPUs)");
  const auto stream = at::cuda::getCurrentCUDAStream();
  // num_row_tiles counts tiles of this variant's BLOCK_M (prefill_block_m_v8), as the map does.
  at::Tensor cu_tiles = at::empty({num_seqs + 1}, query_start_loc.options());
  prefill_tile_map_kernel<<<1, 32, 0, stream>>>(query_start_loc.data_ptr<int>(), cu_tiles.data_ptr<int>(),
                                                num_seqs, static_cast<int>(prefill_block_m_v8(shape.head_size)));
  C10_CUDA_KERNEL_LAUNCH_CHECK();

  PrefillV8Params p{};
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

  dispatch_dtype(query.scalar_type(), op, [&](auto t) {
    using T = decltype(t);
    dispatch_head_size(shape.head_size, op, [&](auto h) {
      constexpr int H = decltype(h)::value;
      using Tr = PrefillV8Traits<H>;
      set_smem(paged_prefill_v8_kernel<T, H>, Tr::kSmemBytes);
      const dim3 grid(num_row_tiles, shape.num_heads);
      paged_prefill_v8_kernel<T, H><<<grid, Tr::kThreads, Tr::kSmemBytes, stream>>>(p);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
}

int64_t prefill_block_m_v9(int64_t head_size) {
  TORCH_CHECK(head_size == 64 || head_size == 128 || head_size == 256,
              "prefill_block_m_v9: unsupported head_size ", num(head_size), " (64, 128 or 256)");
  return head_size == 256 ? PrefillV9Traits<256>::kBlockM : PrefillV9Traits<128>::kBlockM;
}

void paged_prefill_attention_v9(at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache,
                                const at::Tensor& block_tables, const at::Tensor& seq_lens,
                                const at::Tensor& query_start_loc, int64_t num_row_tiles, double scale,
                                int64_t sliding_window) {
  const char* op = "paged_prefill_attention_v9";
  const auto shape = check_prefill(out, query, kv_cache, block_tables, seq_lens, query_start_loc, num_row_tiles, op);
  const int64_t num_seqs = seq_lens.size(0);
  if (num_seqs == 0 || num_row_tiles == 0 || query.size(0) == 0) return;
  const at::cuda::OptionalCUDAGuard guard(query.device());
  const auto stream = at::cuda::getCurrentCUDAStream();
  // num_row_tiles counts tiles of this variant's BLOCK_M (prefill_block_m_v9), as the map does.
  at::Tensor cu_tiles = at::empty({num_seqs + 1}, query_start_loc.options());
  prefill_tile_map_kernel<<<1, 32, 0, stream>>>(query_start_loc.data_ptr<int>(), cu_tiles.data_ptr<int>(),
                                                num_seqs, static_cast<int>(prefill_block_m_v9(shape.head_size)));
  C10_CUDA_KERNEL_LAUNCH_CHECK();

  PrefillV9Params p{};
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

  dispatch_dtype(query.scalar_type(), op, [&](auto t) {
    using T = decltype(t);
    dispatch_head_size(shape.head_size, op, [&](auto h) {
      constexpr int H = decltype(h)::value;
      using Tr = PrefillV9Traits<H>;
      set_smem(paged_prefill_v9_kernel<T, H>, Tr::kSmemBytes);
      const dim3 grid(num_row_tiles, shape.num_heads);
      paged_prefill_v9_kernel<T, H><<<grid, Tr::kThreads, Tr::kSmemBytes, stream>>>(p);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
}

}  // namespace voltllm
