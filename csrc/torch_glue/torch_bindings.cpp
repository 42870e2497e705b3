// Every op schema, declared once. Ops land in torch.ops.voltllm_C; voltllm/ops/*.py wraps them.
#include <torch/all.h>
#include <torch/library.h>

#include <optional>

namespace voltllm {
void kv_cache_write(const at::Tensor& key, const at::Tensor& value, at::Tensor& kv_cache,
                    const at::Tensor& slot_mapping);
void paged_decode_attention(at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache,
                            const at::Tensor& block_tables, const at::Tensor& seq_lens, int64_t max_seq_len,
                            double scale, int64_t sliding_window, int64_t min_split,
                            const std::optional<at::Tensor>& merge_tickets, int64_t ticket_max_splits,
                            at::TensorList l2_prefetch);
void paged_decode_attention_prologue(at::Tensor& out, const at::Tensor& qkv, const at::Tensor& positions,
                                     const at::Tensor& cos_sin_cache, const std::optional<at::Tensor>& q_weight,
                                     const std::optional<at::Tensor>& k_weight, double eps, at::Tensor& kv_cache,
                                     const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                                     const at::Tensor& seq_lens, int64_t max_seq_len, double scale,
                                     int64_t sliding_window, int64_t min_split,
                                     const std::optional<at::Tensor>& merge_tickets, int64_t ticket_max_splits,
                                     at::TensorList l2_prefetch);
void paged_prefill_attention_mma_sm80(at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache,
                                const at::Tensor& block_tables, const at::Tensor& seq_lens,
                                const at::Tensor& query_start_loc, int64_t num_row_tiles, double scale,
                                int64_t sliding_window);
int64_t prefill_block_m_mma_sm80(int64_t head_size);
void paged_prefill_attention_wmma(at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache,
                                const at::Tensor& block_tables, const at::Tensor& seq_lens,
                                const at::Tensor& query_start_loc, int64_t num_row_tiles, double scale,
                                int64_t sliding_window);
int64_t prefill_block_m_wmma(int64_t head_size);
void rms_norm(at::Tensor& out, const at::Tensor& input, const at::Tensor& weight, double eps);
void fused_add_rms_norm(at::Tensor& input, at::Tensor& residual, const at::Tensor& weight, double eps);
void rotary_embedding(const at::Tensor& positions, at::Tensor& query, const std::optional<at::Tensor>& key,
                      const at::Tensor& cos_sin_cache, int64_t head_size, bool is_neox);
void silu_and_mul(at::Tensor& out, const at::Tensor& input);
void radix_sampling(at::Tensor& out, const at::Tensor& logits, const at::Tensor& temperature,
                    const std::optional<at::Tensor>& top_k, const std::optional<at::Tensor>& top_p,
                    const std::optional<at::Tensor>& min_p, const at::Tensor& seeds);
void race_first_sampling(at::Tensor& out, const at::Tensor& logits, const std::optional<at::Tensor>& temperature,
                         const std::optional<at::Tensor>& top_p, const std::optional<at::Tensor>& seeds,
                         int64_t min_split_tokens);
void apply_token_bitmask(at::Tensor& logits, const at::Tensor& bitmask, const std::optional<at::Tensor>& rows);
void gemv(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
          bool swiglu);
void add_rms_norm_gemv(at::Tensor& out, at::Tensor& residual_out, const at::Tensor& hidden,
                       const at::Tensor& residual, const at::Tensor& norm_weight, double eps,
                       const at::Tensor& weight, const std::optional<at::Tensor>& bias, bool swiglu);
void qk_norm_rope_kv_write(at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos_sin_cache,
                           const std::optional<at::Tensor>& q_weight, const std::optional<at::Tensor>& k_weight,
                           double eps, int64_t num_heads, at::Tensor& kv_cache, const at::Tensor& slot_mapping);
void quant_gemv(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& group_params,
                const std::optional<at::Tensor>& bias, int64_t kind, int64_t group_size, bool swiglu, int64_t shape);
void quant_gemv_add_rms_norm(at::Tensor& out, at::Tensor& residual_out, const at::Tensor& x, const at::Tensor& weight,
                             const at::Tensor& group_params, const std::optional<at::Tensor>& bias,
                             const at::Tensor& residual_in, const at::Tensor& norm_weight, double eps,
                             at::Tensor& arrivals, int64_t kind, int64_t group_size, int64_t shape);
void quant_gemm(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& group_params,
                const std::optional<at::Tensor>& bias, int64_t kind, int64_t group_size, int64_t block_m,
                int64_t splits);
void quant_gemm_stream(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& group_params,
                       const std::optional<at::Tensor>& bias, at::Tensor& split_counters, int64_t kind,
                       int64_t group_size, int64_t m_frags, int64_t n_frags, int64_t splits);
void quant_gemm_mma(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& group_params,
                    const std::optional<at::Tensor>& bias, at::Tensor& split_counters, int64_t kind,
                    int64_t group_size, int64_t m_frags, int64_t splits, int64_t form);
void quant_dequantize(at::Tensor& out, const at::Tensor& weight, const at::Tensor& group_params, int64_t kind,
                      int64_t group_size);
void moe_topk_softmax(at::Tensor& topk_weights, at::Tensor& topk_ids, const at::Tensor& router_logits,
                      bool renormalize);
void moe_align(at::Tensor& sorted_pair_ids, at::Tensor& tile_experts, at::Tensor& num_tiles,
               const at::Tensor& topk_ids, int64_t num_experts, int64_t tile_rows);
int64_t moe_tile_rows(bool grouped_gemm);
void moe_experts(at::Tensor& out, const at::Tensor& a, const at::Tensor& weight, const at::Tensor& sorted_pair_ids,
                 const at::Tensor& tile_experts, const at::Tensor& num_tiles, const at::Tensor& topk_weights,
                 int64_t top_k, bool gated, bool grouped_gemm);
void moe_combine(at::Tensor& out, const at::Tensor& y, int64_t top_k);
}  // namespace voltllm

