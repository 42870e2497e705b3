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
