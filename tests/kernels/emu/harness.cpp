// C entry points that run the v8 attention kernels' and the v9 prefill kernel's exact source on the CPU
// emulator (cuda_emu.h; WMMA through include/mma.h), for tests/kernels/test_kernels_emulated.py (loaded
// with ctypes; pointers are CPU torch tensors).
#include "cuda_emu.h"
// The kernel headers come after the emulator, which stands in for the CUDA toolchain.
#include "paged_decode_attention_v8.cuh"
#include "paged_prefill_attention_v8.cuh"
#include "paged_prefill_attention_v9.cuh"

namespace {

template <typename T, int HEAD, int NT>
void run_decode(const voltllm::DecodeV8Params& p, int num_seqs, int warps, unsigned seed) {
  using Tr = voltllm::DecodeV8Traits<HEAD, NT>;
  if (warps > Tr::kMaxWarps) emu::fail("more warps than the variant's launch bounds allow");
  const dim3 grid(p.num_kv_heads, num_seqs, p.max_splits);
  emu::launch(grid, dim3(32 * warps), Tr::smem_bytes(warps),
              [&] { voltllm::paged_decode_v8_kernel<T, HEAD, NT>(p); }, seed);
}

template <typename T, int HEAD>
void run_decode_group(const voltllm::DecodeV8Params& p, int num_seqs, int warps, unsigned seed) {
  if (p.num_heads / p.num_kv_heads <= 8) {
    run_decode<T, HEAD, 1>(p, num_seqs, warps, seed);
  } else {
    run_decode<T, HEAD, 2>(p, num_seqs, warps, seed);
  }
}

template <typename T>
void run_decode_head(int head, const voltllm::DecodeV8Params& p, int num_seqs, int warps, unsigned seed) {
  switch (head) {
    case 64: return run_decode_group<T, 64>(p, num_seqs, warps, seed);
    case 128: return run_decode_group<T, 128>(p, num_seqs, warps, seed);
    case 256: return run_decode_group<T, 256>(p, num_seqs, warps, seed);
    default: emu::fail("head size");
  }
}

template <typename T, int HEAD>
void run_prefill(const voltllm::PrefillV8Params& p, int num_row_tiles, unsigned seed) {
  using Tr = voltllm::PrefillV8Traits<HEAD>;
  emu::launch(dim3(num_row_tiles, p.num_heads), dim3(Tr::kThreads), Tr::kSmemBytes,
              [&] { voltllm::paged_prefill_v8_kernel<T, HEAD>(p); }, seed);
}

template <typename T>
void run_prefill_head(int head, const voltllm::PrefillV8Params& p, int num_row_tiles, unsigned seed) {
  switch (head) {
    case 64: return run_prefill<T, 64>(p, num_row_tiles, seed);
    case 128: return run_prefill<T, 128>(p, num_row_tiles, seed);
    case 256: return run_prefill<T, 256>(p, num_row_tiles, seed);
    default: emu::fail("head size");
  }
}

template <typename T, int HEAD>
void run_prefill_v9(const voltllm::PrefillV9Params& p, int num_row_tiles, unsigned seed) {
  using Tr = voltllm::PrefillV9Traits<HEAD>;
  emu::launch(dim3(num_row_tiles, p.num_heads), dim3(Tr::kThreads), Tr::kSmemBytes,
              [&] { voltllm::paged_prefill_v9_kernel<T, HEAD>(p); }, seed);
}

template <typename T>
void run_prefill_v9_head(int head, const voltllm::PrefillV9Params& p, int num_row_tiles, unsigned seed) {
  switch (head) {
    case 64: return run_prefill_v9<T, 64>(p, num_row_tiles, seed);
    case 128: return run_prefill_v9<T, 128>(p, num_row_tiles, seed);
    case 256: return run_prefill_v9<T, 256>(p, num_row_tiles, seed);
    default: emu::fail("head size");
  }
}

// The tile map the torch glue builds with prefill_tile_map_kernel, built here on the host.
void build_tile_map(const int* query_start_loc, int num_seqs, int block_m, int* cu_tiles) {
  cu_tiles[0] = 0;
  for (int i = 0; i < num_seqs; ++i) {
    cu_tiles[i + 1] = cu_tiles[i] + (query_start_loc[i + 1] - query_start_loc[i] + block_m - 1) / block_m;
  }
}

}  // namespace