TORCH_LIBRARY(voltllm_C, m) {
  m.def("kv_cache_write(Tensor key, Tensor value, Tensor(a!) kv_cache, Tensor slot_mapping) -> ()");
  m.def(
      "paged_decode_attention(Tensor(a!) out, Tensor query, Tensor kv_cache, Tensor block_tables, "
      "Tensor seq_lens, int max_seq_len, float scale, int sliding_window, int min_split, "
      "Tensor(b!)? merge_tickets, int ticket_max_splits, Tensor[] l2_prefetch) -> ()");
  m.def(
      "paged_decode_attention_prologue(Tensor(a!) out, Tensor qkv, Tensor positions, Tensor cos_sin_cache, "
      "Tensor? q_weight, Tensor? k_weight, float eps, Tensor(b!) kv_cache, Tensor slot_mapping, "
      "Tensor block_tables, Tensor seq_lens, int max_seq_len, float scale, int sliding_window, int min_split, "
      "Tensor(c!)? merge_tickets, int ticket_max_splits, Tensor[] l2_prefetch) -> ()");
  m.def(
      "paged_prefill_attention_mma_sm80(Tensor(a!) out, Tensor query, Tensor kv_cache, Tensor block_tables, "
      "Tensor seq_lens, Tensor query_start_loc, int num_row_tiles, float scale, int sliding_window) -> ()");
  m.def("prefill_block_m_mma_sm80(int head_size) -> int", &voltllm::prefill_block_m_mma_sm80);
  m.def(
      "paged_prefill_attention_wmma(Tensor(a!) out, Tensor query, Tensor kv_cache, Tensor block_tables, "
      "Tensor seq_lens, Tensor query_start_loc, int num_row_tiles, float scale, int sliding_window) -> ()");
  m.def("prefill_block_m_wmma(int head_size) -> int", &voltllm::prefill_block_m_wmma);
  m.def("rms_norm(Tensor(a!) out, Tensor input, Tensor weight, float eps) -> ()");
  m.def("fused_add_rms_norm(Tensor(a!) input, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def(
      "rotary_embedding(Tensor positions, Tensor(a!) query, Tensor(b!)? key, Tensor cos_sin_cache, "
      "int head_size, bool is_neox) -> ()");
  m.def("silu_and_mul(Tensor(a!) out, Tensor input) -> ()");
  m.def(
      "radix_sampling(Tensor(a!) out, Tensor logits, Tensor temperature, Tensor? top_k, Tensor? top_p, Tensor? min_p, "
      "Tensor seeds) -> ()");
  m.def(
      "race_first_sampling(Tensor(a!) out, Tensor logits, Tensor? temperature, Tensor? top_p, Tensor? seeds, "
      "int min_split_tokens) -> ()");
  m.def("apply_token_bitmask(Tensor(a!) logits, Tensor bitmask, Tensor? rows) -> ()");
  m.def(
      "gemv(Tensor(a!) out, Tensor x, Tensor weight, Tensor? bias, bool swiglu) -> ()");
  m.def(
      "add_rms_norm_gemv(Tensor(a!) out, Tensor(b!) residual_out, Tensor hidden, Tensor residual, "
      "Tensor norm_weight, float eps, Tensor weight, Tensor? bias, bool swiglu) -> ()");
  m.def(
      "qk_norm_rope_kv_write(Tensor(a!) qkv, Tensor positions, Tensor cos_sin_cache, Tensor? q_weight, "
      "Tensor? k_weight, float eps, int num_heads, Tensor(b!) kv_cache, Tensor slot_mapping) -> ()");
  m.def(
      "quant_gemv(Tensor(a!) out, Tensor x, Tensor weight, Tensor group_params, Tensor? bias, int kind, "
      "int group_size, bool swiglu, int shape) -> ()");
  m.def(
      "quant_gemv_add_rms_norm(Tensor(a!) out, Tensor(b!) residual_out, Tensor x, Tensor weight, "
      "Tensor group_params, Tensor? bias, Tensor residual_in, Tensor norm_weight, float eps, Tensor(c!) arrivals, "
      "int kind, int group_size, int shape) -> ()");
  m.def(
      "quant_gemm(Tensor(a!) out, Tensor x, Tensor weight, Tensor group_params, Tensor? bias, int kind, "
      "int group_size, int block_m, int splits) -> ()");
  m.def(
      "quant_gemm_stream(Tensor(a!) out, Tensor x, Tensor weight, Tensor group_params, Tensor? bias, "
      "Tensor(b!) split_counters, int kind, int group_size, int m_frags, int n_frags, int splits) -> ()");
  m.def(
      "quant_gemm_mma(Tensor(a!) out, Tensor x, Tensor weight, Tensor group_params, Tensor? bias, "
      "Tensor(b!) split_counters, int kind, int group_size, int m_frags, int splits, int form) -> ()");
  m.def(
      "quant_dequantize(Tensor(a!) out, Tensor weight, Tensor group_params, int kind, int group_size) -> ()");
  m.def("moe_topk_softmax(Tensor(a!) topk_weights, Tensor(b!) topk_ids, Tensor router_logits, bool renormalize) -> ()");
  m.def(
      "moe_align(Tensor(a!) sorted_pair_ids, Tensor(b!) tile_experts, Tensor(c!) num_tiles, Tensor topk_ids, "
      "int num_experts, int tile_rows) -> ()");
  m.def("moe_tile_rows(bool grouped_gemm) -> int", &voltllm::moe_tile_rows);
  m.def(
      "moe_experts(Tensor(a!) out, Tensor a, Tensor weight, Tensor sorted_pair_ids, Tensor tile_experts, "
      "Tensor num_tiles, Tensor topk_weights, int top_k, bool gated, bool grouped_gemm) -> ()");
  m.def("moe_combine(Tensor(a!) out, Tensor y, int top_k) -> ()");
}

