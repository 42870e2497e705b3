// C entry points that run the weight-only quantized kernels (csrc/quantization/: the GEMV, the WMMA
// GEMM with its split-k finalize, the streaming GEMM, the SM80 register-dequantizing GEMM, the
// dequantize kernel) on the CPU emulator, for
// tests/kernels/test_quant_emulated.py (loaded with ctypes; pointers are CPU torch tensors).
#include "cuda_emu.h"
// The kernel headers come after the emulator, which stands in for the CUDA toolchain.
#include <type_traits>

#include "quantization/quant_gemm_mma_sm80.cuh"
#include "quantization/quant_gemm_stream.cuh"
#include "quantization/quant_gemm_wmma.cuh"
#include "quantization/quant_gemv.cuh"

namespace {

template <typename Fn>
void dispatch_kind(int kind, Fn&& fn) {
  switch (kind) {
    case 0: return fn(std::integral_constant<int, 0>{});
    case 1: return fn(std::integral_constant<int, 1>{});
    case 2: return fn(std::integral_constant<int, 2>{});
    default: emu::fail("quantized kind");
  }
}

template <typename Fn>
void dispatch_rows(int rows, Fn&& fn) {
  if (rows == 1) return fn(std::integral_constant<int, 1>{});
  if (rows == 2) return fn(std::integral_constant<int, 2>{});
  if (rows <= 4) return fn(std::integral_constant<int, 4>{});
  return fn(std::integral_constant<int, 8>{});
}

template <typename Fn>
void dispatch_block_m(int block_m, Fn&& fn) {
  switch (block_m) {
    case 16: return fn(std::integral_constant<int, 16>{});
    case 64: return fn(std::integral_constant<int, 64>{});
    case 128: return fn(std::integral_constant<int, 128>{});
    default: emu::fail("block_m");
  }
}

// The fields every quantized kernel's params name alike (QuantGemvParams, QuantStreamParams): the
// operands, their strides and the packed weight's shape.
template <typename Params>
Params packed_operand_params(void* out, const void* x, const void* weight, const void* group_params,
                             const void* bias, long long out_stride, long long x_stride, int n, int k,
                             int num_groups, int chunk_group_shift) {
  Params p{};
  p.out = out;
  p.x = x;
  p.weight = static_cast<const uint4*>(weight);
  p.group_params = static_cast<const unsigned*>(group_params);
  p.bias = bias;
  p.out_stride = out_stride;
  p.x_stride = x_stride;
  p.n = n;
  p.k = k;
  p.num_groups = num_groups;
  p.chunk_group_shift = chunk_group_shift;
  return p;
}

// The streaming and mma GEMMs' parameters, k cut into `splits` splits of whole `block_k`-column chunks
// (as the glue cuts it: no empty split, so `splits` may shrink).
voltllm::QuantStreamParams split_gemm_params(int block_k, int& splits, void* out, float* partial,
                                             unsigned* split_counters, const void* x, const void* weight,
                                             const void* group_params, const void* bias, long long out_stride,
                                             long long x_stride, int m, int n, int k, int num_groups,
                                             int chunk_group_shift) {
  const int chunks = k / block_k;
  const int per_split = (chunks + splits - 1) / splits;
  splits = (chunks + per_split - 1) / per_split;
  auto p = packed_operand_params<voltllm::QuantStreamParams>(out, x, weight, group_params, bias, out_stride,
                                                              x_stride, n, k, num_groups, chunk_group_shift);
  p.partial = partial;
  p.split_counters = split_counters;
  p.m = m;
  p.chunks_per_split = per_split;
  return p;
}

// The grid of a split GEMM with tiling Tr: row blocks, feature blocks, splits.
template <typename Tr>
dim3 split_gemm_grid(int m, int n, int splits) {
  return dim3((m + Tr::kXRows - 1) / Tr::kXRows, (n + Tr::kBlockFeatures - 1) / Tr::kBlockFeatures, splits);
}

// The GEMV's params but for the epilogue's fields.
voltllm::QuantGemvParams gemv_params(void* out, const void* x, const void* weight, const void* group_params,
                                     const void* bias, long long out_stride, long long x_stride, int rows, int n,
                                     int k, int num_groups, int chunk_group_shift) {
  auto p = packed_operand_params<voltllm::QuantGemvParams>(out, x, weight, group_params, bias, out_stride,
                                                            x_stride, n, k, num_groups, chunk_group_shift);
  p.rows = rows;
  return p;
}

enum GemvEpilogue { kPlain = 0, kSwiglu = 1, kAddNorm = 2 };

// Runs the GEMV of `p` with `epilogue`: for one row the built shape QuantGemvOneRowShape<shape>, else
// the default.
void run_gemv(const voltllm::QuantGemvParams& p, int kind, int epilogue, int shape, unsigned seed) {
  const auto run = [&](auto kind_c, auto rows_c, auto shape_c) {
    constexpr int K = decltype(kind_c)::value, R = decltype(rows_c)::value;
    using S = decltype(shape_c);
    constexpr int groups_per_block = S::kWarps / S::kSplit;
    const auto launch = [&](auto swiglu_c, auto add_norm_c) {
      constexpr bool SWIGLU = decltype(swiglu_c)::value, ADD_NORM = decltype(add_norm_c)::value;
      constexpr int smem = voltllm::quant_gemv_smem_bytes<R, S::kMats, S::kWarps, S::kSplit, ADD_NORM>();
      const int per_block = voltllm::quant_gemv_features_per_block<SWIGLU, S::kMats, groups_per_block>();
      emu::launch(dim3((p.n + per_block - 1) / per_block), dim3(32 * S::kWarps), smem, [&] {
        voltllm::quant_gemv_kernel<K, R, SWIGLU, S::kMats, S::kUnroll, S::kWarps, S::kSplit, S::kPrefetch, S::kNoL1,
                                   ADD_NORM>(p);
      }, seed);
    };
    using Off = std::false_type;
    using On = std::true_type;
    if (epilogue == kSwiglu) return launch(On{}, Off{});
    if (epilogue == kAddNorm) return launch(Off{}, On{});
    launch(Off{}, Off{});
  };
  using Default = voltllm::QuantGemvShapeOf<voltllm::kQuantGemvMats, voltllm::kQuantGemvUnroll,
                                            voltllm::kQuantGemvWarps, 1, 1, false>;
  dispatch_kind(kind, [&](auto kind_c) {
    if (p.rows > 1) return dispatch_rows(p.rows, [&](auto rows_c) { run(kind_c, rows_c, Default{}); });
    const std::integral_constant<int, 1> one{};
    static_assert(voltllm::kQuantGemvOneRowShapes == 2, "one case per built shape");
    switch (shape) {
      case 0: return run(kind_c, one, voltllm::QuantGemvOneRowShape<0>{});
      case 1: return run(kind_c, one, voltllm::QuantGemvOneRowShape<1>{});
      default: emu::fail("one-row GEMV shape");
    }
  });
}

}  // namespace

