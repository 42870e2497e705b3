// C entry points that run the weight-only quantized kernels (csrc/quantization/: the GEMV, the WMMA
// GEMM with its split-k finalize, the dequantize kernel) on the CPU emulator, for
// tests/kernels/test_quant_emulated.py (loaded with ctypes; pointers are CPU torch tensors).
#include "cuda_emu.h"
// The kernel headers come after the emulator, which stands in for the CUDA toolchain.
#include <type_traits>

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

}  // namespace

extern "C" {

void emu_quant_gemv(int kind, void* out, const void* x, const void* weight, const void* group_params,
                    const void* bias, long long out_stride, long long x_stride, int rows, int n, int k,
                    int num_groups, int chunk_group_shift, int swiglu, unsigned seed) {
  voltllm::QuantGemvParams p{};
  p.out = out;
  p.x = x;
  p.weight = static_cast<const uint4*>(weight);
  p.group_params = static_cast<const unsigned*>(group_params);
  p.bias = bias;
  p.out_stride = out_stride;
  p.x_stride = x_stride;
  p.rows = rows;
  p.n = n;
  p.k = k;
  p.num_groups = num_groups;
  p.chunk_group_shift = chunk_group_shift;
  dispatch_kind(kind, [&](auto kind_c) {
    dispatch_rows(rows, [&](auto rows_c) {
      constexpr int K = decltype(kind_c)::value, R = decltype(rows_c)::value;
      if (swiglu) {
        const int per_block = voltllm::quant_gemv_features_per_block<true>();
        emu::launch(dim3((n + per_block - 1) / per_block), dim3(32 * voltllm::kQuantGemvWarps), 0,
                    [&] { voltllm::quant_gemv_kernel<K, R, true>(p); }, seed);
      } else {
        const int per_block = voltllm::quant_gemv_features_per_block<false>();
        emu::launch(dim3((n + per_block - 1) / per_block), dim3(32 * voltllm::kQuantGemvWarps), 0,
                    [&] { voltllm::quant_gemv_kernel<K, R, false>(p); }, seed);
      }
    });
  });
}

// The persistent GEMV (4 rows per warp, 2 chunks in flight per row, 8 warps) on `blocks` blocks.
void emu_quant_gemv_persistent(int kind, void* out, const void* x, const void* weight, const void* group_params,
                               const void* bias, long long out_stride, long long x_stride, int rows, int n, int k,
                               int num_groups, int chunk_group_shift, int swiglu, int blocks, unsigned seed) {
  voltllm::QuantGemvParams p{};
  p.out = out;
  p.x = x;
  p.weight = static_cast<const uint4*>(weight);
  p.group_params = static_cast<const unsigned*>(group_params);
  p.bias = bias;
  p.out_stride = out_stride;
  p.x_stride = x_stride;
  p.rows = rows;
  p.n = n;
  p.k = k;
  p.num_groups = num_groups;
  p.chunk_group_shift = chunk_group_shift;
  dispatch_kind(kind, [&](auto kind_c) {
    dispatch_rows(rows, [&](auto rows_c) {
      constexpr int K = decltype(kind_c)::value, R = decltype(rows_c)::value;
      if (swiglu) {
        emu::launch(dim3(blocks), dim3(256), 0, [&] { voltllm::quant_gemv_persistent_kernel<K, R, true, 4, 2, 8>(p); },
                    seed);
      } else {
        emu::launch(dim3(blocks), dim3(256), 0,
                    [&] { voltllm::quant_gemv_persistent_kernel<K, R, false, 4, 2, 8>(p); }, seed);
      }
    });
  });
}

// The norm-prologue GEMV (one row, the persistent shape 4 x 2 x 8 warps) on `blocks` blocks.
void emu_quant_add_rms_norm_gemv(int kind, void* out, void* residual_out, const void* hidden, const void* residual,
                                 const void* norm_weight, float eps, const void* weight, const void* group_params,
                                 const void* bias, int n, int k, int num_groups, int chunk_group_shift, int swiglu,
                                 int blocks, unsigned seed) {
  voltllm::QuantGemvNormParams p{};
  p.gemv.out = out;
  p.gemv.weight = static_cast<const uint4*>(weight);
  p.gemv.group_params = static_cast<const unsigned*>(group_params);
  p.gemv.bias = bias;
  p.gemv.out_stride = n;
  p.gemv.rows = 1;
  p.gemv.n = n;
  p.gemv.k = k;
  p.gemv.num_groups = num_groups;
  p.gemv.chunk_group_shift = chunk_group_shift;
  p.norm.residual_out = residual_out;
  p.norm.hidden = hidden;
  p.norm.residual_in = residual;
  p.norm.norm_weight = norm_weight;
  p.norm.residual_out_stride = k;
  p.norm.hidden_stride = k;
  p.norm.residual_in_stride = k;
  p.norm.eps = eps;
  p.norm.rows = 1;
  p.norm.n = n;
  p.norm.k = k;
  const int smem = voltllm::quant_gemv_norm_smem_bytes(k);
  dispatch_kind(kind, [&](auto kind_c) {
    constexpr int K = decltype(kind_c)::value;
    if (swiglu) {
      emu::launch(dim3(blocks), dim3(256), smem, [&] { voltllm::quant_gemv_norm_kernel<K, true, 4, 2, 8>(p); }, seed);
    } else {
      emu::launch(dim3(blocks), dim3(256), smem, [&] { voltllm::quant_gemv_norm_kernel<K, false, 4, 2, 8>(p); },
                  seed);
    }
  });
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

// The weight-streaming GEMM at one built shape (m_frags, n_frags, depth); `partial` as for
// emu_quant_gemm.
void emu_quant_gemm_stream(int kind, int m_frags, int n_frags, int depth, int splits, void* out, float* partial,
                           const void* x, const void* weight, const void* group_params, const void* bias,
                           long long out_stride, long long x_stride, int m, int n, int k, int num_groups,
                           int chunk_group_shift, unsigned seed) {
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
  auto run = [&](auto kind_c, auto mf_c, auto nf_c, auto depth_c) {
    constexpr int K = decltype(kind_c)::value, MF = decltype(mf_c)::value, NF = decltype(nf_c)::value,
                  D = decltype(depth_c)::value;
    const int features = 8 * 16 * NF;
    const dim3 grid((n + features - 1) / features, (m + 16 * MF - 1) / (16 * MF), splits);
    emu::launch(grid, dim3(256), voltllm::quant_gemm_stream_smem_bytes<K, MF, NF, D>(per_split),
                [&] { voltllm::quant_gemm_stream_kernel<K, MF, NF, D>(p); }, seed);
  };
  using I = std::integral_constant<int, 1>;
  using II = std::integral_constant<int, 2>;
  using IV = std::integral_constant<int, 4>;
  dispatch_kind(kind, [&](auto kind_c) {
    if (m_frags == 1 && n_frags == 1 && depth == 4) return run(kind_c, I{}, I{}, IV{});
    if (m_frags == 2 && n_frags == 2 && depth == 2) return run(kind_c, II{}, II{}, II{});
    if (m_frags == 4 && n_frags == 1 && depth == 2) return run(kind_c, IV{}, I{}, II{});
    emu::fail("stream shape");
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
