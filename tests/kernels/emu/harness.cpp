// C entry points that run the attention kernels' exact source (decode and its split merge, both prefill
// kernels and their row-tile map) on the CPU emulator (cuda_emu.h; WMMA through include/mma.h), for
// tests/kernels/test_kernels_emulated.py (loaded with ctypes; pointers are CPU torch tensors).
#include "cuda_emu.h"
// The kernel headers come after the emulator, which stands in for the CUDA toolchain.
#include "dispatch.h"
#include "attention/paged_decode_wmma.cuh"
#include "attention/paged_prefill_tile_map.cuh"
#include "attention/paged_prefill_mma_sm80.cuh"
#include "attention/paged_prefill_wmma.cuh"

namespace {

// fn(traits, kernel) of a prefill kernel (mma_sm80: 1 = paged_prefill_mma_sm80_kernel, 0 =
// paged_prefill_wmma_kernel) for element type T and head size HEAD.
template <typename T, int HEAD, typename Fn>
void with_prefill_kernel(int mma_sm80, Fn&& fn) {
  switch (mma_sm80) {
    case 1: return fn(voltllm::PrefillMmaSm80Traits<HEAD>{}, &voltllm::paged_prefill_mma_sm80_kernel<T, HEAD>);
    case 0: return fn(voltllm::PrefillWmmaTraits<HEAD>{}, &voltllm::paged_prefill_wmma_kernel<T, HEAD>);
    default: emu::fail("prefill kernel (mma_sm80 0 or 1)");
  }
}

// The decode kernel's (and the split merge's) parameters, from a C entry point's arguments (no prologue).
voltllm::DecodeParams decode_params(void* out, const void* query, void* key_cache, void* value_cache,
                                    const int* block_tables, const int* seq_lens, float* partial_out,
                                    float* partial_max, float* partial_sum, int* merge_tickets,
                                    long long query_stride, long long out_stride, int num_heads, int num_kv_heads,
                                    int max_blocks_per_seq, int max_splits, int min_split, int sliding_window,
                                    float scale_log2) {
  voltllm::DecodeParams p{};
  p.out = out;
  p.query = query;
  p.key_cache = key_cache;
  p.value_cache = value_cache;
  p.block_tables = block_tables;
  p.seq_lens = seq_lens;
  p.partial_out = partial_out;
  p.partial_max = partial_max;
  p.partial_sum = partial_sum;
  p.merge_tickets = merge_tickets;
  p.query_stride = query_stride;
  p.out_stride = out_stride;
  p.num_heads = num_heads;
  p.num_kv_heads = num_kv_heads;
  p.max_blocks_per_seq = max_blocks_per_seq;
  p.max_splits = max_splits;
  p.min_split = min_split;
  p.sliding_window = sliding_window;
  p.scale_log2 = scale_log2;
  return p;
}

// The split merge as the glue launches it after a decode kernel that split the context.
template <typename T, int HEAD>
void run_split_merge(const voltllm::DecodeParams& p, int num_seqs, unsigned seed) {
  const dim3 grid(p.num_heads, num_seqs, HEAD / voltllm::kReduceDims);
  emu::launch(grid, dim3(voltllm::kReduceDims * voltllm::reduce_groups(p.max_splits)), voltllm::kReduceSmemBytes,
              [&] { voltllm::paged_decode_reduce_kernel<T, HEAD>(p); }, seed);
}

// The decode kernel, then (with `merge`, where the kernel does not merge through tickets) the split merge,
// as the glue launches them.
void run_decode(const voltllm::DecodeParams& p, int bf16, int head, int num_seqs, int merge, int wmma_order,
                unsigned seed) {
  emu::set_wmma_order(static_cast<emu::WmmaOrder>(wmma_order));
  emu::dispatch_dtype(bf16, [&](auto t) {
    emu::dispatch_head(head, [&](auto h) {
      using T = decltype(t);
      constexpr int H = decltype(h)::value;
      using Tr = voltllm::DecodeWmmaTraits<H>;
      emu::launch(dim3(p.num_kv_heads, num_seqs, p.max_splits), dim3(Tr::kThreads), Tr::kSmemBytes,
                  [&] { voltllm::paged_decode_wmma_kernel<T, H>(p); }, seed);
      if (merge && p.max_splits > 1 && p.merge_tickets == nullptr) run_split_merge<T, H>(p, num_seqs, seed);
    });
  });
}

}  // namespace