extern "C" {

// The GEMV at `rows` rows: for one row the built shape QuantGemvOneRowShape<shape>, else the default.
void emu_quant_gemv(int kind, void* out, const void* x, const void* weight, const void* group_params,
                    const void* bias, long long out_stride, long long x_stride, int rows, int n, int k,
                    int num_groups, int chunk_group_shift, int swiglu, int shape, unsigned seed) {
  const auto p = gemv_params(out, x, weight, group_params, bias, out_stride, x_stride, rows, n, k, num_groups,
                             chunk_group_shift);
  run_gemv(p, kind, swiglu ? kSwiglu : kPlain, shape, seed);
}

// The GEMV with its add + RMSNorm epilogue: out = rms_norm(residual_in + x @ W^T (+ bias)) * norm_weight,
// residual_out the sum. block_squares: rows * (blocks of the grid) floats; arrivals: one zeroed counter.
void emu_quant_gemv_add_norm(int kind, void* out, void* residual_out, const void* x, const void* weight,
                             const void* group_params, const void* bias, const void* residual_in,
                             const void* norm_weight, float eps, float* block_squares, unsigned* arrivals,
                             long long out_stride, long long x_stride, int rows, int n, int k, int num_groups,
                             int chunk_group_shift, int shape, unsigned seed) {
  auto p = gemv_params(out, x, weight, group_params, bias, out_stride, x_stride, rows, n, k, num_groups,
                       chunk_group_shift);
  p.residual_in = residual_in;
  p.residual_out = residual_out;
  p.norm_weight = norm_weight;
  p.eps = eps;
  p.block_squares = block_squares;
  p.arrivals = arrivals;
  run_gemv(p, kind, kAddNorm, shape, seed);
}

// `partial`: a zeroed fp32 [m, n] buffer, used (with the finalize kernel) when splits > 1.
void emu_quant_gemm(int kind, int block_m, int splits, void* out, float* partial, const void* x, const void* weight,
                    const void* group_params, const void* bias, long long out_stride, long long x_stride, int m,
                    int n, int k, int num_groups, int chunk_group_shift, unsigned seed) {
  const int k_tiles = k / 64;
  const int per_split = (k_tiles + splits - 1) / splits;
  splits = (k_tiles + per_split - 1) / per_split;
  voltllm::QuantGemmParams p{};
  p.out = out;
  p.partial = splits > 1 ? partial : nullptr;
  p.x = x;
  p.weight = static_cast<const uint4*>(weight);
  p.group_params = static_cast<const unsigned*>(group_params);
  p.bias = splits > 1 ? nullptr : bias;
  p.out_stride = out_stride;
  p.x_stride = x_stride;
  p.m = m;
  p.n = n;
  p.k = k;
  p.num_groups = num_groups;
  p.chunk_group_shift = chunk_group_shift;
  p.k_tiles_per_split = per_split;
  dispatch_kind(kind, [&](auto kind_c) {
    dispatch_block_m(block_m, [&](auto bm_c) {
      constexpr int K = decltype(kind_c)::value, BM = decltype(bm_c)::value;
      const dim3 grid((n + 127) / 128, (m + BM - 1) / BM, splits);
      emu::launch(grid, dim3(256), voltllm::quant_gemm_smem_bytes<K, BM>(),
                  [&] { voltllm::quant_gemm_wmma_kernel<K, BM>(p); }, seed);
    });
  });
  if (splits > 1) {
    voltllm::QuantGemmFinalizeParams f{};
    f.out = out;
    f.partial = partial;
    f.bias = bias;
    f.out_stride = out_stride;
    f.m = m;
    f.n = n;
    emu::launch(dim3(m), dim3(256), 0, [&] { voltllm::quant_gemm_finalize_kernel(f); }, seed);
  }
}

// The weight-streaming GEMM at one built shape (m_frags 1-4, n_frags 1-2) with `splits` splits of k;
// `partial` holds at least splits x tiles x the shape's tile floats (any contents), `split_counters`
// one zeroed int32 per tile (the kernel leaves them zero again).
void emu_quant_gemm_stream(int kind, int m_frags, int n_frags, int splits, void* out, float* partial,
                           unsigned* split_counters, const void* x, const void* weight, const void* group_params,
                           const void* bias, long long out_stride, long long x_stride, int m, int n, int k,
                           int num_groups, int chunk_group_shift, unsigned seed) {
  const voltllm::QuantStreamParams p = split_gemm_params(64, splits, out, partial, split_counters, x, weight,
                                                        group_params, bias, out_stride, x_stride, m, n, k, num_groups,
                                                        chunk_group_shift);
  auto run = [&](auto kind_c, auto mf_c, auto nf_c) {
    constexpr int K = decltype(kind_c)::value, MF = decltype(mf_c)::value, NF = decltype(nf_c)::value;
    using Tr = voltllm::QuantStreamTraits<K, MF, NF>;
    const dim3 grid = split_gemm_grid<Tr>(m, n, splits);
    emu::launch(grid, dim3(256), Tr::kSmemBytes, [&] { voltllm::quant_gemm_stream_kernel<K, MF, NF>(p); }, seed);
  };
  using I = std::integral_constant<int, 1>;
  using II = std::integral_constant<int, 2>;
  using III = std::integral_constant<int, 3>;
  using IV = std::integral_constant<int, 4>;
  dispatch_kind(kind, [&](auto kind_c) {
    if (m_frags == 1 && n_frags == 1) return run(kind_c, I{}, I{});
    if (m_frags == 1 && n_frags == 2) return run(kind_c, I{}, II{});
    if (m_frags == 2 && n_frags == 2) return run(kind_c, II{}, II{});
    if (m_frags == 3 && n_frags == 1) return run(kind_c, III{}, I{});
    if (m_frags == 4 && n_frags == 1) return run(kind_c, IV{}, I{});
    if (m_frags == 4 && n_frags == 2) return run(kind_c, IV{}, II{});
    emu::fail("stream shape");
  });
}

// Floats of one output tile of the streaming GEMM at (m_frags, n_frags): the harness caller sizes
// `partial` with it.
int emu_quant_gemm_stream_tile_floats(int m_frags, int n_frags) { return 16 * m_frags * 128 * n_frags; }

// The SM80 register-dequantizing 4-bit GEMM in `form` (0: x through registers, 1: x by cp.async, 2:
// weights and x staged by cp.async, m_frags 2 or 4) at m_frags with `splits` splits of k (k a multiple
// of 128); `partial` and `split_counters` as for emu_quant_gemm_stream.
void emu_quant_gemm_mma(int m_frags, int form, int splits, void* out, float* partial, unsigned* split_counters,
                        const void* x, const void* weight, const void* group_params, const void* bias,
                        long long out_stride, long long x_stride, int m, int n, int k, int num_groups,
                        int chunk_group_shift, unsigned seed) {
  const voltllm::QuantStreamParams p = split_gemm_params(128, splits, out, partial, split_counters, x, weight,
                                                        group_params, bias, out_stride, x_stride, m, n, k, num_groups,
                                                        chunk_group_shift);
  auto run = [&](auto mf_c, auto async_c) {
    constexpr int MF = decltype(mf_c)::value;
    constexpr bool ASYNC = decltype(async_c)::value;
    using Tr = voltllm::QuantMmaTiles<MF, ASYNC>;
    const dim3 grid = split_gemm_grid<Tr>(m, n, splits);
    emu::launch(grid, dim3(256), Tr::kSmemBytes, [&] { voltllm::quant_gemm_mma_sm80_kernel<MF, ASYNC>(p); }, seed);
  };
  auto with_mf = [&](auto async_c) {
    switch (m_frags) {
      case 1: return run(std::integral_constant<int, 1>{}, async_c);
      case 2: return run(std::integral_constant<int, 2>{}, async_c);
      case 3: return run(std::integral_constant<int, 3>{}, async_c);
      case 4: return run(std::integral_constant<int, 4>{}, async_c);
      default: emu::fail("mma m_frags");
    }
  };
  if (form == 2) {  // staged: m_frags 2 or 4, two row fragments' halves of the block's warps
    auto staged = [&](auto mfw_c) {
      constexpr int MFW = decltype(mfw_c)::value;
      using Tr = voltllm::QuantMmaStagedTiles<MFW>;
      const dim3 grid = split_gemm_grid<Tr>(m, n, splits);
      emu::launch(grid, dim3(256), Tr::kSmemBytes, [&] { voltllm::quant_gemm_mma_staged_kernel<MFW>(p); }, seed);
    };
    if (m_frags == 2) return staged(std::integral_constant<int, 1>{});
    if (m_frags == 4) return staged(std::integral_constant<int, 2>{});
    emu::fail("staged m_frags");
  }
  if (form == 1) return with_mf(std::true_type{});
  with_mf(std::false_type{});
}

// Floats of one output tile of the register-dequantizing GEMM at m_frags (the staged form: 128 features).
int emu_quant_gemm_mma_tile_floats(int m_frags, int form) { return 16 * m_frags * (form == 2 ? 128 : 256); }

void emu_quant_dequantize(int kind, void* out, const void* weight, const void* group_params, int n, int k,
                          int num_groups, int chunk_group_shift, unsigned seed) {
  voltllm::QuantDequantizeParams p{};
  p.out = out;
  p.weight = static_cast<const uint4*>(weight);
  p.group_params = static_cast<const unsigned*>(group_params);
  p.n = n;
  p.k = k;
  p.num_groups = num_groups;
  p.chunk_group_shift = chunk_group_shift;
  dispatch_kind(kind, [&](auto kind_c) {
    constexpr int K = decltype(kind_c)::value;
    const int chunks = n * k / voltllm::QuantTraits<K>::kChunk;
    emu::launch(dim3((chunks + 255) / 256), dim3(256), 0, [&] { voltllm::quant_dequantize_kernel<K>(p); }, seed);
  });
}

}  // extern "C"
