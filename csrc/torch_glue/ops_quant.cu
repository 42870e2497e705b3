// Torch glue for the weight-only quantized kernels (csrc/quantization/): checks, device guard, stream,
// kind / row-count / tile dispatch, the split-k choice and its workspace.
#include <algorithm>
#include <string>
#include <type_traits>
#include <utility>

#include "torch_glue/torch_glue.h"
#include "quantization/quant_gemm_mma_sm80.cuh"
#include "quantization/quant_gemm_stream.cuh"
#include "quantization/quant_gemm_wmma.cuh"
#include "quantization/quant_gemv.cuh"

namespace voltllm {

using namespace glue;

namespace {

// Calls fn(std::integral_constant<int, V>{}) for the V of VALUES equal to `value`; any other value is an
// error naming `what` and the built values. Every compile-time choice of this file goes through it.
template <int... VALUES, typename Fn>
void dispatch_built(int64_t value, const char* op, const char* what, Fn&& fn) {
  const bool found = ((value == VALUES && (fn(std::integral_constant<int, VALUES>{}), true)) || ...);
  if (found) return;
  std::string built;
  ((built += (built.empty() ? "" : ", ") + num(VALUES)), ...);
  TORCH_CHECK(false, op, ": ", what, " ", num(value), " is not built (", built, ")");
}

// Calls fn(std::integral_constant<int, KIND>{}) for a QuantKind number.
template <typename Fn>
void dispatch_quant_kind(int64_t kind, const char* op, Fn&& fn) {
  dispatch_built<kQuantInt4, kQuantInt8, kQuantFp8>(kind, op, "quantized kind (0 int4, 1 int8, 2 fp8)", fn);
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

// The packed weight's fields every kernel's params hold (QuantGemvParams, QuantGemmParams,
// QuantStreamParams, QuantDequantizeParams name them alike).
template <typename Params>
void set_packed_fields(Params& p, const at::Tensor& weight, const at::Tensor& group_params, int64_t k,
                       int64_t num_groups, int64_t chunk_group_shift) {
  p.weight = reinterpret_cast<const uint4*>(weight.data_ptr());
  p.group_params = reinterpret_cast<const unsigned*>(group_params.data_ptr());
  p.k = static_cast<int>(k);
  p.num_groups = static_cast<int>(num_groups);
  p.chunk_group_shift = static_cast<int>(chunk_group_shift);
}

template <typename Params>
void set_packed_fields(Params& p, const at::Tensor& weight, const at::Tensor& group_params, const PackedShape& shape) {
  set_packed_fields(p, weight, group_params, shape.k, shape.num_groups, shape.chunk_group_shift);
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


// Calls fn(std::integral_constant<int, ROWS>{}) with the smallest built row count >= rows, for 2..8 rows
// (one row has its own shapes: dispatch_one_row_shape).
template <typename Fn>
void dispatch_gemv_rows(int64_t rows, Fn&& fn) {
  if (rows == 2)
    fn(std::integral_constant<int, 2>{});
  else if (rows <= 4)
    fn(std::integral_constant<int, 4>{});
  else
    fn(std::integral_constant<int, 8>{});
}

// What the tiled GEMM takes: the k dimension cut into `splits` slices of `per_split` tiles. With more than
// one slice the blocks add fp32 partial sums into `partial` (allocated and zeroed here; the caller keeps
// it alive) and finish_split_sum adds the bias and writes `out`.
QuantGemmParams gemm_params(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight,
                            const at::Tensor& group_params, const std::optional<at::Tensor>& bias,
                            const PackedShape& shape, int64_t splits, int64_t per_split, at::Tensor& partial) {
  const int64_t m = x.size(0), n = shape.n;
  if (splits > 1) partial = at::zeros({m, n}, x.options().dtype(at::kFloat));
  QuantGemmParams p{};
  p.out = out.data_ptr();
  p.partial = splits > 1 ? partial.data_ptr<float>() : nullptr;
  p.x = x.data_ptr();
  set_packed_fields(p, weight, group_params, shape);
  p.bias = splits > 1 ? nullptr : (bias ? bias->data_ptr() : nullptr);
  p.out_stride = out.stride(0);
  p.x_stride = x.stride(0);
  p.m = static_cast<int>(m);
  p.n = static_cast<int>(n);
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

namespace {

// The one-row shape for a weight of `weight_rows` rows (2n with SWIGLU) of `chunks` 16-byte chunks: the
// best per Llama-3-8B projection on the H200 (benches/quantization.py table 1b, benches/RESULTS.md
// session 10 call 3): up to 32 MiB (qkv, o, down) 4 rows x 1 chunk per warp, k split over 2 warps,
// every step asked of L2, weights out of L1 (qkv 7.0 us against 8.9 for session 9's shape, o 5.1
// against 5.6, down 13.7 against 14.6); above (gate/up, many waves of blocks) session 9's shape (20.5
// us; prefetching every step there cost 24.8).
int64_t choose_one_row_shape(int64_t weight_rows, int64_t chunks) {
  constexpr int64_t kWholePrefetchMaxBytes = 32ll << 20;
  return weight_rows * chunks * 16 > kWholePrefetchMaxBytes ? 0 : 1;
}

// Launches the GEMV kernel of kind K, R rows, the given shape; ADD_NORM (never with swiglu): the add +
// RMSNorm epilogue.
template <int K, int R, int MATS, int UNROLL, int WARPS, int KSPLIT, int PREFETCH, bool NO_L1, bool ADD_NORM>
void launch_quant_gemv(const QuantGemvParams& p, bool swiglu, cudaStream_t stream) {
  constexpr int groups_per_block = WARPS / KSPLIT;
  constexpr int smem = quant_gemv_smem_bytes<R, MATS, WARPS, KSPLIT, ADD_NORM>();
  auto launch_with = [&](auto swiglu_c) {
    constexpr bool SWIGLU = decltype(swiglu_c)::value == 1;
    const int per_block = quant_gemv_features_per_block<SWIGLU, MATS, groups_per_block>();
    launch(quant_gemv_kernel<K, R, SWIGLU, MATS, UNROLL, WARPS, KSPLIT, PREFETCH, NO_L1, ADD_NORM>,
           (p.n + per_block - 1) / per_block, 32 * WARPS, smem, stream, p);
  };
  if constexpr (ADD_NORM)
    launch_with(std::integral_constant<int, 0>{});
  else
    dispatch_built<0, 1>(swiglu, "quant_gemv", "swiglu", launch_with);
}

// Most blocks any GEMV grid has for n features: every built shape covers at least this many a block.
constexpr int64_t kGemvMinFeaturesPerBlock = quant_gemv_features_per_block<false, kQuantGemvMats, kQuantGemvWarps>();

// Checks the GEMV's operands and fills its params, but for the outputs (the caller's).
QuantGemvParams gemv_params(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& group_params,
                            const std::optional<at::Tensor>& bias, const PackedShape& packed, int64_t n,
                            const char* op) {
  check_activation(x, packed.k, op, "x");
  const int64_t rows = x.size(0);
  TORCH_CHECK(rows >= 1 && rows <= 8, op, ": 1 to 8 rows, got ", num(rows));
  check_bias(bias, packed.n, op);
  QuantGemvParams p{};
  p.x = x.data_ptr();
  set_packed_fields(p, weight, group_params, packed);
  p.bias = bias ? bias->data_ptr() : nullptr;
  p.x_stride = x.stride(0);
  p.rows = static_cast<int>(rows);
  p.n = static_cast<int>(n);
  return p;
}

// Runs the GEMV of `p` (one-row shape `shape`, 0: the glue's choice), with the add + RMSNorm epilogue
// when ADD_NORM.
template <bool ADD_NORM>
void run_quant_gemv(const QuantGemvParams& p, const PackedShape& packed, int64_t kind, bool swiglu, int64_t shape,
                    const char* op) {
  const auto stream = at::cuda::getCurrentCUDAStream();
  dispatch_quant_kind(kind, op, [&](auto kind_c) {
    constexpr int K = decltype(kind_c)::value;
    if (p.rows == 1) {
      const int64_t chunks = packed.k / QuantTraits<K>::kChunk;
      const int64_t index = shape ? shape - 1 : choose_one_row_shape(packed.n, chunks);
      static_assert(kQuantGemvOneRowShapes == 2, "one value per built shape");
      dispatch_built<0, 1>(index, op, "one-row shape index", [&](auto index_c) {
        using S = QuantGemvOneRowShape<decltype(index_c)::value>;
        launch_quant_gemv<K, 1, S::kMats, S::kUnroll, S::kWarps, S::kSplit, S::kPrefetch, S::kNoL1, ADD_NORM>(
            p, swiglu, stream);
      });
      return;
    }
    dispatch_gemv_rows(p.rows, [&](auto rows_c) {
      constexpr int R = decltype(rows_c)::value;
      launch_quant_gemv<K, R, kQuantGemvMats, kQuantGemvUnroll, kQuantGemvWarps, 1, 1, false, ADD_NORM>(p, swiglu,
                                                                                                     stream);
    });
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void check_shape_arg(int64_t shape, int64_t rows, const char* op) {
  TORCH_CHECK(shape >= 0 && shape <= kQuantGemvOneRowShapes, op, ": shape ", num(shape), " is not built (0 = choose, 1 to ",
              num(kQuantGemvOneRowShapes), ")");
  TORCH_CHECK(shape == 0 || rows == 1, op, ": a shape is chosen for one row only, got ", num(rows), " rows");
}

}  // namespace

void quant_gemv(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& group_params,
                const std::optional<at::Tensor>& bias, int64_t kind, int64_t group_size, bool swiglu,
                int64_t shape) {
  const char* op = "quant_gemv";
  const PackedShape packed = check_packed(weight, group_params, kind, group_size, op);
  TORCH_CHECK(!swiglu || packed.n % 2 == 0, op, ": swiglu needs a [2n, k] gate/up weight");
  const int64_t n = swiglu ? packed.n / 2 : packed.n;
  QuantGemvParams p = gemv_params(x, weight, group_params, bias, packed, n, op);
  check_shape_arg(shape, p.rows, op);
  check_out(out, p.rows, n, op);
  p.out = out.data_ptr();
  p.out_stride = out.stride(0);
  const at::cuda::OptionalCUDAGuard guard(x.device());
  run_quant_gemv<false>(p, packed, kind, swiglu, shape, op);
}

void quant_gemv_add_rms_norm(at::Tensor& out, at::Tensor& residual_out, const at::Tensor& x, const at::Tensor& weight,
                             const at::Tensor& group_params, const std::optional<at::Tensor>& bias,
                             const at::Tensor& residual_in, const at::Tensor& norm_weight, double eps,
                             at::Tensor& arrivals, int64_t kind, int64_t group_size, int64_t shape) {
  const char* op = "quant_gemv_add_rms_norm";
  const PackedShape packed = check_packed(weight, group_params, kind, group_size, op);
  QuantGemvParams p = gemv_params(x, weight, group_params, bias, packed, packed.n, op);
  check_shape_arg(shape, p.rows, op);
  TORCH_CHECK(packed.n % 8 == 0, op, ": the norm takes 16-byte vectors: n = ", num(packed.n), " is not a multiple of 8");
  check_out(out, p.rows, packed.n, op);
  TORCH_CHECK(vec8_ok(out, packed.n), op, ": out rows must be 16-byte aligned");
  const auto check_residual = [&](const at::Tensor& t, const char* name) {
    check_cuda(t, name);
    TORCH_CHECK(t.scalar_type() == at::kHalf && t.dim() == 2 && t.size(0) == p.rows && t.size(1) == packed.n &&
                    t.is_contiguous() && vec8_ok(t, packed.n),
                op, ": ", name, " must be a contiguous, 16-byte aligned float16 [", num(p.rows), ", ", num(packed.n),
                "]");
  };
  check_residual(residual_in, "residual_in");
  check_residual(residual_out, "residual_out");
  TORCH_CHECK(!rows_overlap(residual_out, x), op, ": residual_out must not overlap x (other blocks still read x)");
  check_cuda(norm_weight, "norm_weight");
  TORCH_CHECK(norm_weight.scalar_type() == at::kHalf && norm_weight.dim() == 1 && norm_weight.size(0) == packed.n &&
                  norm_weight.is_contiguous() && reinterpret_cast<uintptr_t>(norm_weight.data_ptr()) % 16 == 0,
              op, ": norm_weight must be a contiguous, 16-byte aligned float16 [", num(packed.n), "]");
  check_cuda(arrivals, "arrivals");
  TORCH_CHECK(arrivals.scalar_type() == at::kInt && arrivals.numel() == 1, op,
              ": arrivals must be one int32 counter, zero between launches");
  const at::cuda::OptionalCUDAGuard guard(x.device());
  // Each block's sums of squares, per row: a slot for every block any shape's grid has.
  at::Tensor block_squares =
      at::empty({p.rows * ((packed.n + kGemvMinFeaturesPerBlock - 1) / kGemvMinFeaturesPerBlock)},
                x.options().dtype(at::kFloat));
  p.out = out.data_ptr();
  p.out_stride = out.stride(0);
  p.residual_in = residual_in.data_ptr();
  p.residual_out = residual_out.data_ptr();
  p.norm_weight = norm_weight.data_ptr();
  p.block_squares = block_squares.data_ptr<float>();
  p.arrivals = reinterpret_cast<unsigned*>(arrivals.data_ptr<int>());
  p.eps = static_cast<float>(eps);
  run_quant_gemv<true>(p, packed, kind, false, shape, op);
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
    dispatch_built<16, 64, 128>(block_m, op, "block_m", [&](auto bm_c) {
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

namespace stream_gemm {

// Weight fragments per warp when the caller leaves it to the op: one. H200, AWQ int4, Llama-3-8B
// projections (benches/RESULTS.md session 10, call 2): two were slower at 64 rows on qkv, o and down
// (43.8 / 36.3 / 60.0 us against 31.0 / 22.2 / 49.4) and no faster at 16 rows; only gate_up gained
// (93.8 against 109.1 us at 64 rows).
int64_t default_n_frags() { return 1; }

// Devices whose answers resident_blocks keeps (a device past them is asked every time).
constexpr int kCachedDevices = 64;

// Blocks of `kernel` (256 threads, `smem` bytes) resident per SM on the current device; `cache` is the
// kernel's own (zero = not asked yet), so the device is asked once per kernel.
template <typename Kernel>
int64_t resident_blocks(Kernel kernel, int smem, int (&cache)[kCachedDevices]) {
  const int device = at::cuda::current_device();
  if (device < kCachedDevices && cache[device] > 0) return cache[device];
  int blocks = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, 256, smem));
  blocks = std::max(blocks, 1);
  if (device < kCachedDevices) cache[device] = blocks;
  return blocks;
}

// A block's fixed cost (its ring filling, the x window, the epilogue) in units of the time it streams
// one k-chunk; and the fewest k-chunks a split covers.
constexpr int64_t kBlockFixedChunks = 4;
constexpr int64_t kMinChunksPerSplit = 4;

// The k split: the number of splits s minimising waves(s) * (chunks per split + the fixed cost), where
// waves(s) = ceil(base_blocks * s / slots) rounds up to whole waves of resident blocks. So the output's
// blocks fill the SMs without a short last wave, and each block streams enough to pay its fixed cost.
int64_t choose_splits(int64_t base_blocks, int64_t k_chunks, int64_t slots) {
  const int64_t most = std::max<int64_t>(1, k_chunks / kMinChunksPerSplit);
  int64_t best = 1, best_cost = -1;
  for (int64_t s = 1; s <= most; ++s) {
    const int64_t per_split = (k_chunks + s - 1) / s;
    const int64_t waves = (base_blocks * s + slots - 1) / slots;
    const int64_t cost = waves * (per_split + kBlockFixedChunks);
    if (best_cost < 0 || cost < best_cost) best = s, best_cost = cost;
  }
  return best;
}

// What the streaming GEMM checks of its arguments: x [m, k] and out [m, n] fp16, bias,
// the split counters, the shape knobs (0 = choose).
void check_stream_args(const at::Tensor& out, const at::Tensor& x, const std::optional<at::Tensor>& bias,
                       const at::Tensor& split_counters, int64_t k, int64_t n, int64_t m_frags, int64_t n_frags,
                       int64_t splits, const char* op) {
  check_activation(x, k, op, "x");
  TORCH_CHECK(x.size(0) >= 1, op, ": x has no rows");
  check_out(out, x.size(0), n, op);
  check_bias(bias, n, op);
  check_cuda(split_counters, "split_counters");
  TORCH_CHECK(split_counters.scalar_type() == at::kInt && split_counters.dim() == 1 && split_counters.is_contiguous(),
              op, ": split_counters must be a contiguous int32 vector");
  TORCH_CHECK(m_frags >= 0 && m_frags <= 4, op, ": m_frags ", num(m_frags), " is not built (0 = choose, 1 to 4)");
  TORCH_CHECK(n_frags >= 0 && n_frags <= 2, op, ": n_frags ", num(n_frags), " is not built (0 = choose, 1 or 2)");
  TORCH_CHECK(splits >= 0, op, ": splits must be >= 0 (0 = choose)");
}

// Launches the streaming GEMM (Tr: its QuantStreamTiles) with `params`, whose `s` (params itself)
// already holds the weight's fields (weight, group_params, k, num_groups, chunk_group_shift): fills in
// x, out, bias, m, n, the k split (for `kernel`'s residency on this device when splits == 0) and its
// workspace.
template <typename Tr, typename Params, typename Kernel>
void launch_stream_gemm(Kernel kernel, Params& params, QuantStreamParams& s, at::Tensor& out, const at::Tensor& x,
                        const std::optional<at::Tensor>& bias, at::Tensor& split_counters, int64_t splits,
                        int smem, const char* op) {
  const int64_t m = x.size(0), n = out.size(1), k_chunks = s.k / Tr::kBlockK;
  set_smem(kernel, smem);
  const int64_t row_blocks = (m + Tr::kXRows - 1) / Tr::kXRows;
  const int64_t feature_blocks = (n + Tr::kBlockFeatures - 1) / Tr::kBlockFeatures;
  const int64_t tiles = row_blocks * feature_blocks;
  if (splits == 0) {
    static int resident_cache[kCachedDevices] = {};  // this kernel's own
    const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
    splits = choose_splits(tiles, k_chunks, sms * resident_blocks(kernel, smem, resident_cache));
  }
  splits = std::min(splits, k_chunks);
  const int64_t per_split = (k_chunks + splits - 1) / splits;
  splits = (k_chunks + per_split - 1) / per_split;  // no empty split
  at::Tensor partial;
  if (splits > 1) {
    TORCH_CHECK(split_counters.numel() >= tiles, op, ": split_counters holds ", num(split_counters.numel()),
                " tile counters, this launch needs ", num(tiles));
    partial = at::empty({splits * tiles * Tr::kTileFloats}, x.options().dtype(at::kFloat));
  }
  s.out = out.data_ptr();
  s.partial = splits > 1 ? partial.data_ptr<float>() : nullptr;
  s.split_counters = splits > 1 ? reinterpret_cast<unsigned*>(split_counters.data_ptr<int>()) : nullptr;
  s.x = x.data_ptr();
  s.bias = bias ? bias->data_ptr() : nullptr;
  s.out_stride = out.stride(0);
  s.x_stride = x.stride(0);
  s.m = static_cast<int>(m);
  s.n = static_cast<int>(n);
  s.chunks_per_split = static_cast<int>(per_split);
  const dim3 grid(static_cast<unsigned>(row_blocks), static_cast<unsigned>(feature_blocks),
                  static_cast<unsigned>(splits));
  launch(kernel, grid, Tr::kThreads, smem, at::cuda::getCurrentCUDAStream(), params);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// The row fragments per block when the caller leaves it to the op: enough for the rows, at most 4.
int64_t default_m_frags(int64_t m) { return std::min<int64_t>(4, (m + 15) / 16); }

}  // namespace stream_gemm

void quant_gemm_stream(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& group_params,
                       const std::optional<at::Tensor>& bias, at::Tensor& split_counters, int64_t kind,
                       int64_t group_size, int64_t m_frags, int64_t n_frags, int64_t splits) {
  const char* op = "quant_gemm_stream";
  const PackedShape shape = check_packed(weight, group_params, kind, group_size, op);
  stream_gemm::check_stream_args(out, x, bias, split_counters, shape.k, shape.n, m_frags, n_frags, splits, op);
  const at::cuda::OptionalCUDAGuard guard(x.device());
  if (m_frags == 0) m_frags = stream_gemm::default_m_frags(x.size(0));
  if (n_frags == 0) n_frags = stream_gemm::default_n_frags();
  QuantStreamParams p{};
  set_packed_fields(p, weight, group_params, shape);
  dispatch_quant_kind(kind, op, [&](auto kind_c) {
    dispatch_built<1, 2, 3, 4>(m_frags, op, "m_frags", [&](auto mf_c) {
      dispatch_built<1, 2>(n_frags, op, "n_frags", [&](auto nf_c) {
        constexpr int K = decltype(kind_c)::value, MF = decltype(mf_c)::value, NF = decltype(nf_c)::value;
        using Tr = QuantStreamTraits<K, MF, NF>;
        stream_gemm::launch_stream_gemm<Tr>(quant_gemm_stream_kernel<K, MF, NF>, p, p, out, x, bias, split_counters,
                                            splits, Tr::kSmemBytes, op);
      });
    });
  });
}

void quant_gemm_mma(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& group_params,
                    const std::optional<at::Tensor>& bias, at::Tensor& split_counters, int64_t kind,
                    int64_t group_size, int64_t m_frags, int64_t splits, int64_t form) {
  const char* op = "quant_gemm_mma";
  const PackedShape shape = check_packed(weight, group_params, kind, group_size, op);
  TORCH_CHECK(kind == kQuantInt4, op, ": 4-bit weights only (kind 0), got kind ", num(kind));
  TORCH_CHECK(shape.k % QuantMmaTiles<1>::kBlockK == 0, op, ": in_features ", num(shape.k),
              " is not a multiple of ", num(QuantMmaTiles<1>::kBlockK));
  stream_gemm::check_stream_args(out, x, bias, split_counters, shape.k, shape.n, m_frags, 1, splits, op);
  const at::cuda::OptionalCUDAGuard guard(x.device());
  TORCH_CHECK(at::cuda::getCurrentDeviceProperties()->major >= 8, op,
              ": needs SM80 or newer (mma.sync m16n8k16); Volta runs quant_gemm_stream");
  TORCH_CHECK(form >= 0 && form <= 2, op, ": form ", num(form),
              " is not built (0 x through registers, 1 x by cp.async, 2 weights and x staged by cp.async)");
  QuantStreamParams p{};
  set_packed_fields(p, weight, group_params, shape);
  if (form == 2) {  // row fragments come in pairs: one per row half of the block's warps
    if (m_frags == 0) m_frags = x.size(0) <= 32 ? 2 : 4;
    TORCH_CHECK(m_frags == 2 || m_frags == 4, op, ": the staged form takes m_frags 2 or 4, got ", num(m_frags));
    dispatch_built<1, 2>(m_frags / 2, op, "m_frags / 2", [&](auto mfw_c) {
      constexpr int MFW = decltype(mfw_c)::value;
      using Tr = QuantMmaStagedTiles<MFW>;
      stream_gemm::launch_stream_gemm<Tr>(quant_gemm_mma_staged_kernel<MFW>, p, p, out, x, bias, split_counters,
                                          splits, Tr::kSmemBytes, op);
    });
    return;
  }
  if (m_frags == 0) m_frags = stream_gemm::default_m_frags(x.size(0));
  dispatch_built<1, 2, 3, 4>(m_frags, op, "m_frags", [&](auto mf_c) {
    dispatch_built<0, 1>(form, op, "form", [&](auto async_c) {
      constexpr int MF = decltype(mf_c)::value;
      constexpr bool ASYNC = decltype(async_c)::value == 1;
      using Tr = QuantMmaTiles<MF, ASYNC>;
      stream_gemm::launch_stream_gemm<Tr>(quant_gemm_mma_sm80_kernel<MF, ASYNC>, p, p, out, x, bias, split_counters,
                                          splits, Tr::kSmemBytes, op);
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
  set_packed_fields(p, weight, group_params, shape);
  p.n = static_cast<int>(shape.n);
  const auto stream = at::cuda::getCurrentCUDAStream();
  dispatch_quant_kind(kind, op, [&](auto kind_c) {
    constexpr int K = decltype(kind_c)::value;
    const int64_t chunks = shape.n * shape.k / QuantTraits<K>::kChunk;
    launch(quant_dequantize_kernel<K>, static_cast<unsigned>((chunks + 255) / 256), 256, 0, stream, p);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace voltllm
