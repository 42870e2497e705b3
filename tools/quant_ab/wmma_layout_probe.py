"""Prints where WMMA m16n16k16 fp16 operand fragments put each matrix element on this GPU: for every lane,
the (row, column) of `x[i]` of a `matrix_a` (row-major) and of a `matrix_b` (column-major) fragment,
and whether elements repeat within a lane or across lanes.

WMMA leaves this layout unspecified; a GEMM that dequantizes weights straight into operand registers
(docs/quantization.md, "What the H200 said", session 10) needs it, probed on the device, to repack the
packed codes into fragment order at load. The probe kernel is compiled by nvcc to a cubin and launched
through the CUDA driver API (no extension build).

    python tools/quant_ab/wmma_layout_probe.py
"""

from __future__ import annotations

import ctypes
import subprocess
import tempfile
from collections import Counter
from pathlib import Path

import torch

SOURCE = r"""
#include <cuda_fp16.h>
#include <mma.h>
using namespace nvcuda;
// m[v] = v for v < 256: element (r, c) of matrix_a (row-major, ld 16) reads m[16 r + c], element (k, n)
// of matrix_b (column-major, ld 16) reads m[16 n + k]. out[lane][0..15] = a.x, out[lane][16..31] = b.x.
extern "C" __global__ void probe(const __half* m, float* out) {
  wmma::fragment<wmma::matrix_a, 16, 16, 16, __half, wmma::row_major> a;
  wmma::fragment<wmma::matrix_b, 16, 16, 16, __half, wmma::col_major> b;
  wmma::load_matrix_sync(a, m, 16);
  wmma::load_matrix_sync(b, m, 16);
  const int lane = threadIdx.x;
  for (int i = 0; i < 32; ++i) out[lane * 32 + i] = -1.f;
  for (int i = 0; i < a.num_elements; ++i) out[lane * 32 + i] = __half2float(a.x[i]);
  for (int i = 0; i < b.num_elements; ++i) out[lane * 32 + 16 + i] = __half2float(b.x[i]);
}
"""


def _check(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"{what}: CUDA driver error {status}")


def probe() -> torch.Tensor:
    """[32 lanes, 32] floats: a.x then b.x of each lane (-1 past num_elements)."""
    from torch.utils.cpp_extension import CUDA_HOME

    major, minor = torch.cuda.get_device_capability()
    nvcc = Path(CUDA_HOME or "/usr/local/cuda") / "bin" / "nvcc"
    m = torch.arange(256, dtype=torch.float16, device="cuda")
    out = torch.empty(32, 32, dtype=torch.float32, device="cuda")
    with tempfile.TemporaryDirectory() as tmp:
        src, cubin = Path(tmp) / "probe.cu", Path(tmp) / "probe.cubin"
        src.write_text(SOURCE)
        subprocess.run(
            [str(nvcc), "-cubin", f"-arch=sm_{major}{minor}", "-o", str(cubin), str(src)], check=True
        )
        image = cubin.read_bytes()
    cuda = ctypes.CDLL("libcuda.so.1")
    module, fn = ctypes.c_void_p(), ctypes.c_void_p()
    _check(cuda.cuModuleLoadData(ctypes.byref(module), image), "cuModuleLoadData")
    _check(cuda.cuModuleGetFunction(ctypes.byref(fn), module, b"probe"), "cuModuleGetFunction")
    pointers = [ctypes.c_void_p(m.data_ptr()), ctypes.c_void_p(out.data_ptr())]
    args = (ctypes.c_void_p * 2)(*(ctypes.cast(ctypes.pointer(p), ctypes.c_void_p) for p in pointers))
    stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
    _check(cuda.cuLaunchKernel(fn, 1, 1, 1, 32, 1, 1, 0, stream, args, None), "cuLaunchKernel")
    torch.cuda.synchronize()
    return out.cpu()


def describe(values: torch.Tensor, name: str, position) -> None:
    """One operand: each lane's elements as positions, then the repetition counts."""
    held = [[int(v) for v in row if v >= 0] for row in values.tolist()]
    print(f"### {name}: {len(held[0])} elements per lane")
    for lane in (0, 1, 2, 3, 4, 8, 31):
        print(f"lane {lane:2}: " + " ".join(position(v) for v in held[lane]))
    per_lane = [len(set(h)) for h in held]
    copies = Counter(v for h in held for v in h)
    print(
        f"distinct per lane {min(per_lane)}-{max(per_lane)}; elements held {len(copies)} of 256, "
        f"copies each {min(copies.values())}-{max(copies.values())}"
    )
    same_half = all(h[i] == h[i + len(h) // 2] for h in held for i in range(len(h) // 2))
    print(f"x[i] == x[i + {len(held[0]) // 2}] in every lane: {same_half}")


def main() -> None:
    print(f"GPU: {torch.cuda.get_device_name()} (sm_{''.join(map(str, torch.cuda.get_device_capability()))})")
    out = probe()
    describe(out[:, :16], "matrix_a row_major (row,col)", lambda v: f"{v // 16},{v % 16}")
    describe(out[:, 16:], "matrix_b col_major (k,n)", lambda v: f"{v % 16},{v // 16}")


if __name__ == "__main__":
    main()
