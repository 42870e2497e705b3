// Shared device helpers for the voltllm kernels: dtype traits, 16-byte vectors, warp reductions.
//
// Kernel sources include only CUDA headers (no torch/ATen/c10/pybind), so each one also compiles on
// its own with NVRTC for compute_70 (tools/sm70_gate.py does exactly that).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

// Dynamic shared memory of a kernel (the CPU emulator hands out a per-block buffer instead).
#ifdef VOLTLLM_EMULATE
#define VOLTLLM_DYNAMIC_SMEM(name) unsigned char* name = ::emu::dynamic_smem()
#else
#define VOLTLLM_DYNAMIC_SMEM(name) extern __shared__ __align__(128) unsigned char name[]
#endif

namespace voltllm {

// The KV cache block size every attention kernel is written for (tokens per paged block).
constexpr int kBlockSize = 16;

template <class A, class B>
struct is_same {
  static constexpr bool value = false;
};
template <class A>
struct is_same<A, A> {
  static constexpr bool value = true;
};

// Programmatic dependent launch (SM90+, where the glue's `launch` asks for it): a kernel may then be
// scheduled while the kernel before it in the stream is still running, so the launch latency between
// the hundreds of small kernels of a decode step overlaps work instead of idling the GPU. Every kernel
// calls begin_dependent_grid first: it waits until the previous kernel has finished and its writes are
// visible (so nothing below reads stale inputs or overwrites what that kernel still reads), then lets
// the next kernel be scheduled. Compiled out before SM90 (Volta runs plain stream order).
//
// One kernel uses the two halves apart: the decode split merge lets its dependent be scheduled at entry,
// then waits (every one of its blocks, so it never completes before the attention kernel it merges), so
// the next kernel is resident and issuing its early loads while attention's last blocks still run. Hence
// a kernel that starts has every kernel complete but the one just before it, or the two before it when
// that one is the split merge: reads before the wait must be of what neither wrote (the GEMVs prefetch
// weights; the decode attention kernel streams old K/V).
__device__ __forceinline__ void wait_for_previous_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void launch_dependent_grids() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

__device__ __forceinline__ void begin_dependent_grid() {
  wait_for_previous_grid();
  launch_dependent_grids();
}

// Brings the 128-byte line holding `ptr` into L2 (PTX prefetch, any GPU) without waiting for it or holding a register.
__device__ __forceinline__ void prefetch_l2(const void* ptr) {
#ifdef VOLTLLM_EMULATE
  (void)ptr;
#else
  asm volatile("prefetch.global.L2 [%0];" ::"l"(ptr));
#endif
}

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

// 2^x with one MUFU instruction (ex2.approx flushes denormals: softmax weights that small are 0
// anyway); 2^-inf = 0. exp2f without --use_fast_math adds range fix-ups around the same instruction.
// The CPU emulator, which has no PTX, uses exp2f.
__device__ __forceinline__ float fast_exp2(float x) {
#ifdef VOLTLLM_EMULATE
  return exp2f(x);
#else
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#endif
}

// Weight of a partial softmax (its running max `part_max`, log2 units) in a merge whose max is
// `merged_max`: 2^(part_max - merged_max), and 0 for a part that saw no tokens (part_max = -inf), where
// the difference would be NaN when every part is empty.
__device__ __forceinline__ float merge_weight(float part_max, float merged_max) {
  return part_max == neg_inf() ? 0.f : fast_exp2(part_max - merged_max);
}

// Per-dtype conversions. Arithmetic is always done in fp32; only loads and stores are 16-bit.
template <typename T>
struct DType;

template <>
struct DType<__half> {
  using T2 = __half2;
  static __device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
  static __device__ __forceinline__ __half from_float(float v) { return __float2half_rn(v); }
  static __device__ __forceinline__ float2 to_float2(__half2 v) { return __half22float2(v); }
  static __device__ __forceinline__ __half2 from_float2(float2 v) { return __float22half2_rn(v); }
};

template <>
struct DType<__nv_bfloat16> {
  using T2 = __nv_bfloat162;
  static __device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
  static __device__ __forceinline__ __nv_bfloat16 from_float(float v) { return __float2bfloat16_rn(v); }
  static __device__ __forceinline__ float2 to_float2(__nv_bfloat162 v) { return __bfloat1622float2(v); }
  static __device__ __forceinline__ __nv_bfloat162 from_float2(float2 v) {
    return __floats2bfloat162_rn(v.x, v.y);
  }
};

// Eight 16-bit elements moved as one 16-byte access (ld.global.v4.u32).
template <typename T>
union Vec8 {
  uint4 raw;
  typename DType<T>::T2 pair[4];
};

template <typename T>
__device__ __forceinline__ void load_floats(const T* ptr, float (&v)[8]) {
  Vec8<T> vec;
  vec.raw = *reinterpret_cast<const uint4*>(ptr);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float2 f = DType<T>::to_float2(vec.pair[i]);
    v[2 * i] = f.x;
    v[2 * i + 1] = f.y;
  }
}

template <typename T>
__device__ __forceinline__ void store_floats(T* ptr, const float (&v)[8]) {
  Vec8<T> vec;
#pragma unroll
  for (int i = 0; i < 4; ++i) vec.pair[i] = DType<T>::from_float2(make_float2(v[2 * i], v[2 * i + 1]));
  *reinterpret_cast<uint4*>(ptr) = vec.raw;
}

// Eight elements of the fused residual add: x + res rounded to T (returned as 16 bytes, to be stored),
// and the squares of the rounded sums added to `sq` in element order. fused_add_rms_norm_kernel
// (rms_norm.cuh) and the GEMV's norm prologue (gemv.cuh) both use it, so their statistics agree bit for
// bit.
template <typename T>
__device__ __forceinline__ uint4 add_rounded_and_square(const T* x, const T* res, float& sq) {
  float a[8], b[8];
  load_floats(x, a);
  load_floats(res, b);
  Vec8<T> sum;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    sum.pair[j] = DType<T>::from_float2(make_float2(a[2 * j] + b[2 * j], a[2 * j + 1] + b[2 * j + 1]));
    const float2 r = DType<T>::to_float2(sum.pair[j]);
    sq += r.x * r.x + r.y * r.y;
  }
  return sum.raw;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Sum over the whole thread block; `scratch` holds one float per warp. Every thread gets the result.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int num_warps = (blockDim.x + 31) >> 5;
  v = warp_sum(v);
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float total = 0.f;
  for (int w = 0; w < num_warps; ++w) total += scratch[w];
  __syncthreads();  // scratch may be reused right after
  return total;
}

}  // namespace voltllm