extern "C" {

// decode_split's (count, partition) for a span, as the glue and the kernel compute it.
void emu_decode_split(int span, int max_splits, int min_split, int* count_partition) {
  const voltllm::DecodeSplit split = voltllm::decode_split(span, max_splits, min_split);
  count_partition[0] = split.count;
  count_partition[1] = split.partition;
}

// The decode kernel over `max_splits` grid splits, then (with `merge`, and no merge_tickets for the kernel to
// merge with) the split merge where the context is split. wmma_order: 0 = scrambled, 1 = paired (see
// include/mma.h).
void emu_decode(int bf16, int head, void* out, const void* query, void* key_cache, void* value_cache,
                const int* block_tables, const int* seq_lens, float* partial_out, float* partial_max,
                float* partial_sum, int* merge_tickets, long long query_stride, long long out_stride, int num_seqs,
                int num_heads, int num_kv_heads, int max_blocks_per_seq, int max_splits, int min_split,
                int sliding_window, float scale_log2, int merge, int wmma_order, unsigned seed) {
  const voltllm::DecodeParams p =
      decode_params(out, query, key_cache, value_cache, block_tables, seq_lens, partial_out, partial_max, partial_sum,
                    merge_tickets, query_stride, out_stride, num_heads, num_kv_heads, max_blocks_per_seq, max_splits,
                    min_split, sliding_window, scale_log2);
  run_decode(p, bf16, head, num_seqs, merge, wmma_order, seed);
}

// emu_decode with the attention prologue folded in: `qkv` holds the projection rows (query_stride apart),
// and positions / cos_sin_cache / q_weight, k_weight (both or neither nullptr) / slot_mapping are the
// prologue's (DecodePrologue).
void emu_decode_prologue(int bf16, int head, void* out, const void* qkv, void* key_cache, void* value_cache,
                         const int* block_tables, const int* seq_lens, float* partial_out, float* partial_max,
                         float* partial_sum, int* merge_tickets, const long long* positions,
                         const float* cos_sin_cache, const void* q_weight, const void* k_weight,
                         const long long* slot_mapping, long long max_position, long long num_slots, float eps,
                         long long query_stride, long long out_stride, int num_seqs, int num_heads, int num_kv_heads,
                         int max_blocks_per_seq, int max_splits, int min_split, int sliding_window, float scale_log2,
                         int wmma_order, unsigned seed) {
  voltllm::DecodeParams p =
      decode_params(out, qkv, key_cache, value_cache, block_tables, seq_lens, partial_out, partial_max, partial_sum,
                    merge_tickets, query_stride, out_stride, num_heads, num_kv_heads, max_blocks_per_seq, max_splits,
                    min_split, sliding_window, scale_log2);
  p.prologue.positions = positions;
  p.prologue.cos_sin_cache = cos_sin_cache;
  p.prologue.q_weight = q_weight;
  p.prologue.k_weight = k_weight;
  p.prologue.slot_mapping = slot_mapping;
  p.prologue.max_position = max_position;
  p.prologue.num_slots = num_slots;
  p.prologue.eps = eps;
  run_decode(p, bf16, head, num_seqs, 1, wmma_order, seed);
}

// The split merge (paged_decode_reduce_kernel) over partials laid out as the decode kernel leaves them,
// launched as the glue launches it.
void emu_decode_split_merge(int bf16, int head, void* out, const int* seq_lens, float* partial_out,
                            float* partial_max, float* partial_sum, long long out_stride, int num_seqs,
                            int num_heads, int max_splits, int min_split, int sliding_window, unsigned seed) {
  const voltllm::DecodeParams p =
      decode_params(out, nullptr, nullptr, nullptr, nullptr, seq_lens, partial_out, partial_max, partial_sum, nullptr,
                    0, out_stride, num_heads, 1, 0, max_splits, min_split, sliding_window, 0.f);
  emu::dispatch_dtype(bf16, [&](auto t) {
    emu::dispatch_head(head, [&](auto h) { run_split_merge<decltype(t), decltype(h)::value>(p, num_seqs, seed); });
  });
}

// One warp of the emulated WMMA: d = a b + c (16x16; a row-major, b column- or row-major, fp16 or bf16
// inputs, fp32 c and d), and the accumulator order as the WMMA prefill kernel discovers it: codes[32 * 8] holds
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
    voltllm::prefill_wmma::accumulator_order<decltype(fc)>(reinterpret_cast<float*>(emu::dynamic_smem()), 16, order);
    for (int i = 0; i < 8; ++i) codes[emu::self().lane * 8 + i] = voltllm::prefill_wmma::order_code(order, i);
  };
  emu::launch(dim3(1), dim3(32), 16 * 16 * 4, [&] { emu::dispatch_dtype(bf16, body); }, 1);
}

// BLOCK_M of a prefill kernel (mma_sm80 1 or 0, as above) at head size `head`.
int emu_prefill_block_m(int mma_sm80, int head) {
  int block_m = 0;
  emu::dispatch_head(head, [&](auto h) {
    with_prefill_kernel<__half, decltype(h)::value>(mma_sm80, [&](auto traits, auto) {
      block_m = decltype(traits)::kBlockM;
    });
  });
  return block_m;
}

// One launch of a prefill kernel (mma_sm80 1 or 0, as above) after the row-tile map it needs, both as the
// torch glue launches them. wmma_order: 0 = scrambled, 1 = paired (see include/mma.h; mma_sm80 uses no
// WMMA).
void emu_prefill(int mma_sm80, int bf16, int head, void* out, const void* query, const void* key_cache,
                 const void* value_cache, const int* block_tables, const int* seq_lens, const int* query_start_loc,
                 int* cu_tiles, long long query_stride, long long out_stride, int num_seqs, int num_heads,
                 int num_kv_heads, int max_blocks_per_seq, int sliding_window, float scale_log2, int num_row_tiles,
                 int wmma_order, unsigned seed) {
  emu::set_wmma_order(static_cast<emu::WmmaOrder>(wmma_order));
  voltllm::PrefillParams p{};
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
  emu::dispatch_dtype(bf16, [&](auto t) {
    emu::dispatch_head(head, [&](auto h) {
      with_prefill_kernel<decltype(t), decltype(h)::value>(mma_sm80, [&](auto traits, auto kernel) {
        using Tr = decltype(traits);
        emu::launch(dim3(1), dim3(32), 0,
                    [&] { voltllm::prefill_tile_map_kernel(query_start_loc, cu_tiles, num_seqs, Tr::kBlockM); },
                    seed);
        emu::launch(dim3(num_row_tiles, num_heads), dim3(Tr::kThreads), Tr::kSmemBytes, [&] { kernel(p); }, seed);
      });
    });
  });
}

}  // extern "C"
