// Torch glue for paged decode attention: checks, device guard, stream, split planning, dtype dispatch.
#include "torch_glue/torch_glue.h"

#include <cmath>
#include <cstdint>
#include <optional>
#include <utility>

#include "attention/paged_decode_wmma.cuh"

namespace voltllm {

using namespace glue;

namespace {

// Splits the grid can hold: one full wave of resident blocks (long-lived blocks amortise their setup over
// many KV blocks, and no second, partial wave is left), at most decode_split's count for the longest
// span with splits of at least min_split tokens, and at most 4096 (a bound on the partial buffers).
// Batches that fill the GPU on their own are not split.
int64_t grid_splits(int64_t span, int64_t base_blocks, int64_t resident_blocks, int64_t min_split) {
  const int64_t want = std::min<int64_t>(4096, std::max<int64_t>(1, resident_blocks / base_blocks));
  return decode_split(static_cast<int>(span), static_cast<int>(want), static_cast<int>(min_split)).count;
}

// The decode op's argument checks.
AttentionShape check_decode(const at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache,
                            const at::Tensor& block_tables, const at::Tensor& seq_lens, int64_t max_seq_len,
                            int64_t min_split, const char* op) {
  const auto shape = check_attention(out, query, kv_cache, block_tables, seq_lens, op);
  TORCH_CHECK(min_split >= kBlockSize && min_split <= (1 << 24), op, ": min_split must be in [", num(kBlockSize),
              ", 2^24], got ", num(min_split));
  TORCH_CHECK(seq_lens.size(0) == query.size(0), op, ": one query token per sequence expected");
  TORCH_CHECK(shape.num_heads / shape.num_kv_heads <= 16, op, ": at most 16 query heads per kv head");
  TORCH_CHECK(max_seq_len >= 1, op, ": max_seq_len must be >= 1");
  TORCH_CHECK(max_seq_len <= block_tables.size(1) * kBlockSize, op, ": max_seq_len ", num(max_seq_len),
              " exceeds the block table (", num(block_tables.size(1)), " blocks)");
  return shape;
}

// The merge tickets' checks: int32 counters, one per (sequence, kv head) at least, zero between launches.
void check_merge_tickets(const std::optional<at::Tensor>& tickets, int64_t num_seqs, const AttentionShape& shape,
                         const char* op) {
  if (!tickets) return;
  check_cuda(*tickets, "merge_tickets");
  TORCH_CHECK(tickets->scalar_type() == at::kInt && tickets->dim() == 1 && tickets->is_contiguous() &&
                  tickets->size(0) >= num_seqs * shape.num_kv_heads,
              op, ": merge_tickets must be a contiguous int32 tensor of at least num_seqs * num_kv_heads (",
              num(num_seqs * shape.num_kv_heads), ") zeros");
}

// Context positions one sequence's splits must cover: with a window, only its last blocks.
int64_t decode_span(int64_t max_seq_len, int64_t sliding_window) {
  return sliding_window > 0 ? std::min<int64_t>(max_seq_len, sliding_window + kBlockSize) : max_seq_len;
}

// The kernel parameters from the op's arguments (splits and partials come later).
DecodeParams decode_params(at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache,
                           const at::Tensor& block_tables, const at::Tensor& seq_lens, const AttentionShape& shape,
                           double scale, int64_t sliding_window, int64_t min_split) {
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
  p.min_split = static_cast<int>(min_split);
  p.sliding_window = sliding_window > 0 ? sliding_window : 0;
  p.scale_log2 = static_cast<float>(scale * 1.4426950408889634 /* log2(e) */);
  return p;
}

// The weights the kernel asks L2 for (DecodeParams::l2_prefetch): CUDA tensors on the op's device, in
// order, each a contiguous 16-byte aligned range, up to half of the L2 (the rest holds what the step reads
// beside them); the range that crosses that budget is cut, later ones are left out, and each is asked
// for in whole 16-byte units (the bulk prefetch's, so up to 15 trailing bytes are not).
L2Prefetch l2_prefetch_ranges(at::TensorList tensors, const at::Tensor& query, const char* op) {
  L2Prefetch pf{};
  TORCH_CHECK(tensors.size() <= static_cast<size_t>(L2Prefetch::kMaxRanges), op, ": at most ",
              num(L2Prefetch::kMaxRanges), " l2_prefetch tensors, got ", num(static_cast<int64_t>(tensors.size())));
  long long budget = at::cuda::getCurrentDeviceProperties()->l2CacheSize / 2;
  for (const at::Tensor& t : tensors) {
    check_cuda(t, "l2_prefetch tensor");
    TORCH_CHECK(t.device() == query.device(), op, ": l2_prefetch tensors must be on the query's device");
    TORCH_CHECK(t.is_contiguous(), op, ": l2_prefetch tensors must be contiguous");
    TORCH_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, op,
                ": l2_prefetch tensors must start 16-byte aligned");
    const long long bytes = std::min<long long>(t.numel() * t.element_size(), budget) / 16 * 16;
    if (bytes <= 0) continue;
    pf.base[pf.count] = static_cast<const char*>(t.data_ptr());
    pf.bytes[pf.count] = bytes;
    ++pf.count;
    budget -= bytes;
  }
  return pf;
}

// Sets the grid's split count, and with more than one split allocates the partials (returned: they must
// live until the launches that use them are enqueued).
std::pair<at::Tensor, at::Tensor> set_splits(DecodeParams& p, const at::Tensor& query, const AttentionShape& shape,
                                             int64_t num_seqs, int64_t splits) {
  p.max_splits = static_cast<int>(splits);
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

// Plans the splits and launches the decode kernel (then the split merge kernel where the splits are not
// merged in the kernel: more than ticket_max_splits of them, or no tickets).
void launch_decode(DecodeParams& p, const at::Tensor& query, const AttentionShape& shape, int64_t max_seq_len,
                   int64_t sliding_window, const std::optional<at::Tensor>& merge_tickets, int64_t ticket_max_splits,
                   const char* op) {
  const int64_t num_seqs = query.size(0);
  const at::cuda::OptionalCUDAGuard guard(query.device());
  const auto stream = at::cuda::getCurrentCUDAStream();
  const int num_sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int64_t span = decode_span(max_seq_len, sliding_window);
  dispatch_dtype(query.scalar_type(), op, [&](auto t) {
    using T = decltype(t);
    dispatch_head_size(shape.head_size, op, [&](auto h) {
      constexpr int H = decltype(h)::value;
      using Tr = DecodeWmmaTraits<H>;
      auto* kernel = paged_decode_wmma_kernel<T, H>;
      set_smem(kernel, Tr::kSmemBytes);
      int blocks_per_sm = 0;
      C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks_per_sm, kernel, Tr::kThreads,
                                                                   Tr::kSmemBytes));
      const int64_t splits = grid_splits(span, num_seqs * shape.num_kv_heads,
                                         static_cast<int64_t>(num_sms) * std::max(blocks_per_sm, 1), p.min_split);
      const auto partials = set_splits(p, query, shape, num_seqs, splits);
      const bool merge_in_kernel = merge_tickets && splits > 1 && splits <= ticket_max_splits;
      p.merge_tickets = merge_in_kernel ? merge_tickets->data_ptr<int>() : nullptr;
      launch(kernel, dim3(shape.num_kv_heads, num_seqs, splits), Tr::kThreads, Tr::kSmemBytes, stream, p);
      if (splits > 1 && !merge_in_kernel) launch_split_merge<T, H>(p, shape, num_seqs, stream);
    });
  });
}

}  // namespace