extern "C" {

// plan[0..2] = warps, splits, partition.
void emu_plan_decode_v8(long long span, long long base_blocks, long long num_sms, int resident4, int resident8,
                        int resident16, int max_warps, long long* plan) {
  const int resident[3] = {resident4, resident8, resident16};
  const voltllm::DecodeV8Plan r = voltllm::plan_decode_v8(span, base_blocks, num_sms, resident, max_warps);
  plan[0] = r.warps;
  plan[1] = r.splits;
  plan[2] = r.partition;
}

int emu_decode_v8_max_warps(int head, int nt) {
  if (nt == 1) return head == 64 ? voltllm::DecodeV8Traits<64, 1>::kMaxWarps
                    : head == 128 ? voltllm::DecodeV8Traits<128, 1>::kMaxWarps
                                  : voltllm::DecodeV8Traits<256, 1>::kMaxWarps;
  return head == 64 ? voltllm::DecodeV8Traits<64, 2>::kMaxWarps
         : head == 128 ? voltllm::DecodeV8Traits<128, 2>::kMaxWarps
                       : voltllm::DecodeV8Traits<256, 2>::kMaxWarps;
}

void emu_decode_v8(int bf16, int head, void* out, const void* query, const void* key_cache, const void* value_cache,
                   const int* block_tables, const int* seq_lens, float* partial_out, float* partial_max,
                   float* partial_sum, int* tickets, long long query_stride, long long out_stride, int num_seqs,
                   int num_heads, int num_kv_heads, int max_blocks_per_seq, int max_splits, int partition_size,
                   int sliding_window, float scale_log2, int fused_merge, int warps, unsigned seed) {
  voltllm::DecodeV8Params p{};
  p.out = out;
  p.query = query;
  p.key_cache = key_cache;
  p.value_cache = value_cache;
  p.block_tables = block_tables;
  p.seq_lens = seq_lens;
  p.partial_out = partial_out;
  p.partial_max = partial_max;
  p.partial_sum = partial_sum;
  p.tickets = tickets;
  p.query_stride = query_stride;
  p.out_stride = out_stride;
  p.num_heads = num_heads;
  p.num_kv_heads = num_kv_heads;
  p.max_blocks_per_seq = max_blocks_per_seq;
  p.max_splits = max_splits;
  p.partition_size = partition_size;
  p.sliding_window = sliding_window;
  p.scale_log2 = scale_log2;
  p.fused_merge = fused_merge;
  if (bf16) {
    run_decode_head<__nv_bfloat16>(head, p, num_seqs, warps, seed);
  } else {
    run_decode_head<__half>(head, p, num_seqs, warps, seed);
  }
}

int emu_prefill_v8_block_m(int head) {
  return head == 64 ? voltllm::PrefillV8Traits<64>::kBlockM
         : head == 128 ? voltllm::PrefillV8Traits<128>::kBlockM
                       : voltllm::PrefillV8Traits<256>::kBlockM;
}

void emu_prefill_v8(int bf16, int head, void* out, const void* query, const void* key_cache, const void* value_cache,
                    const int* block_tables, const int* seq_lens, const int* query_start_loc, int* cu_tiles,
                    long long query_stride, long long out_stride, int num_seqs, int num_heads, int num_kv_heads,
                    int max_blocks_per_seq, int sliding_window, float scale_log2, int num_row_tiles, unsigned seed) {
  build_tile_map(query_start_loc, num_seqs, emu_prefill_v8_block_m(head), cu_tiles);
  voltllm::PrefillV8Params p{};
  p.out = out;
  p.query = query;
  p.key_cache = key_cache;
  p.value_cache = value_cache;
  p.block_tables = block_tables;
  p.seq_lens = seq_lens;
  p.query_start_loc = query_start_loc;
  p.cu_tiles = cu_tiles;
  p.query_stride = query_stride;
  p.out_stride = out_stride;
  p.num_seqs = num_seqs;
  p.num_heads = num_heads;
  p.num_kv_heads = num_kv_heads;
  p.max_blocks_per_seq = max_blocks_per_seq;
  p.sliding_window = sliding_window;
  p.scale_log2 = scale_log2;
  if (bf16) {
    run_prefill_head<__nv_bfloat16>(head, p, num_row_tiles, seed);
  } else {
    run_prefill_head<__half>(head, p, num_row_tiles, seed);
  }
}

// One warp of the emulated WMMA: d = a b + c (16x16; a row-major, b column- or row-major, fp16 or bf16
// inputs, fp32 c and d), and the accumulator order as the v9 kernel discovers it: codes[32 * 8] holds
// row * 16 + col of element i of lane l at l * 8 + i.
void emu_wmma_gemm(int bf16, int b_col_major, const void* a, const void* b, const float* c, float* d, int* codes,
                   int wmma_order) {
  emu::set_wmma_order(static_cast<emu::WmmaOrder>(wmma_order));
  auto body = [&](auto t) {
    using T = decltype(t);
    using namespace nvcuda;
    wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> fa;
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> fc;
    wmma::load_matrix_sync(fa, static_cast<const T*>(a), 16);
    wmma::load_matrix_sync(fc, c, 16, wmma::mem_row_major);
    if (b_col_major) {
      wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> fb;
      wmma::load_matrix_sync(fb, static_cast<const T*>(b), 16);
      wmma::mma_sync(fc, fa, fb, fc);
    } else {
      wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> fb;
      wmma::load_matrix_sync(fb, static_cast<const T*>(b), 16);
      wmma::mma_sync(fc, fa, fb, fc);
    }
    wmma::store_matrix_sync(d, fc, 16, wmma::mem_row_major);
    uint2 order;
    voltllm::v9::accumulator_order<decltype(fc)>(reinterpret_cast<float*>(emu::dynamic_smem()), 16, order);
    for (int i = 0; i < 8; ++i) codes[emu::self().lane * 8 + i] = voltllm::v9::order_code(order, i);
  };
  emu::launch(dim3(1), dim3(32), 16 * 16 * 4, [&] { bf16 ? body(__nv_bfloat16{}) : body(__half{}); }, 1);
}

int emu_prefill_v9_block_m(int head) {
  return head == 64 ? voltllm::PrefillV9Traits<64>::kBlockM
         : head == 128 ? voltllm::PrefillV9Traits<128>::kBlockM
                       : voltllm::PrefillV9Traits<256>::kBlockM;
}

// wmma_order: 0 = scrambled, 1 = paired (see include/mma.h).
void emu_prefill_v9(int bf16, int head, void* out, const void* query, const void* key_cache, const void* value_cache,
                    const int* block_tables, const int* seq_lens, const int* query_start_loc, int* cu_tiles,
                    long long query_stride, long long out_stride, int num_seqs, int num_heads, int num_kv_heads,
                    int max_blocks_per_seq, int sliding_window, float scale_log2, int num_row_tiles, int wmma_order,
                    unsigned seed) {
  build_tile_map(query_start_loc, num_seqs, emu_prefill_v9_block_m(head), cu_tiles);
  emu::set_wmma_order(static_cast<emu::WmmaOrder>(wmma_order));
  voltllm::PrefillV9Params p{};
  p.out = out;
  p.query = query;
  p.key_cache = key_cache;
  p.value_cache = value_cache;
  p.block_tables = block_tables;
  p.seq_lens = seq_lens;
  p.query_start_loc = query_start_loc;
  p.cu_tiles = cu_tiles;
  p.query_stride = query_stride;
  p.out_stride = out_stride;
  p.num_seqs = num_seqs;
  p.num_heads = num_heads;
  p.num_kv_heads = num_kv_heads;
  p.max_blocks_per_seq = max_blocks_per_seq;
  p.sliding_window = sliding_window;
  p.scale_log2 = scale_log2;
  if (bf16) {
    run_prefill_v9_head<__nv_bfloat16>(head, p, num_row_tiles, seed);
  } else {
    run_prefill_v9_head<__half>(head, p, num_row_tiles, seed);
  }
}

}  // extern "C"
