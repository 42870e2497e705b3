#!/usr/bin/env python3
"""Volta legality gate: every shipped kernel variant must compile for compute_70 and assemble for sm_70.

Runs on a CPU-only machine with the CUDA 12.9 compiler pieces from PyPI:

    pip install "nvidia-cuda-nvrtc-cu12==12.9.*" "nvidia-cuda-nvcc-cu12==12.9.*" \
        "nvidia-cuda-runtime-cu12==12.9.*"

For each kernel source in `csrc/` (attention/, ops/) it instantiates the variants listed in
`voltllm/ops/variants.py` through NVRTC name expressions, compiles to PTX for compute_70, rejects
instructions Volta lacks (cp.async, ldmatrix, wgmma, TMA/bulk copies, bf16 MMA), assembles the PTX with
`ptxas -arch=sm_70 -v` and prints registers, static and dynamic shared memory (the latter read from a
`__device__` constant each attention header emits), stack and spills per kernel. The SM80+ variants
(the bf16 WMMA decode and prefill, every `_mma_sm80` attention kernel) are checked the same way against
compute_80/sm_80, and every variant is also compiled for compute_90/sm_90 (what an H100/H200 build
runs), so that a GPU build cannot fail on code the CPU never compiled. Exit status is non-zero on any
compile error, forbidden instruction, sm_70 register spill, or shared memory over 96 KB on sm_70 / 99 KB
on sm_80+ (the smallest opt-in limit of SM80+ GPUs, sm_86/sm_89). Spills on sm_80/sm_90 are reported,
not fatal.

    python tools/sm70_gate.py              # sm_70, sm_80 and sm_90
    python tools/sm70_gate.py --arch 90    # one architecture
    python tools/sm70_gate.py --source quantization/quant_gemm_stream.cuh   # one kernel source
    python tools/sm70_gate.py --glue       # also syntax-check the torch glue (g++, minutes)

`--glue` checks what only the GPU machine's nvcc would otherwise see: the torch glue (`csrc/torch_glue/`:
`ops_*.cu`, `torch_bindings.cpp`) against the installed torch's headers, with g++ -fsyntax-only in host
mode. Kernel launches (`k<<<cfg>>>(args)`) are rewritten into calls that check the arguments against the
kernel's parameters, and a prelude declares the device built-ins the kernel headers use. It needs g++, a CUDA
build of torch and the CUDA headers of the nvidia-* wheels; it proves syntax and types, not codegen.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CSRC = REPO / "csrc"
GLUE = CSRC / "torch_glue"
VARIANTS = REPO / "python" / "voltllm" / "ops" / "variants.py"
VOLTA_SMEM_LIMIT = 96 * 1024
SM80_SMEM_LIMIT = 99 * 1024  # sm_86 / sm_89 opt-in maximum; sm_80 and sm_90 allow more
ARCHS = (70, 80, 90)


def smem_limit(arch: int) -> int:
    return VOLTA_SMEM_LIMIT if arch < 80 else SM80_SMEM_LIMIT


# PTX that Volta cannot run, with the reason printed when it shows up.
FORBIDDEN_PTX = {
    r"\bcp\.async\b": "cp.async (SM80+)",
    r"\bldmatrix\b": "ldmatrix (SM75+)",
    r"\bstmatrix\b": "stmatrix (SM90+)",
    r"\bwgmma\b": "wgmma (SM90+)",
    r"\bcp\.async\.bulk\b": "TMA bulk copy (SM90+)",
    r"\bmbarrier\b": "mbarrier (SM80+)",
    r"\b(w)?mma\.[^\n;]*\bbf16\b": "bf16 tensor-core math (SM80+)",
}


class GateError(RuntimeError):
    """The toolchain is missing or a kernel failed the gate."""


def _nvidia_dir(package: str) -> Path:
    spec = importlib.util.find_spec(f"nvidia.{package}")
    if spec is None or not spec.submodule_search_locations:
        raise GateError(
            f"nvidia.{package} is not installed; run: pip install 'nvidia-cuda-nvrtc-cu12==12.9.*' "
            "'nvidia-cuda-nvcc-cu12==12.9.*' 'nvidia-cuda-runtime-cu12==12.9.*'"
        )
    return Path(next(iter(spec.submodule_search_locations)))


@dataclass(frozen=True)
class Toolchain:
    nvrtc: ctypes.CDLL
    ptxas: Path
    includes: tuple[Path, ...]

    @classmethod
    def find(cls) -> Toolchain:
        nvrtc_lib = _nvidia_dir("cuda_nvrtc") / "lib" / "libnvrtc.so.12"
        ptxas = _nvidia_dir("cuda_nvcc") / "bin" / "ptxas"
        # The runtime package has cuda_fp16.h and mma.h; mma.h pulls crt/mma.h from the nvcc package.
        includes = (_nvidia_dir("cuda_runtime") / "include", _nvidia_dir("cuda_nvcc") / "include")
        for path in (nvrtc_lib, ptxas, includes[0] / "cuda_fp16.h", includes[1] / "crt" / "mma.h"):
            if not path.exists():
                raise GateError(f"incomplete CUDA 12.9 toolchain: {path} is missing")
        nvrtc = ctypes.CDLL(str(nvrtc_lib))
        nvrtc.nvrtcGetErrorString.restype = ctypes.c_char_p
        return cls(nvrtc=nvrtc, ptxas=ptxas, includes=includes)

    def _check(self, status: int, what: str) -> None:
        if status != 0:
            raise GateError(f"{what}: {self.nvrtc.nvrtcGetErrorString(status).decode()}")

    def compile_ptx(
        self, source_name: str, exprs: list[str], arch: int, probes: tuple[str, ...] = ()
    ) -> tuple[str, dict[str, str]]:
        """NVRTC-compiles `source_name` with `exprs` instantiated; returns (ptx, lowered names)."""
        lib = self.nvrtc
        prog = ctypes.c_void_p()
        src = f'#include "{source_name}"\n'.encode()
        self._check(
            lib.nvrtcCreateProgram(ctypes.byref(prog), src, source_name.encode() + b".cu", 0, None, None),
            "nvrtcCreateProgram",
        )
        try:
            for expr in (*exprs, *probes):
                self._check(lib.nvrtcAddNameExpression(prog, f"&{expr}".encode()), f"name expression {expr}")
            options = [
                f"--gpu-architecture=compute_{arch}",
                "--std=c++17",
                f"-I{CSRC}",
                *(f"-I{path}" for path in self.includes),
            ]
            argv = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
            status = lib.nvrtcCompileProgram(prog, len(options), argv)
            log_size = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(prog, ctypes.byref(log_size))
            log = ctypes.create_string_buffer(log_size.value)
            lib.nvrtcGetProgramLog(prog, log)
            if status != 0:
                raise GateError(f"{source_name} (compute_{arch}) failed to compile:\n{log.value.decode()}")
            ptx_size = ctypes.c_size_t()
            self._check(lib.nvrtcGetPTXSize(prog, ctypes.byref(ptx_size)), "nvrtcGetPTXSize")
            ptx = ctypes.create_string_buffer(ptx_size.value)
            self._check(lib.nvrtcGetPTX(prog, ptx), "nvrtcGetPTX")
            lowered: dict[str, str] = {}
            for expr in (*exprs, *probes):
                name = ctypes.c_char_p()
                self._check(lib.nvrtcGetLoweredName(prog, f"&{expr}".encode(), ctypes.byref(name)), expr)
                lowered[name.value.decode()] = expr
            return ptx.value.decode(), lowered
        finally:
            lib.nvrtcDestroyProgram(ctypes.byref(prog))

    def assemble(self, ptx: str, arch: int, workdir: Path, stem: str) -> str:
        """Runs ptxas -v on the PTX and returns its resource report."""
        ptx_path = workdir / f"{stem}.ptx"
        ptx_path.write_text(ptx)
        result = subprocess.run(
            [str(self.ptxas), f"-arch=sm_{arch}", "-v", "-o", str(workdir / f"{stem}.cubin"), str(ptx_path)],
            capture_output=True,
            text=True,
        )
        if result.returncode != 0:
            raise GateError(f"ptxas sm_{arch} rejected {stem}:\n{result.stderr}")
        return result.stderr


@dataclass
class KernelReport:
    expr: str
    registers: int = 0
    smem: int = 0
    stack: int = 0
    spill_stores: int = 0
    spill_loads: int = 0
    dynamic_smem: int = 0


def parse_ptxas(report: str, lowered: dict[str, str]) -> list[KernelReport]:
    """Turns `ptxas -v` output into one report per kernel, named by its C++ expression."""
    kernels: dict[str, KernelReport] = {}
    current: KernelReport | None = None
    for line in report.splitlines():
        if m := re.search(r"Compiling entry function '([^']+)'", line):
            current = kernels.setdefault(m.group(1), KernelReport(expr=lowered.get(m.group(1), m.group(1))))
        elif current is None:
            continue
        elif m := re.search(
            r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line
        ):
            current.stack, current.spill_stores, current.spill_loads = map(int, m.groups())
        elif m := re.search(r"Used (\d+) registers", line):
            current.registers = int(m.group(1))
            if s := re.search(r"(\d+) bytes smem", line):
                current.smem = int(s.group(1))
    missing = {
        name for name, expr in lowered.items() if name not in kernels and not expr.startswith("probe:")
    }
    if missing:
        raise GateError(f"ptxas reported no entry for: {sorted(lowered[n] for n in missing)}")
    return list(kernels.values())


def _variants_module():
    spec = importlib.util.spec_from_file_location("voltllm_variants", VARIANTS)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_variants() -> dict[int, dict[str, list[str]]]:
    """Architecture -> kernel source -> the name expressions checked for it."""
    module = _variants_module()
    sm80: dict[str, list[str]] = {}
    for part in (module.sm80_bf16_variants(), module.sm80_variants()):
        for source, exprs in part.items():
            sm80.setdefault(source, []).extend(exprs)
    return {70: module.sm70_variants(), 80: sm80, 90: module.sm90_variants()}


def check_source(
    tools: Toolchain, source: str, exprs: list[str], arch: int, workdir: Path, probes: dict[str, str]
) -> list[KernelReport]:
    wanted = {k: v for k, v in probes.items() if k in exprs}
    ptx, lowered = tools.compile_ptx(source, exprs, arch, tuple(sorted(set(wanted.values()))))
    if arch < 80:
        for pattern, what in FORBIDDEN_PTX.items():
            if re.search(pattern, ptx):
                raise GateError(f"{source}: PTX for compute_{arch} uses {what}")
    # Probe constants appear in the PTX as `.global .align 4 .u32 <name> = <bytes>;`.
    probe_value: dict[str, int] = {}
    for name, expr in list(lowered.items()):
        if expr in wanted.values():
            m = re.search(rf"\.u32 {re.escape(name)} = (\d+);", ptx)
            if m is None:
                raise GateError(f"{source}: no value for {expr} in the PTX")
            probe_value[expr] = int(m.group(1))
            lowered[name] = f"probe:{expr}"
    stem = f"{Path(source).stem}_sm{arch}"
    reports = parse_ptxas(tools.assemble(ptx, arch, workdir, stem), lowered)
    for r in reports:
        if r.expr in wanted:
            r.dynamic_smem = probe_value[wanted[r.expr]]
    return reports


def run_gate(
    keep: Path | None = None, archs: tuple[int, ...] = ARCHS, sources: tuple[str, ...] = ()
) -> list[tuple[int, KernelReport]]:
    """Checks every variant (of `sources` only, paths from csrc/, when given); returns (arch, report)
    pairs or raises GateError on the first failure."""
    tools = Toolchain.find()
    variants = load_variants()
    probes = _variants_module().dynamic_smem_probes()
    results: list[tuple[int, KernelReport]] = []
    with tempfile.TemporaryDirectory() as tmp:
        workdir = keep or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        for arch in archs:
            for source, exprs in variants[arch].items():
                if sources and source not in sources:
                    continue
                results.extend((arch, r) for r in check_source(tools, source, exprs, arch, workdir, probes))
    return results


# Host-mode stand-ins for what nvcc provides to device code, for the --glue syntax check.
GLUE_PRELUDE = r"""
#pragma once
#include <cuda_runtime.h>
#include <cmath>
#include <cstddef>
#include <utility>
#ifndef __launch_bounds__
#define __launch_bounds__(...)
#endif
extern const uint3 threadIdx;
extern const uint3 blockIdx;
extern const dim3 blockDim;
extern const dim3 gridDim;
void __syncthreads();
void __threadfence();
void __syncwarp(unsigned mask = 0xffffffffu);
template <class T> T __shfl_sync(unsigned, T, int, int = 32);
template <class T> T __shfl_xor_sync(unsigned, T, int, int = 32);
template <class T> T __shfl_up_sync(unsigned, T, unsigned, int = 32);
template <class T> T __shfl_down_sync(unsigned, T, unsigned, int = 32);
int __all_sync(unsigned, int);
int __any_sync(unsigned, int);
unsigned __ballot_sync(unsigned, int);
template <class T> T atomicAdd(T*, T);
[[noreturn]] void __trap();
float __int_as_float(int);
struct __half2;
__half2 __hfma2(__half2, __half2, __half2);
unsigned __byte_perm(unsigned, unsigned, unsigned);
float __uint_as_float(unsigned);
float atomicAdd(float*, float);
unsigned __float_as_uint(float);
float __uint2float_rn(unsigned);
int __popc(unsigned);
void __threadfence();
float rsqrtf(float);
float __expf(float);
float __fmul_rn(float, float);
float __fdividef(float, float);
template <class T> T __ldg(const T*);
size_t __cvta_generic_to_shared(const void*);
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
namespace nvcuda { namespace wmma {
struct matrix_a {}; struct matrix_b {}; struct accumulator {}; struct row_major {}; struct col_major {};
enum layout_t { mem_row_major, mem_col_major };
template <class Use, int M, int N, int K, class T, class L = void>
struct fragment { static constexpr int num_elements = 8; T x[16]; };
template <class F, class P> void load_matrix_sync(F&, const P*, unsigned);
template <class F, class P> void load_matrix_sync(F&, const P*, unsigned, layout_t);
template <class F, class P> void store_matrix_sync(P*, const F&, unsigned, layout_t);
template <class D, class A, class B, class C> void mma_sync(D&, const A&, const B&, const C&);
template <class F, class V> void fill_fragment(F&, const V&);
}}
template <class T> cudaError_t cudaFuncSetAttribute(T* entry, cudaFuncAttribute attr, int value);
template <class T> cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessor(int*, T, int, size_t);
template <class K> struct VoltllmLaunch {
  K k;
  template <class... A> void operator()(A&&... a) const {
    using R = decltype(k(std::forward<A>(a)...));
    (void)sizeof(R*);
  }
};
template <class K, class... C> VoltllmLaunch<K> voltllm_launch(K k, C&&...) { return {k}; }
"""
_LAUNCH = re.compile(r"(?P<kernel>[A-Za-z_][\w:]*(?:<[^<>;]*>)?)\s*<<<(?P<cfg>.*?)>>>\s*\(", re.S)


def glue_include_dirs() -> list[str]:
    """torch's include directories, then CUDA headers matching torch's CUDA major version."""
    import torch  # only the glue check needs torch
    from torch.utils.cpp_extension import include_paths

    roots = [Path(p) for p in importlib.util.find_spec("nvidia").submodule_search_locations]
    runtime = ["cu13/include"] if (torch.version.cuda or "").startswith("13") else []
    runtime += ["cuda_runtime/include", "cu13/include"]
    extra = ["cuda_nvcc/include", "cu13/include/cccl", "cuda_cccl/include"]
    found = [str(root / sub) for sub in (*runtime, *extra) for root in roots if (root / sub).is_dir()]
    return [*include_paths(), *dict.fromkeys(found)]


def check_glue(workdir: Path) -> list[str]:
    """g++ -fsyntax-only over every glue file; returns the failures (file and compiler output)."""
    if importlib.util.find_spec("torch") is None:
        raise GateError("--glue needs torch, with its CUDA headers")
    includes = glue_include_dirs()
    (workdir / "glue_prelude.h").write_text(GLUE_PRELUDE)
    failures = []
    for source in sorted([*GLUE.glob("ops_*.cu"), GLUE / "torch_bindings.cpp"]):
        text = _LAUNCH.sub(lambda m: f"voltllm_launch({m['kernel']}, {m['cfg']})(", source.read_text())
        host = workdir / f"{source.name}.cpp"
        host.write_text(f'#include "{workdir / "glue_prelude.h"}"\n{text}')
        cmd = ["g++", "-std=c++20", "-fsyntax-only", "-Wno-attributes", "-Wno-unknown-pragmas"]
        cmd += [*(f"-I{d}" for d in includes), f"-I{CSRC}", str(host)]
        result = subprocess.run(cmd, capture_output=True, text=True)
        print(f"glue {source.name}: {'ok' if result.returncode == 0 else 'FAILED'}")
        if result.returncode != 0:
            failures.append(f"{source.name}:\n{result.stderr[-4000:]}")
    return failures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", type=Path, help="write the PTX and cubins here")
    parser.add_argument(
        "--arch", type=int, action="append", choices=ARCHS, help="check only this architecture (repeatable)"
    )
    parser.add_argument("--glue", action="store_true", help="also g++-syntax-check the torch glue")
    parser.add_argument(
        "--source", action="append", default=[], help="check only this kernel source, from csrc/ (repeatable)"
    )
    args = parser.parse_args()
    try:
        if args.glue:
            with tempfile.TemporaryDirectory() as tmp:
                if glue_failures := check_glue(Path(tmp)):
                    print("glue check FAILED:\n" + "\n".join(glue_failures), file=sys.stderr)
                    return 1
        results = run_gate(args.keep, tuple(args.arch) if args.arch else ARCHS, tuple(args.source))
    except GateError as err:
        print(f"sm70 gate FAILED: {err}", file=sys.stderr)
        return 1
    failures = []
    print(f"{'arch':<6}{'kernel':<70}{'regs':>5}{'smem':>7}{'dyn smem':>9}{'stack':>6}{'spill st/ld':>13}")
    for arch, r in results:
        print(
            f"sm_{arch:<3}{r.expr:<70}{r.registers:>5}{r.smem:>7}{r.dynamic_smem:>9}{r.stack:>6}"
            f"{f'{r.spill_stores}/{r.spill_loads}':>13}"
        )
        if (r.spill_stores or r.spill_loads) and arch == 70:
            failures.append(f"{r.expr} (sm_{arch}) spills registers")
        if r.smem + r.dynamic_smem > smem_limit(arch):
            failures.append(f"{r.expr} (sm_{arch}) uses {r.smem + r.dynamic_smem} bytes of shared memory")
    if failures:
        print("sm70 gate FAILED:\n  " + "\n  ".join(failures), file=sys.stderr)
        return 1
    spilling = sorted({f"{r.expr} (sm_{arch})" for arch, r in results if r.spill_stores or r.spill_loads})
    if spilling:
        print("spills (not fatal above sm_70):\n  " + "\n  ".join(spilling))
    print(f"sm70 gate passed: {len(results)} kernels")
    return 0


if __name__ == "__main__":
    sys.exit(main())