void paged_decode_attention(at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache,
                            const at::Tensor& block_tables, const at::Tensor& seq_lens, int64_t max_seq_len,
                            double scale, int64_t sliding_window, int64_t min_split,
                            const std::optional<at::Tensor>& merge_tickets, int64_t ticket_max_splits,
                            at::TensorList l2_prefetch) {
  const char* op = "paged_decode_attention";
  const auto shape = check_decode(out, query, kv_cache, block_tables, seq_lens, max_seq_len, min_split, op);
  check_merge_tickets(merge_tickets, query.size(0), shape, op);
  if (query.size(0) == 0) return;
  DecodeParams p =
      decode_params(out, query, kv_cache, block_tables, seq_lens, shape, scale, sliding_window, min_split);
  p.l2_prefetch = l2_prefetch_ranges(l2_prefetch, query, op);
  launch_decode(p, query, shape, max_seq_len, sliding_window, merge_tickets, ticket_max_splits, op);
}

void paged_decode_attention_prologue(at::Tensor& out, const at::Tensor& qkv, const at::Tensor& positions,
                                     const at::Tensor& cos_sin_cache, const std::optional<at::Tensor>& q_weight,
                                     const std::optional<at::Tensor>& k_weight, double eps, at::Tensor& kv_cache,
                                     const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                                     const at::Tensor& seq_lens, int64_t max_seq_len, double scale,
                                     int64_t sliding_window, int64_t min_split,
                                     const std::optional<at::Tensor>& merge_tickets, int64_t ticket_max_splits,
                                     at::TensorList l2_prefetch) {
  const char* op = "paged_decode_attention_prologue";
  check_rows(out, "out");
  check_cuda(qkv, "qkv");
  TORCH_CHECK(out.dim() == 3, op, ": out must be [num_seqs, num_heads, head_size]");
  TORCH_CHECK(kv_cache.dim() == 5, op, ": kv_cache must be [2, num_blocks, block_size, num_kv_heads, head_size]");
  const int64_t num_heads = out.size(1), head_size = out.size(2), num_kv_heads = kv_cache.size(3);
  TORCH_CHECK(qkv.dim() == 2 && qkv.size(0) == out.size(0) && qkv.stride(1) == 1 &&
                  qkv.size(1) == (num_heads + 2 * num_kv_heads) * head_size,
              op, ": qkv must be [num_seqs, (num_heads + 2 * num_kv_heads) * head_size] with contiguous rows");
  // The query heads are the first num_heads * head_size columns of each qkv row.
  const at::Tensor query = qkv.narrow(1, 0, num_heads * head_size).view({qkv.size(0), num_heads, head_size});
  const auto shape = check_decode(out, query, kv_cache, block_tables, seq_lens, max_seq_len, min_split, op);
  check_qk_prologue(qkv, positions, cos_sin_cache, q_weight, k_weight, slot_mapping, qkv.size(0), head_size, op);
  check_merge_tickets(merge_tickets, qkv.size(0), shape, op);
  if (qkv.size(0) == 0) return;
  DecodeParams p =
      decode_params(out, query, kv_cache, block_tables, seq_lens, shape, scale, sliding_window, min_split);
  p.prologue.positions = reinterpret_cast<const long long*>(positions.data_ptr<int64_t>());
  p.prologue.cos_sin_cache = cos_sin_cache.data_ptr<float>();
  p.prologue.q_weight = q_weight ? q_weight->data_ptr() : nullptr;
  p.prologue.k_weight = k_weight ? k_weight->data_ptr() : nullptr;
  p.prologue.slot_mapping = reinterpret_cast<const long long*>(slot_mapping.data_ptr<int64_t>());
  p.prologue.max_position = cos_sin_cache.size(0);
  p.prologue.num_slots = kv_cache.size(1) * kBlockSize;
  p.prologue.eps = static_cast<float>(eps);
  p.l2_prefetch = l2_prefetch_ranges(l2_prefetch, query, op);
  launch_decode(p, query, shape, max_seq_len, sliding_window, merge_tickets, ticket_max_splits, op);
}

}  // namespace voltllm
