// Torch glue for paged prefill attention (the mma_sm80 and wmma kernels): checks, device guard, stream,
// row-tile map, dtype and head-size dispatch, launch. One host path serves both kernels; what differs is in
// the Prefill* descriptors below.
#include "torch_glue/torch_glue.h"

#include "attention/paged_prefill_tile_map.cuh"
#include "attention/paged_prefill_mma_sm80.cuh"
#include "attention/paged_prefill_wmma.cuh"

namespace voltllm {

using namespace glue;

namespace {

// paged_prefill_mma_sm80.cuh: mma.sync, SM80 and newer only.
struct PrefillMmaSm80 {
  static constexpr const char* kOp = "paged_prefill_attention_mma_sm80";
  template <int HEAD>
  using Traits = PrefillMmaSm80Traits<HEAD>;
  template <typename T, int HEAD>
  static auto kernel() {
    return &paged_prefill_mma_sm80_kernel<T, HEAD>;
  }
  static void check_device() {
    TORCH_CHECK(at::cuda::getCurrentDeviceProperties()->major >= 8, kOp,
                ": needs SM80 or newer (paged_prefill_attention_wmma serves older GPUs)");
  }
};

// paged_prefill_wmma.cuh: WMMA only, every GPU (bf16 from SM80 on, which check_attention enforces).
struct PrefillWmma {
  static constexpr const char* kOp = "paged_prefill_attention_wmma";
  template <int HEAD>
  using Traits = PrefillWmmaTraits<HEAD>;
  template <typename T, int HEAD>
  static auto kernel() {
    return &paged_prefill_wmma_kernel<T, HEAD>;
  }
  static void check_device() {}
};

template <typename Kernel>
int64_t block_m(int64_t head_size) {
  int64_t rows = 0;
  dispatch_head_size(head_size, Kernel::kOp,
                     [&](auto h) { rows = Kernel::template Traits<decltype(h)::value>::kBlockM; });
  return rows;
}

// num_row_tiles counts row tiles of the kernel's BLOCK_M (block_m<Kernel>), as the tile map does.
template <typename Kernel>
void run_prefill(at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache,
                 const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                 int64_t num_row_tiles, double scale, int64_t sliding_window) {
  const char* op = Kernel::kOp;
  const auto shape = check_attention(out, query, kv_cache, block_tables, seq_lens, op);
  check_cuda(query_start_loc, "query_start_loc");
  TORCH_CHECK(query_start_loc.scalar_type() == at::kInt && query_start_loc.dim() == 1 &&
                  query_start_loc.size(0) == seq_lens.size(0) + 1 && query_start_loc.is_contiguous(),
              op, ": query_start_loc must be a contiguous int32 [num_seqs + 1] tensor");
  TORCH_CHECK(num_row_tiles >= 0, op, ": num_row_tiles must be >= 0");
  const int64_t num_seqs = seq_lens.size(0);
  if (num_seqs == 0 || num_row_tiles == 0 || query.size(0) == 0) return;
  const at::cuda::OptionalCUDAGuard guard(query.device());
  Kernel::check_device();
  const auto stream = at::cuda::getCurrentCUDAStream();
  at::Tensor cu_tiles = at::empty({num_seqs + 1}, query_start_loc.options());

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

  dispatch_dtype(query.scalar_type(), op, [&](auto t) {
    using T = decltype(t);
    dispatch_head_size(shape.head_size, op, [&](auto h) {
      constexpr int H = decltype(h)::value;
      using Tr = typename Kernel::template Traits<H>;
      const int rows_per_tile = Tr::kBlockM;
      launch(prefill_tile_map_kernel, dim3(1), dim3(32), 0, stream, query_start_loc.data_ptr<int>(),
             cu_tiles.data_ptr<int>(), static_cast<int>(num_seqs), rows_per_tile);
      const auto kernel = Kernel::template kernel<T, H>();
      set_smem(kernel, Tr::kSmemBytes);
      launch(kernel, dim3(num_row_tiles, shape.num_heads), dim3(Tr::kThreads), Tr::kSmemBytes, stream, p);
    });
  });
}

}  // namespace

int64_t prefill_block_m_mma_sm80(int64_t head_size) { return block_m<PrefillMmaSm80>(head_size); }

int64_t prefill_block_m_wmma(int64_t head_size) { return block_m<PrefillWmma>(head_size); }

void paged_prefill_attention_mma_sm80(at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache,
                                const at::Tensor& block_tables, const at::Tensor& seq_lens,
                                const at::Tensor& query_start_loc, int64_t num_row_tiles, double scale,
                                int64_t sliding_window) {
  run_prefill<PrefillMmaSm80>(out, query, kv_cache, block_tables, seq_lens, query_start_loc, num_row_tiles, scale,
                         sliding_window);
}

void paged_prefill_attention_wmma(at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache,
                                const at::Tensor& block_tables, const at::Tensor& seq_lens,
                                const at::Tensor& query_start_loc, int64_t num_row_tiles, double scale,
                                int64_t sliding_window) {
  run_prefill<PrefillWmma>(out, query, kv_cache, block_tables, seq_lens, query_start_loc, num_row_tiles, scale,
                         sliding_window);
}

}  // namespace voltllm
