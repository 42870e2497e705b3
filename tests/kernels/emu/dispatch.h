// What the emulator harnesses (harness.cpp, decode_ops_harness.cpp) share: turning the run-time dtype
// flag and head size their C entry points take into the template arguments of the kernels they launch.
#pragma once

#include <type_traits>

#include "cuda_bf16.h"
#include "cuda_emu.h"
#include "cuda_fp16.h"

namespace emu {

// fn(T{}) with T = __nv_bfloat16 when `bf16` is set, else __half.
template <typename Fn>
void dispatch_dtype(int bf16, Fn&& fn) {
  if (bf16) {
    fn(__nv_bfloat16{});
  } else {
    fn(__half{});
  }
}

// fn(std::integral_constant<int, HEAD>{}) for the head sizes the kernels are built for.
template <typename Fn>
void dispatch_head(int head, Fn&& fn) {
  switch (head) {
    case 64: return fn(std::integral_constant<int, 64>{});
    case 128: return fn(std::integral_constant<int, 128>{});
    case 256: return fn(std::integral_constant<int, 256>{});
    default: fail("head size");
  }
}

}  // namespace emu