TORCH_LIBRARY_IMPL(voltllm_C, CUDA, m) {
  m.impl("kv_cache_write", &voltllm::kv_cache_write);
  m.impl("paged_decode_attention", &voltllm::paged_decode_attention);
  m.impl("paged_decode_attention_prologue", &voltllm::paged_decode_attention_prologue);
  m.impl("paged_prefill_attention_mma_sm80", &voltllm::paged_prefill_attention_mma_sm80);
  m.impl("paged_prefill_attention_wmma", &voltllm::paged_prefill_attention_wmma);
  m.impl("rms_norm", &voltllm::rms_norm);
  m.impl("fused_add_rms_norm", &voltllm::fused_add_rms_norm);
  m.impl("rotary_embedding", &voltllm::rotary_embedding);
  m.impl("silu_and_mul", &voltllm::silu_and_mul);
  m.impl("radix_sampling", &voltllm::radix_sampling);
  m.impl("race_first_sampling", &voltllm::race_first_sampling);
  m.impl("apply_token_bitmask", &voltllm::apply_token_bitmask);
  m.impl("gemv", &voltllm::gemv);
  m.impl("add_rms_norm_gemv", &voltllm::add_rms_norm_gemv);
  m.impl("qk_norm_rope_kv_write", &voltllm::qk_norm_rope_kv_write);
  m.impl("quant_gemv", &voltllm::quant_gemv);
  m.impl("quant_gemv_add_rms_norm", &voltllm::quant_gemv_add_rms_norm);
  m.impl("quant_gemm", &voltllm::quant_gemm);
  m.impl("quant_gemm_stream", &voltllm::quant_gemm_stream);
  m.impl("quant_gemm_mma", &voltllm::quant_gemm_mma);
  m.impl("quant_dequantize", &voltllm::quant_dequantize);
  m.impl("moe_topk_softmax", &voltllm::moe_topk_softmax);
  m.impl("moe_align", &voltllm::moe_align);
  m.impl("moe_experts", &voltllm::moe_experts);
  m.impl("moe_combine", &voltllm::moe_combine);
}
