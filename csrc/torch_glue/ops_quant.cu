// Torch glue for the weight-only quantized kernels (csrc/quantization/): checks, device guard, stream,
// kind / row-count / tile dispatch, the split-k choice and its workspace.
#include <algorithm>
#include <type_traits>
#include <utility>

#include "torch_glue/torch_glue.h"
#include "quantization/quant_gemm_stream.cuh"
#include "quantization/quant_gemm_wmma.cuh"
#include "quantization/quant_gemv.cuh"

namespace voltllm {

using namespace glue;

namespace {

// Calls fn(std::integral_constant<int, KIND>{}) for a QuantKind number.
template <typename Fn>
void dispatch_quant_kind(int64_t kind, const char* op, Fn&& fn) {
  switch (kind) {
    case kQuantInt4:
      fn(std::integral_constant<int, kQuantInt4>{});
      break;
    case kQuantInt8:
      fn(std::integral_constant<int, kQuantInt8>{});
      break;
    case kQuantFp8:
      fn(std::integral_constant<int, kQuantFp8>{});
      break;
    default:
      TORCH_CHECK(false, op, ": unknown quantized kind ", num(kind), " (0 int4, 1 int8, 2 fp8)");
  }
}

int bits_of(int64_t kind) { return kind == kQuantInt4 ? 4 : 8; }

// What every quantized op checks: the packed weight [n, k * bits / 8] uint8 and its group parameters
// [n, num_groups] int32, both contiguous; k a multiple of 64 and groups of a power-of-two number of
// 16-byte chunks (or one group per row).
struct PackedShape {
  int64_t n, k, num_groups, chunk_group_shift;
};

PackedShape check_packed(const at::Tensor& weight, const at::Tensor& group_params, int64_t kind, int64_t group_size,
                         const char* op) {
  TORCH_CHECK(kind >= kQuantInt4 && kind <= kQuantFp8, op, ": unknown quantized kind ", num(kind));
  check_cuda(weight, "weight");
  check_cuda(group_params, "group_params");
  TORCH_CHECK(weight.scalar_type() == at::kByte && weight.dim() == 2 && weight.is_contiguous(), op,
              ": weight must be a contiguous uint8 [n, k * bits / 8] packed tensor");
  TORCH_CHECK(group_params.scalar_type() == at::kInt && group_params.dim() == 2 && group_params.is_contiguous(),
              op, ": group_params must be a contiguous int32 [n, num_groups] tensor");
  const int64_t n = weight.size(0), k = weight.size(1) * 8 / bits_of(kind);
  const int64_t num_groups = group_params.size(1), chunk = 128 / bits_of(kind);
  TORCH_CHECK(group_params.size(0) == n, op, ": group_params has ", num(group_params.size(0)), " rows, weight ",
              num(n));
  TORCH_CHECK(k % 64 == 0, op, ": k must be a multiple of 64, got ", num(k));
  TORCH_CHECK(reinterpret_cast<uintptr_t>(weight.data_ptr()) % 16 == 0, op, ": weight must be 16-byte aligned");
  int64_t shift = 0;
  if (num_groups != 1) {
    TORCH_CHECK(group_size > 0 && group_size % chunk == 0 && num_groups * group_size == k, op, ": ",
                num(num_groups), " groups of ", num(group_size), " do not tile k = ", num(k));
    const int64_t chunks = group_size / chunk;
    TORCH_CHECK((chunks & (chunks - 1)) == 0, op, ": group size ", num(group_size),
                " is not a power-of-two number of ", num(chunk), "-code chunks");
    while ((int64_t{1} << shift) < chunks) ++shift;
  }
  return {n, k, num_groups, shift};
}

void check_activation(const at::Tensor& x, int64_t k, const char* op, const char* name) {
  check_cuda(x, name);
  TORCH_CHECK(x.scalar_type() == at::kHalf, op, ": ", name, " must be float16, got ", x.scalar_type());
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k, op, ": ", name, " must be [rows, ", num(k), "]");
  TORCH_CHECK(x.stride(1) == 1 && vec8_ok(x, k), op, ": ", name, " rows must be contiguous and 16-byte aligned");
}

void check_bias(const std::optional<at::Tensor>& bias, int64_t rows, const char* op) {
  if (!bias) return;
  check_cuda(*bias, "bias");
  TORCH_CHECK(bias->scalar_type() == at::kHalf && bias->dim() == 1 && bias->size(0) == rows && bias->is_contiguous(),
              op, ": bias must be a contiguous float16 [", num(rows), "]");
}

void check_out(const at::Tensor& out, int64_t rows, int64_t n, const char* op) {
  check_cuda(out, "out");
  TORCH_CHECK(out.scalar_type() == at::kHalf && out.dim() == 2 && out.size(0) == rows && out.size(1) == n, op,
              ": out must be float16 [", num(rows), ", ", num(n), "]");
  TORCH_CHECK(out.stride(1) == 1, op, ": out rows must be contiguous");
}


// Calls fn(std::integral_constant<int, ROWS>{}) with the smallest built row count >= rows.
template <typename Fn>
void dispatch_gemv_rows(int64_t rows, Fn&& fn) {
  if (rows == 1)
    fn(std::integral_constant<int, 1>{});
  else if (rows == 2)
    fn(std::integral_constant<int, 2>{});
  else if (rows <= 4)
    fn(std::integral_constant<int, 4>{});
  else
    fn(std::integral_constant<int, 8>{});
}

// Calls fn(std::integral_constant<int, BM>{}) for a built row tile.
template <typename Fn>
void dispatch_block_m(int64_t block_m, const char* op, Fn&& fn) {
  switch (block_m) {
    case 16:
      fn(std::integral_constant<int, 16>{});
      break;
    case 64:
      fn(std::integral_constant<int, 64>{});
      break;
    case 128:
      fn(std::integral_constant<int, 128>{});
      break;
    default:
      TORCH_CHECK(false, op, ": block_m ", num(block_m), " is not built (16, 64 or 128)");
  }
}

// What both GEMMs take: the k dimension cut into `splits` slices of `per_split` tiles. With more than one
// slice the blocks add fp32 partial sums into `partial` (allocated and zeroed here; the caller keeps it
// alive) and finish_split_sum adds the bias and writes `out`.
QuantGemmParams gemm_params(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight,
                            const at::Tensor& group_params, const std::optional<at::Tensor>& bias,
                            const PackedShape& shape, int64_t splits, int64_t per_split, at::Tensor& partial) {
  const int64_t m = x.size(0), n = shape.n;
  if (splits > 1) partial = at::zeros({m, n}, x.options().dtype(at::kFloat));
  QuantGemmParams p{};
  p.out = out.data_ptr();
  p.partial = splits > 1 ? partial.data_ptr<float>() : nullptr;
  p.x = x.data_ptr();
  p.weight = reinterpret_cast<const uint4*>(weight.data_ptr());
  p.group_params = reinterpret_cast<const unsigned*>(group_params.data_ptr());
  p.bias = splits > 1 ? nullptr : (bias ? bias->data_ptr() : nullptr);
  p.out_stride = out.stride(0);
  p.x_stride = x.stride(0);
  p.m = static_cast<int>(m);
  p.n = static_cast<int>(n);
  p.k = static_cast<int>(shape.k);
  p.num_groups = static_cast<int>(shape.num_groups);
  p.chunk_group_shift = static_cast<int>(shape.chunk_group_shift);
  p.k_tiles_per_split = static_cast<int>(per_split);
  return p;
}

// out = partial (+ bias) in out's dtype, after a split-k GEMM.
void finish_split_sum(at::Tensor& out, const at::Tensor& partial, const std::optional<at::Tensor>& bias,
                      cudaStream_t stream) {
  QuantGemmFinalizeParams f{};
  f.out = out.data_ptr();
  f.partial = partial.data_ptr<float>();
  f.bias = bias ? bias->data_ptr() : nullptr;
  f.out_stride = out.stride(0);
  f.m = static_cast<int>(out.size(0));
  f.n = static_cast<int>(out.size(1));
  launch(quant_gemm_finalize_kernel, static_cast<unsigned>(out.size(0)), 256, 0, stream, f);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

void quant_gemv(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& group_params,
                const std::optional<at::Tensor>& bias, int64_t kind, int64_t group_size, bool swiglu) {
  const char* op = "quant_gemv";
  const PackedShape shape = check_packed(weight, group_params, kind, group_size, op);
  check_activation(x, shape.k, op, "x");
  const int64_t rows = x.size(0);
  TORCH_CHECK(rows >= 1 && rows <= 8, op, ": 1 to 8 rows, got ", num(rows));
  TORCH_CHECK(!swiglu || shape.n % 2 == 0, op, ": swiglu needs a [2n, k] gate/up weight");
  const int64_t n = swiglu ? shape.n / 2 : shape.n;
  check_out(out, rows, n, op);
  check_bias(bias, shape.n, op);
  const at::cuda::OptionalCUDAGuard guard(x.device());
  QuantGemvParams p{};
  p.out = out.data_ptr();
  p.x = x.data_ptr();
  p.weight = reinterpret_cast<const uint4*>(weight.data_ptr());
  p.group_params = reinterpret_cast<const unsigned*>(group_params.data_ptr());
  p.bias = bias ? bias->data_ptr() : nullptr;
  p.out_stride = out.stride(0);
  p.x_stride = x.stride(0);
  p.rows = static_cast<int>(rows);
  p.n = static_cast<int>(n);
  p.k = static_cast<int>(shape.k);
  p.num_groups = static_cast<int>(shape.num_groups);
  p.chunk_group_shift = static_cast<int>(shape.chunk_group_shift);
  const auto stream = at::cuda::getCurrentCUDAStream();
  dispatch_quant_kind(kind, op, [&](auto kind_c) {
    dispatch_gemv_rows(rows, [&](auto rows_c) {
      constexpr int K = decltype(kind_c)::value, R = decltype(rows_c)::value;
      // One row: 4 weight rows per warp, 2 chunks each in flight (H200, benches/RESULTS.md session 9: 0.59
      // of copy bandwidth over the Llama-3-8B projections, against 0.51 for session 8's shape and 0.48 for
      // the persistent form); more rows keep the default shape.
      constexpr int MATS = R == 1 ? 4 : kQuantGemvMats, UNROLL = R == 1 ? 2 : kQuantGemvUnroll;
      constexpr int W = kQuantGemvWarps;
      if (swiglu) {
        const int per_block = quant_gemv_features_per_block<true, MATS, W>();
        launch(quant_gemv_kernel<K, R, true, MATS, UNROLL, W>, static_cast<int>((n + per_block - 1) / per_block),
               32 * W, 0, stream, p);
      } else {
        const int per_block = quant_gemv_features_per_block<false, MATS, W>();
        launch(quant_gemv_kernel<K, R, false, MATS, UNROLL, W>, static_cast<int>((n + per_block - 1) / per_block),
               32 * W, 0, stream, p);
      }
    });
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void quant_add_rms_norm_gemv(at::Tensor& out, at::Tensor& residual_out, const at::Tensor& hidden,
                             const at::Tensor& residual, const at::Tensor& norm_weight, double eps,
                             const at::Tensor& weight, const at::Tensor& group_params,
                             const std::optional<at::Tensor>& bias, int64_t kind, int64_t group_size, bool swiglu) {
  const char* op = "quant_add_rms_norm_gemv";
  const PackedShape shape = check_packed(weight, group_params, kind, group_size, op);
  check_activation(hidden, shape.k, op, "hidden");
  check_activation(residual, shape.k, op, "residual");
  check_activation(residual_out, shape.k, op, "residual_out");
  TORCH_CHECK(hidden.size(0) == 1 && residual.size(0) == 1 && residual_out.size(0) == 1, op,
              ": one row (hidden, residual, residual_out [1, k])");
  TORCH_CHECK(shape.k <= kGemvNormMaxK, op, ": hidden size ", num(shape.k), " is over ", num(kGemvNormMaxK));
  check_cuda(norm_weight, "norm_weight");
  TORCH_CHECK(norm_weight.scalar_type() == at::kHalf && norm_weight.dim() == 1 && norm_weight.size(0) == shape.k &&
                  norm_weight.is_contiguous() && reinterpret_cast<uintptr_t>(norm_weight.data_ptr()) % 16 == 0,
              op, ": norm_weight must be a contiguous, 16-byte aligned float16 [", num(shape.k), "]");
  TORCH_CHECK(!swiglu || shape.n % 2 == 0, op, ": swiglu needs a [2n, k] gate/up weight");
  const int64_t n = swiglu ? shape.n / 2 : shape.n;
  check_out(out, 1, n, op);
  check_bias(bias, shape.n, op);
  // Block 0 writes residual_out, and every block out, while other blocks still read hidden and residual.
  TORCH_CHECK(!rows_overlap(residual_out, residual) && !rows_overlap(residual_out, hidden) &&
                  !rows_overlap(out, residual) && !rows_overlap(out, hidden) && !rows_overlap(out, residual_out),
              op, ": out and residual_out must not overlap each other, hidden or residual");
  const at::cuda::OptionalCUDAGuard guard(hidden.device());
  QuantGemvNormParams p{};
  p.gemv.out = out.data_ptr();
  p.gemv.weight = reinterpret_cast<const uint4*>(weight.data_ptr());
  p.gemv.group_params = reinterpret_cast<const unsigned*>(group_params.data_ptr());
  p.gemv.bias = bias ? bias->data_ptr() : nullptr;
  p.gemv.out_stride = out.stride(0);
  p.gemv.rows = 1;
  p.gemv.n = static_cast<int>(n);
  p.gemv.k = static_cast<int>(shape.k);
  p.gemv.num_groups = static_cast<int>(shape.num_groups);
  p.gemv.chunk_group_shift = static_cast<int>(shape.chunk_group_shift);
  p.norm.residual_out = residual_out.data_ptr();
  p.norm.hidden = hidden.data_ptr();
  p.norm.residual_in = residual.data_ptr();
  p.norm.norm_weight = norm_weight.data_ptr();
  p.norm.residual_out_stride = residual_out.stride(0);
  p.norm.hidden_stride = hidden.stride(0);
  p.norm.residual_in_stride = residual.stride(0);
  p.norm.eps = static_cast<float>(eps);
  p.norm.rows = 1;
  p.norm.n = static_cast<int>(n);
  p.norm.k = static_cast<int>(shape.k);
  const auto stream = at::cuda::getCurrentCUDAStream();
  const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int smem = quant_gemv_norm_smem_bytes(static_cast<int>(shape.k));
  dispatch_quant_kind(kind, op, [&](auto kind_c) {
    constexpr int K = decltype(kind_c)::value;
    constexpr int MATS = QuantGemvPersistentShape<1>::kMats, UNROLL = QuantGemvPersistentShape<1>::kUnroll;
    constexpr int W = kQuantGemvPersistentWarps;
    const int groups = swiglu ? quant_gemv_groups<true, MATS>(static_cast<int>(n))
                              : quant_gemv_groups<false, MATS>(static_cast<int>(n));
    const int blocks = static_cast<int>(std::min<int64_t>((groups + W - 1) / W, sms * kQuantGemvBlocksPerSm));
    if (swiglu) {
      launch(quant_gemv_norm_kernel<K, true, MATS, UNROLL, W>, blocks, 32 * W, smem, stream, p);
    } else {
      launch(quant_gemv_norm_kernel<K, false, MATS, UNROLL, W>, blocks, 32 * W, smem, stream, p);
    }
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void quant_gemm(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& group_params,
                const std::optional<at::Tensor>& bias, int64_t kind, int64_t group_size, int64_t block_m,
                int64_t splits) {
  const char* op = "quant_gemm";
  const PackedShape shape = check_packed(weight, group_params, kind, group_size, op);
  check_activation(x, shape.k, op, "x");
  const int64_t m = x.size(0), n = shape.n;
  TORCH_CHECK(m >= 1, op, ": x has no rows");
  check_out(out, m, n, op);
  check_bias(bias, n, op);
  TORCH_CHECK(block_m == 0 || block_m == 16 || block_m == 64 || block_m == 128, op, ": block_m ", num(block_m),
              " is not built (0 = choose, 16, 64 or 128)");
  TORCH_CHECK(splits >= 0, op, ": splits must be >= 0 (0 = choose)");
  const at::cuda::OptionalCUDAGuard guard(x.device());
  if (block_m == 0) block_m = m <= 16 ? 16 : m <= 64 ? 64 : 128;
  const int64_t k_tiles = shape.k / 64;
  const int64_t tiles = ((n + 127) / 128) * ((m + block_m - 1) / block_m);
  if (splits == 0) {
    // Split k only while the output tiles leave SMs idle: about one block per SM, at least 8 k-tiles
    // per split (benches/quantization.py's sweep: more splits than that cost more in the fp32
    // atomics and the extra kernels than they gain).
    const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
    splits = tiles >= sms ? 1 : std::max<int64_t>(1, std::min<int64_t>((sms + tiles - 1) / tiles, k_tiles / 8));
  }
  splits = std::min(splits, k_tiles);
  const int64_t per_split = (k_tiles + splits - 1) / splits;
  splits = (k_tiles + per_split - 1) / per_split;  // no empty split
  at::Tensor partial;
  const QuantGemmParams p = gemm_params(out, x, weight, group_params, bias, shape, splits, per_split, partial);
  const auto stream = at::cuda::getCurrentCUDAStream();
  dispatch_quant_kind(kind, op, [&](auto kind_c) {
    dispatch_block_m(block_m, op, [&](auto bm_c) {
      constexpr int K = decltype(kind_c)::value, BM = decltype(bm_c)::value;
      constexpr int smem = quant_gemm_smem_bytes<K, BM>();
      set_smem(quant_gemm_wmma_kernel<K, BM>, smem);
      const dim3 grid(static_cast<unsigned>((n + 127) / 128), static_cast<unsigned>((m + BM - 1) / BM),
                      static_cast<unsigned>(splits));
      launch(quant_gemm_wmma_kernel<K, BM>, grid, QuantGemmTraits<K, BM>::kThreads, smem, stream, p);
    });
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (splits > 1) finish_split_sum(out, partial, bias, stream);
}

namespace {

// Calls fn(std::integral_constant<int, MF>{}) for 1..4 fragments of 16 rows.
template <typename Fn>
void dispatch_m_frags(int64_t m_frags, const char* op, Fn&& fn) {
  switch (m_frags) {
    case 1:
      fn(std::integral_constant<int, 1>{});
      break;
    case 2:
      fn(std::integral_constant<int, 2>{});
      break;
    case 3:
      fn(std::integral_constant<int, 3>{});
      break;
    case 4:
      fn(std::integral_constant<int, 4>{});
      break;
    default:
      TORCH_CHECK(false, op, ": m_frags ", num(m_frags), " is not built (0 = choose, 1 to 4)");
  }
}

// The k split of the streaming GEMM: enough splits that about kStreamWarpsPerSm warps per SM stream
// weights at once, each split keeping at least kStreamMinChunks k-chunks (fewer would spend their time
// filling the register ring and in the fp32 atomics), and at least as many as the staged x needs to fit
// shared memory (`max_chunks` per split).
constexpr int64_t kStreamWarpsPerSm = 16;
constexpr int64_t kStreamMinChunks = 8;

int64_t stream_splits(int64_t warps, int64_t k_chunks, int64_t max_chunks) {
  const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int64_t wanted = (sms * kStreamWarpsPerSm + warps - 1) / warps;
  const int64_t splits = std::max<int64_t>(1, std::min<int64_t>(wanted, k_chunks / kStreamMinChunks));
  return std::max(splits, (k_chunks + max_chunks - 1) / max_chunks);
}

}  // namespace

void quant_gemm_stream(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& group_params,
                       const std::optional<at::Tensor>& bias, int64_t kind, int64_t group_size, int64_t m_frags,
                       int64_t splits) {
  const char* op = "quant_gemm_stream";
  const PackedShape shape = check_packed(weight, group_params, kind, group_size, op);
  check_activation(x, shape.k, op, "x");
  const int64_t m = x.size(0), n = shape.n;
  TORCH_CHECK(m >= 1, op, ": x has no rows");
  check_out(out, m, n, op);
  check_bias(bias, n, op);
  TORCH_CHECK(m_frags >= 0 && m_frags <= 4, op, ": m_frags ", num(m_frags), " is not built (0 = choose, 1 to 4)");
  TORCH_CHECK(splits >= 0, op, ": splits must be >= 0 (0 = choose)");
  const at::cuda::OptionalCUDAGuard guard(x.device());
  if (m_frags == 0) m_frags = std::min<int64_t>(4, (m + 15) / 16);
  const int64_t k_chunks = shape.k / 64;
  const auto stream = at::cuda::getCurrentCUDAStream();
  dispatch_quant_kind(kind, op, [&](auto kind_c) {
    dispatch_m_frags(m_frags, op, [&](auto mf_c) {
      constexpr int K = decltype(kind_c)::value, MF = decltype(mf_c)::value;
      constexpr int NF = QuantStreamShape<K, MF>::kNF, D = QuantStreamShape<K, MF>::kDepth;
      using Tr = QuantStreamTraits<K, MF, NF, D>;
      const int64_t features = Tr::kWarps * 16 * NF;
      const int64_t row_blocks = (m + 16 * MF - 1) / (16 * MF);
      const int smem_limit = static_cast<int>(at::cuda::getCurrentDeviceProperties()->sharedMemPerBlockOptin);
      const int64_t max_chunks = quant_gemm_stream_max_chunks<K, MF, NF, D>(smem_limit);
      TORCH_CHECK(max_chunks >= 1, op, ": the staged x does not fit shared memory");
      int64_t s = splits ? std::max(splits, (k_chunks + max_chunks - 1) / max_chunks)
                         : stream_splits(((n + 16 * NF - 1) / (16 * NF)) * row_blocks, k_chunks, max_chunks);
      s = std::min(s, k_chunks);
      const int64_t per_split = (k_chunks + s - 1) / s;
      s = (k_chunks + per_split - 1) / per_split;  // no empty split
      at::Tensor partial;
      const QuantGemmParams p = gemm_params(out, x, weight, group_params, bias, shape, s, per_split, partial);
      const int smem = quant_gemm_stream_smem_bytes<K, MF, NF, D>(static_cast<int>(per_split));
      set_smem(quant_gemm_stream_kernel<K, MF, NF, D>, smem);
      const dim3 grid(static_cast<unsigned>((n + features - 1) / features), static_cast<unsigned>(row_blocks),
                      static_cast<unsigned>(s));
      launch(quant_gemm_stream_kernel<K, MF, NF, D>, grid, Tr::kThreads, smem, stream, p);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      if (s > 1) finish_split_sum(out, partial, bias, stream);
    });
  });
}

void quant_dequantize(at::Tensor& out, const at::Tensor& weight, const at::Tensor& group_params, int64_t kind,
                      int64_t group_size) {
  const char* op = "quant_dequantize";
  const PackedShape shape = check_packed(weight, group_params, kind, group_size, op);
  check_cuda(out, "out");
  TORCH_CHECK(out.scalar_type() == at::kHalf && out.dim() == 2 && out.size(0) == shape.n &&
                  out.size(1) == shape.k && out.is_contiguous(),
              op, ": out must be a contiguous float16 [", num(shape.n), ", ", num(shape.k), "]");
  const at::cuda::OptionalCUDAGuard guard(weight.device());
  QuantDequantizeParams p{};
  p.out = out.data_ptr();
  p.weight = reinterpret_cast<const uint4*>(weight.data_ptr());
  p.group_params = reinterpret_cast<const unsigned*>(group_params.data_ptr());
  p.n = static_cast<int>(shape.n);
  p.k = static_cast<int>(shape.k);
  p.num_groups = static_cast<int>(shape.num_groups);
  p.chunk_group_shift = static_cast<int>(shape.chunk_group_shift);
  const auto stream = at::cuda::getCurrentCUDAStream();
  dispatch_quant_kind(kind, op, [&](auto kind_c) {
    constexpr int K = decltype(kind_c)::value;
    const int64_t chunks = shape.n * shape.k / QuantTraits<K>::kChunk;
    launch(quant_dequantize_kernel<K>, static_cast<unsigned>((chunks + 255) / 256), 256, 0, stream, p);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace voltllm
