// Host stand-in for <cuda_bf16.h> used by the kernel emulator: bf16 as the upper half of an fp32,
// rounded to nearest even (NaN stays NaN).
#pragma once

#include <cstring>

#include "cuda_emu_types.h"

struct __nv_bfloat16 {
  unsigned short bits;
};
struct __nv_bfloat162 {
  __nv_bfloat16 x, y;
};

inline __nv_bfloat16 __float2bfloat16_rn(float v) {
  unsigned u;
  std::memcpy(&u, &v, 4);
  __nv_bfloat16 r;
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    r.bits = static_cast<unsigned short>((u >> 16) | 0x40u);  // quiet NaN
  } else {
    r.bits = static_cast<unsigned short>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  }
  return r;
}
inline float __bfloat162float(__nv_bfloat16 v) {
  const unsigned u = static_cast<unsigned>(v.bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline float2 __bfloat1622float2(__nv_bfloat162 v) {
  return make_float2(__bfloat162float(v.x), __bfloat162float(v.y));
}
inline __nv_bfloat162 __floats2bfloat162_rn(float a, float b) {
  return __nv_bfloat162{__float2bfloat16_rn(a), __float2bfloat16_rn(b)};
}
inline __nv_bfloat162 __float22bfloat162_rn(float2 v) { return __floats2bfloat162_rn(v.x, v.y); }
