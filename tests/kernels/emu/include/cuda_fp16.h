// Host stand-in for <cuda_fp16.h> used by the kernel emulator (tests/kernels/emu): only the types and
// conversions the kernel headers use, with IEEE round-to-nearest-even through the compiler's _Float16.
#pragma once

#include "cuda_emu_types.h"

struct __half {
  unsigned short bits;
};
struct __half2 {
  __half x, y;
};

inline __half __float2half_rn(float v) {
  _Float16 h = static_cast<_Float16>(v);
  __half r;
  __builtin_memcpy(&r.bits, &h, 2);
  return r;
}
inline float __half2float(__half v) {
  _Float16 h;
  __builtin_memcpy(&h, &v.bits, 2);
  return static_cast<float>(h);
}
inline float2 __half22float2(__half2 v) { return make_float2(__half2float(v.x), __half2float(v.y)); }
inline __half2 __floats2half2_rn(float a, float b) { return __half2{__float2half_rn(a), __float2half_rn(b)}; }
inline __half2 __float22half2_rn(float2 v) { return __floats2half2_rn(v.x, v.y); }

// half2 arithmetic (the quantized kernels): computed in fp32/fp64 and rounded once to fp16, as the
// hardware's HADD2/HMUL2/HFMA2 round.
inline __half2 __float2half2_rn(float v) { return __half2{__float2half_rn(v), __float2half_rn(v)}; }
inline __half __hfma_emu(__half a, __half b, __half c) {
  const double r = static_cast<double>(__half2float(a)) * __half2float(b) + __half2float(c);
  return __float2half_rn(static_cast<float>(r));
}
inline __half2 __hfma2(__half2 a, __half2 b, __half2 c) {
  return __half2{__hfma_emu(a.x, b.x, c.x), __hfma_emu(a.y, b.y, c.y)};
}
inline __half2 __hmul2(__half2 a, __half2 b) {
  return __half2{__float2half_rn(__half2float(a.x) * __half2float(b.x)),
                 __float2half_rn(__half2float(a.y) * __half2float(b.y))};
}
inline __half2 __hsub2(__half2 a, __half2 b) {
  return __half2{__float2half_rn(__half2float(a.x) - __half2float(b.x)),
                 __float2half_rn(__half2float(a.y) - __half2float(b.y))};
}
inline __half2 __hadd2(__half2 a, __half2 b) {
  return __half2{__float2half_rn(__half2float(a.x) + __half2float(b.x)),
                 __float2half_rn(__half2float(a.y) + __half2float(b.y))};
}
inline __half2 __hneg2(__half2 a) {
  a.x.bits ^= 0x8000u;
  a.y.bits ^= 0x8000u;
  return a;
}
inline float __low2float(__half2 a) { return __half2float(a.x); }
