// Warp-level building blocks of the SM80+ attention kernels (the `_mma_sm80` ones): mma.sync m16n8k16
// with its documented fragment layouts, ldmatrix, cp.async and packing two floats into 16-bit halves.
//
// None of this exists on Volta. The _mma_sm80 kernels compile their bodies only where VOLTLLM_SM80_PATH
// is defined (device code for SM80 and newer); for sm_70 they compile to a trap and the Python layer runs
// the WMMA kernels there instead. VOLTLLM_EMULATE builds these helpers on the host against the CPU
// emulator in tests/kernels/emu, which runs the same kernel source under pytest.
#pragma once

#include "common.cuh"

#if defined(VOLTLLM_EMULATE) || (defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800)
#define VOLTLLM_SM80_PATH 1
#endif

namespace voltllm {
namespace sm80 {

#ifdef VOLTLLM_SM80_PATH

constexpr unsigned kFullMask = 0xffffffffu;

// D += A * B for one m16n8k16 tile, fp32 accumulation. Fragments (g = lane / 4, q = lane % 4; the lower
// 16 bits of a register hold the lower index):
//   a[0] = A[g][2q..2q+1]   a[1] = A[g+8][2q..2q+1]   a[2] = A[g][2q+8..2q+9]   a[3] = A[g+8][2q+8..2q+9]
//   b[0] = B[2q..2q+1][g]   b[1] = B[2q+8..2q+9][g]
//   d    = D[g][2q], D[g][2q+1], D[g+8][2q], D[g+8][2q+1]
template <typename T>
__device__ __forceinline__ void mma(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
#ifdef VOLTLLM_EMULATE
  ::emu::mma16816(d, a, b, is_same<T, __nv_bfloat16>::value);
#else
  if constexpr (is_same<T, __nv_bfloat16>::value) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
#endif
}

template <typename T>
__device__ __forceinline__ void mma(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
  const unsigned b[2] = {b0, b1};
  mma<T>(d, a, b);
}

#ifndef VOLTLLM_EMULATE
__device__ __forceinline__ unsigned smem_u32(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}
#endif

// Four 8x8 16-bit matrices from shared memory; lanes 8i..8i+7 give the 16-byte rows of matrix i.
// Lane L gets (row L/4, cols 2(L%4), 2(L%4)+1) of each matrix in r[i].
__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], const void* row) {
#ifdef VOLTLLM_EMULATE
  ::emu::ldmatrix<4>(r, row, false);
#else
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(row)));
#endif
}

// As ldmatrix_x4, transposed: lane L gets (rows 2(L%4), 2(L%4)+1; col L/4) of each matrix.
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], const void* row) {
#ifdef VOLTLLM_EMULATE
  ::emu::ldmatrix<4>(r, row, true);
#else
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(row)));
#endif
}

// 16 bytes global -> shared without passing through registers (bypassing L1).
__device__ __forceinline__ void cp_async16(void* smem_dst, const void* gmem_src) {
#ifdef VOLTLLM_EMULATE
  ::emu::cp_async16(smem_dst, gmem_src);
#else
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_u32(smem_dst)), "l"(gmem_src) : "memory");
#endif
}

__device__ __forceinline__ void cp_async_commit() {
#ifdef VOLTLLM_EMULATE
  ::emu::cp_async_commit();
#else
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

// Waits until at most N of this thread's committed cp.async groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
#ifdef VOLTLLM_EMULATE
  ::emu::cp_async_wait(N);
#else
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
#endif
}

// Two floats as one register of 16-bit values, `lo` in the lower half.
template <typename T>
__device__ __forceinline__ unsigned pack(float lo, float hi) {
  typename DType<T>::T2 v = DType<T>::from_float2(make_float2(lo, hi));
  return *reinterpret_cast<const unsigned*>(&v);
}

#endif  // VOLTLLM_SM80_PATH

}  // namespace sm80
}  // namespace voltllm
