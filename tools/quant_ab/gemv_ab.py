"""Times quantized GEMV kernel variants side by side in one process on a GPU, on the Llama-3-8B
projections: the current header's kernel at several shapes (weight rows per warp, chunks in flight,
warps per block, k split, L2 prefetch before the wait, loads without L1; INT4_VARIANTS), session 8's
kernel (`s8`: the headers of commit BASELINE_REV, taken with `git archive`, or from `--baseline-src` on a
machine with no git checkout; left out when not asked for), the extension's built
one-row shapes (`ext1`.., `quant_gemv(..., shape=i)`) and its own choice (`ext`), and a read-only
ceiling (`read`: the same bytes loaded and folded, no arithmetic) with the cost of an empty kernel.

Each variant is compiled by nvcc to a cubin (no torch extension build) and launched through the CUDA
driver API on torch's stream as a programmatic dependent launch (as the glue launches), inside CUDA
graphs over weight copies larger than L2 (benches/quantization.py's timing). Every variant's output is
checked against the dequantize + fp32 product first. One table row per variant.

    python tools/quant_ab/gemv_ab.py [--rows 1,2,4] [--kinds 0] [--variants 4x2w4,4x2w8k2pAn]
    # session 8's kernel where the tree has no .git (the GPU machine): make the baseline beforehand
    git archive d6c86fd csrc/quantization | tar -x -C .carry/quant_base
    python tools/quant_ab/gemv_ab.py --variants s8,4x2w4 --baseline-src .carry/quant_base/csrc
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benches"))
from graph_timing import graph_time_us as time_us  # noqa: E402
from quantization import LLAMA_SHAPES, packed_copies  # noqa: E402

from voltllm.ops import quantized_linear as ql  # noqa: E402

# (label, MATS, UNROLL, WARPS, KSPLIT, PREFETCH, NO_L1); MATS None = session 8's kernel; else
# quant_gemv_kernel with KSPLIT warps per row group, PREFETCH steps asked of L2 before the wait (ALL =
# every step), NO_L1 weights loaded without allocating in L1. Labels: rows x chunks w warps, kS the
# split, pA / p2 the prefetch, n NO_L1. The extension's built one-row shapes are timed too (ext1..:
# `quant_gemv(..., shape=i)`; ext: the glue's choice).
ALL = 1 << 16  # quant_gemv.cuh kQuantGemvPrefetchAll
INT4_VARIANTS = [
    ("s8", None, 0, 0, 1, 1, False),
    ("4x2w4", 4, 2, 4, 1, 1, False),
    ("4x2w4n", 4, 2, 4, 1, 1, True),
    ("4x2w4pA", 4, 2, 4, 1, ALL, False),
    ("4x2w4pAn", 4, 2, 4, 1, ALL, True),
    ("4x2w4p2n", 4, 2, 4, 1, 2, True),
    ("4x2w8k2pA", 4, 2, 8, 2, ALL, False),
    ("4x2w8k2pAn", 4, 2, 8, 2, ALL, True),
    ("4x2w8k4pAn", 4, 2, 8, 4, ALL, True),
    ("4x1w8k2pAn", 4, 1, 8, 2, ALL, True),
    ("2x2w8k2pAn", 2, 2, 8, 2, ALL, True),
    ("2x4w4pAn", 2, 4, 4, 1, ALL, True),
    ("4x4w4pAn", 4, 4, 4, 1, ALL, True),
    ("8x1w4pAn", 8, 1, 4, 1, ALL, True),
]
FORMAT_OF_KIND = {0: "AWQ int4 g128", 1: "int8 channel", 2: "fp8 block 128"}


class Params(ctypes.Structure):
    """csrc/quantization/quant_gemv.cuh QuantGemvParams."""

    _fields_ = [
        ("out", ctypes.c_void_p),
        ("x", ctypes.c_void_p),
        ("weight", ctypes.c_void_p),
        ("group_params", ctypes.c_void_p),
        ("bias", ctypes.c_void_p),
        ("out_stride", ctypes.c_longlong),
        ("x_stride", ctypes.c_longlong),
        ("rows", ctypes.c_int),
        ("n", ctypes.c_int),
        ("k", ctypes.c_int),
        ("num_groups", ctypes.c_int),
        ("chunk_group_shift", ctypes.c_int),
    ]


def _shape_args(shape: tuple[int, ...]) -> list[tuple[str, int]]:
    """(mangling letter, value) of a shape's template arguments: ints, the last (NO_L1) a bool."""
    return [("b" if i == 5 else "i", v) for i, v in enumerate(shape)]


def mangled(kind: int, rows: int, swiglu: bool, shape: tuple[int, ...] | None) -> str:
    args = f"Li{kind}ELi{rows}ELb{int(swiglu)}E"
    if shape is not None:
        args += "".join(f"L{t}{v}E" for t, v in _shape_args(shape))
    name = "quant_gemv_kernel"
    return f"_ZN7voltllm{len(name)}{name}I{args}EEvNS_15QuantGemvParamsE"


def explicit(kind: int, rows: int, swiglu: bool, shape: tuple[int, ...] | None) -> str:
    args = f"{kind}, {rows}, {'true' if swiglu else 'false'}"
    if shape is not None:
        values = [("true" if v else "false") if t == "b" else str(v) for t, v in _shape_args(shape)]
        args += ", " + ", ".join(values)
    return f"template __global__ void voltllm::quant_gemv_kernel<{args}>(voltllm::QuantGemvParams);\n"


@dataclasses.dataclass
class Variant:
    label: str
    kind: int
    rows: int
    swiglu: bool
    shape: tuple[int, ...] | None  # (MATS, UNROLL, WARPS, KSPLIT, PREFETCH, NO_L1); None: session 8's

    @property
    def name(self) -> str:
        return mangled(self.kind, self.rows, self.swiglu, self.shape)

    @property
    def _dims(self) -> tuple[int, int, int, int]:
        """(MATS, WARPS, KSPLIT, rows of x the kernel sums) with session 8's defaults."""
        if self.shape is None:
            return 2, 4, 1, self.rows
        mats, _, warps, split, *_ = self.shape
        return mats, warps, split, self.rows

    def grid(self, n: int) -> int:
        return (n + self.features_per_block - 1) // self.features_per_block

    @property
    def features_per_block(self) -> int:
        mats, warps, split, _ = self._dims
        return (warps // split) * (mats // 2 if self.swiglu else mats)

    @property
    def threads(self) -> int:
        return 32 * self._dims[1]

    @property
    def smem(self) -> int:
        """quant_gemv.cuh quant_gemv_smem_bytes: the k split's warp sums."""
        mats, warps, split, rows = self._dims
        return 0 if split == 1 else warps * mats * rows * 4


BASELINE_REV = "d6c86fd"  # session 8's main: the quantization headers before session 9's GEMV changes


def baseline_headers(baseline_src: str | None, workdir: Path) -> Path:
    """The include folder whose `quantization/` holds the baseline kernel's headers."""
    if baseline_src is not None:
        return Path(baseline_src)
    git = ["git", "-C", str(REPO), "archive", BASELINE_REV, "csrc/quantization"]
    archive = subprocess.run(git, capture_output=True, check=False)
    if archive.returncode != 0:
        raise SystemExit(
            f"cannot read the baseline {BASELINE_REV} from git ({archive.stderr.decode().strip()}); "
            "pass --baseline-src (see the module docstring)"
        )
    subprocess.run(["tar", "-x", "-C", str(workdir)], input=archive.stdout, check=True)
    return workdir / "csrc"


def build(variants: list[Variant], workdir: Path, baseline: Path) -> dict[str, object]:
    """nvcc both translation units (in parallel), load the cubins, return mangled name -> CUfunction."""
    from torch.utils.cpp_extension import CUDA_HOME

    nvcc = Path(CUDA_HOME or "/usr/local/cuda") / "bin" / "nvcc"
    major, minor = torch.cuda.get_device_capability()
    # One translation unit per group of kernels, compiled in parallel.
    units: dict[str, list[Variant]] = {"old": [v for v in variants if v.shape is None]}
    for kind in sorted({v.kind for v in variants}):
        group = [v for v in variants if v.shape and v.kind == kind]
        labels = list(dict.fromkeys(v.label for v in group))
        for i in range(0, len(labels), VARIANTS_PER_UNIT):
            part = labels[i : i + VARIANTS_PER_UNIT]
            units[f"new{kind}_{i}"] = [v for v in group if v.label in part]
    procs = {}
    for unit in [*units, "read"]:
        src = workdir / f"{unit}.cu"
        if unit == "read":
            include, instances = READ_CEILING_SOURCE, [""]
        else:
            include = '#include "quantization/quant_gemv.cuh"\n'
            instances = sorted({explicit(v.kind, v.rows, v.swiglu, v.shape) for v in units[unit]})
        if not instances:
            continue
        src.write_text(include + "".join(instances))
        includes = [f"-I{baseline}"] if unit == "old" else []
        cmd = [str(nvcc), "-cubin", f"-arch=sm_{major}{minor}", "-O3", "-std=c++17", *includes,
               f"-I{REPO / 'csrc'}", "-o", str(workdir / f"{unit}.cubin"), str(src)]  # fmt: skip
        procs[unit] = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    cuda = ctypes.CDLL("libcuda.so.1")
    functions: dict[str, object] = {}
    names = {"read": ["read_ceiling"]}
    for unit, proc in procs.items():
        out, _ = proc.communicate()
        if proc.returncode != 0:
            raise RuntimeError(f"nvcc {unit}: {out}")
        module = ctypes.c_void_p()
        image = (workdir / f"{unit}.cubin").read_bytes()
        check(cuda.cuModuleLoadData(ctypes.byref(module), image), "cuModuleLoadData")
        for name in [v.name for v in units.get(unit, [])] + names.get(unit, []):
            fn = ctypes.c_void_p()
            check(cuda.cuModuleGetFunction(ctypes.byref(fn), module, name.encode()), name)
            functions[name] = fn
    functions["_cuda"] = cuda
    return functions


# Nvcc units run in parallel: this many one-shot variants (each plain and SwiGLU) per unit.
VARIANTS_PER_UNIT = 3

# The memory-bound ceiling of a one-shot GEMV at a layer's size, launched as the GEMV is (programmatic
# dependent, waiting first): each thread loads 4 16-byte chunks 256 apart, all in flight at once, and
# folds them into a word stored only if it matches a constant (so the loads stay); no dequantization,
# no x. A grid over no chunks times the launch alone.
READ_CEILING_SOURCE = r"""
#include "common.cuh"
extern "C" __global__ void __launch_bounds__(256)
read_ceiling(const uint4* data, long long chunks, unsigned* sink) {
  voltllm::begin_dependent_grid();
  const long long base = static_cast<long long>(blockIdx.x) * 1024 + threadIdx.x;
  uint4 v[4];
#pragma unroll
  for (int u = 0; u < 4; ++u) v[u] = base + 256 * u < chunks ? data[base + 256 * u] : make_uint4(0, 0, 0, 0);
  unsigned folded = 0;
#pragma unroll
  for (int u = 0; u < 4; ++u) folded ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  if (folded == 0x9e3779b9u) sink[0] = folded;
}
"""


def read_launcher(fns, weights: list[ql.PackedQuantWeight] | None):
    """fn(i): read_ceiling over weight copy i's packed codes (None: one block over nothing)."""
    cuda, fn = fns["_cuda"], fns["read_ceiling"]
    sink = torch.zeros(1, dtype=torch.int32, device="cuda")
    ptrs = [w.packed.data_ptr() for w in weights] if weights else [sink.data_ptr()]
    chunks = weights[0].packed.numel() // 16 if weights else 0
    keep = [
        (ctypes.c_void_p(ptr), ctypes.c_longlong(chunks), ctypes.c_void_p(sink.data_ptr())) for ptr in ptrs
    ]
    args = [
        (ctypes.c_void_p * 3)(*(ctypes.cast(ctypes.pointer(a), ctypes.c_void_p) for a in k)) for k in keep
    ]
    grid = max(1, -(-chunks // 1024))

    def run(i: int) -> None:
        launch(cuda, fn, (grid, 1, 1), 256, 0, args[i % len(args)], "read_ceiling")

    run.keep_alive = (keep, args, sink)
    return run


class LaunchAttribute(ctypes.Structure):
    """CUlaunchAttribute: an id, padding to 8 bytes, a 64-byte value union."""

    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int * 16)]


class LaunchConfig(ctypes.Structure):
    """CUlaunchConfig."""

    _fields_ = [
        *((name, ctypes.c_uint) for name in ("gx", "gy", "gz", "bx", "by", "bz", "smem")),
        ("stream", ctypes.c_void_p),
        ("attrs", ctypes.POINTER(LaunchAttribute)),
        ("num_attrs", ctypes.c_uint),
    ]


PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
_PDL = LaunchAttribute(PROGRAMMATIC_STREAM_SERIALIZATION)
_PDL.value[0] = 1


def launch(cuda, fn, grid: tuple[int, int, int], threads: int, smem: int, args, what: str) -> None:
    """The kernel on torch's current stream, as a programmatic dependent launch where the device has it
    (SM90+, as the extension's glue launches)."""
    stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
    pdl = torch.cuda.get_device_capability()[0] >= 9
    config = LaunchConfig(*grid, threads, 1, 1, smem, stream, ctypes.pointer(_PDL) if pdl else None, int(pdl))
    check(cuda.cuLaunchKernelEx(ctypes.byref(config), fn, args, None), what)


def check(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"{what}: CUDA driver error {status}")


def launcher(fns: dict[str, object], v: Variant, weights: list[ql.PackedQuantWeight], x: torch.Tensor):
    """fn(i): the variant's kernel on weight copy i, into a preallocated output."""
    cuda = fns["_cuda"]
    fn = fns[v.name]
    n_rows, k = weights[0].shape
    n = n_rows // 2 if v.swiglu else n_rows
    out = torch.empty(x.shape[0], n, dtype=torch.float16, device="cuda")
    chunk = 32 if v.kind == 0 else 16
    num_groups = weights[0].group_params.shape[1]
    shift = 0 if num_groups == 1 else (weights[0].group_size // chunk).bit_length() - 1
    params = [
        Params(
            out.data_ptr(),
            x.data_ptr(),
            w.packed.data_ptr(),
            w.group_params.data_ptr(),
            None,
            out.stride(0),
            x.stride(0),
            x.shape[0],
            n,
            k,
            num_groups,
            shift,
        )  # fmt: skip
        for w in weights
    ]
    arg_arrays = [(ctypes.c_void_p * 1)(ctypes.cast(ctypes.pointer(p), ctypes.c_void_p)) for p in params]
    grid = v.grid(n)

    def run(i: int) -> torch.Tensor:
        launch(cuda, fn, (grid, 1, 1), v.threads, v.smem, arg_arrays[i], v.label)
        return out

    run.keep_alive = (params, arg_arrays)  # the launches read the structs they point at
    return run


def verify(run, weights: list[ql.PackedQuantWeight], x: torch.Tensor, swiglu: bool, label: str) -> None:
    out = run(0).float()
    ref = F.linear(x.float(), ql.dequantize_packed(weights[0]).float())
    if swiglu:
        gate, up = ref.to(torch.float16).float().chunk(2, dim=-1)
        ref = F.silu(gate) * up
    err = float((out - ref).abs().max())
    tol = 3e-3 * float(ref.abs().max()) + 1e-3
    if not err <= tol:
        raise AssertionError(f"{label}: max error {err:.4g} over tolerance {tol:.4g}")


def time_shape(
    fns: dict[str, object], variants: list[Variant], fmt: str, kind: int, rows: int, name: str, n: int, k: int
) -> tuple[int, dict[str, float]]:
    """(bytes read, label -> us) of every variant of (kind, rows), the extension's kernel (its choice and,
    at one row, each built shape) and the read-only ceiling on one layer."""
    swiglu = name.endswith("+act")
    weights = packed_copies(fmt, n, k)
    x = torch.randn(rows, k, device="cuda").half()
    by_label = {}
    runs = [
        (v.label, launcher(fns, v, weights, x))
        for v in variants
        if v.kind == kind and v.rows == rows and v.swiglu == swiglu
    ]
    for shape in range(1, ql.GEMV_ONE_ROW_SHAPES + 1) if rows == 1 else ():
        runs.append((f"ext{shape}", lambda i, s=shape: ql.quant_gemv(weights[i], x, swiglu=swiglu, shape=s)))
    for label, run in runs:
        try:
            verify(run, weights, x, swiglu, f"{fmt} {name} {label}")
        except AssertionError as err:  # a wrong variant is reported and left out of the table
            print(f"WRONG {err}", flush=True)
            continue
        by_label[label] = time_us(run, len(weights))
    by_label["ext"] = time_us(lambda i: ql.quant_gemv(weights[i], x, swiglu=swiglu), len(weights))
    if not swiglu:
        by_label["read"] = time_us(read_launcher(fns, weights), len(weights))
    return weights[0].nbytes, by_label


LAYERS = [*LLAMA_SHAPES, "gate_up+act"]


def print_table(fmt: str, rows: int, results: dict[str, dict[str, float]], nbytes: dict[str, int], bw: float):
    """One row per variant: us per call (fraction of copy bandwidth) on each layer and the four together."""
    print(f"\n### {fmt}, {rows} row(s): us per call (fraction of copy bandwidth)")
    print(
        "| variant | "
        + " | ".join(f"{layer} ({nbytes[layer] / 1e6:.1f} MB)" for layer in LAYERS)
        + " | all four |"
    )
    print("|" + " --- |" * (len(LAYERS) + 2))
    total_bytes = sum(nbytes[layer] for layer in LLAMA_SHAPES)
    for label, by_layer in results.items():
        cells = [
            f"{by_layer[layer]:.1f} ({nbytes[layer] / (by_layer[layer] * 1e-6) / bw:.2f})"
            if layer in by_layer
            else "-"
            for layer in LAYERS
        ]
        total = sum(by_layer.get(layer, float("nan")) for layer in LLAMA_SHAPES)
        print(
            f"| {label} | "
            + " | ".join(cells)
            + f" | {total:.1f} (**{total_bytes / (total * 1e-6) / bw:.2f}**) |"
        )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="1")
    parser.add_argument("--kinds", default="0,1,2")
    parser.add_argument("--variants", help="comma-separated labels of INT4_VARIANTS to time (default: all)")
    parser.add_argument("--baseline-src", help="include folder holding the baseline's quantization/ headers")
    args = parser.parse_args()
    from decode_latency import copy_bandwidth

    bandwidth = copy_bandwidth()
    print(f"GPU: {torch.cuda.get_device_name()}; copy bandwidth {bandwidth / 1e9:.0f} GB/s")
    rows_list = [int(r) for r in args.rows.split(",")]
    kinds = [int(k) for k in args.kinds.split(",")]
    variants = []
    for kind in kinds:
        table = INT4_VARIANTS if kind == 0 else INT4_VARIANTS[:3]
        if args.variants:
            table = [v for v in table if v[0] in args.variants.split(",")]
        else:  # session 8's kernel only when named: its headers need git or --baseline-src
            table = [v for v in table if v[1] is not None]
        for rows in rows_list:
            for swiglu in (False, True):
                for label, mats, unroll, warps, split, prefetch, no_l1 in table:
                    if swiglu and mats is not None and mats % 2:
                        continue
                    shape = None if mats is None else (mats, unroll, warps, split, prefetch, int(no_l1))
                    variants.append(Variant(label, kind, rows, swiglu, shape))
    with tempfile.TemporaryDirectory() as tmp:
        # Session 8's headers only when its kernel is timed (the GPU machine's tree has no .git).
        needs_baseline = any(v.shape is None for v in variants)
        baseline = baseline_headers(args.baseline_src, Path(tmp)) if needs_baseline else Path(tmp)
        fns = build(variants, Path(tmp), baseline)
    empty_us = time_us(read_launcher(fns, None), 1)
    print(f"an empty kernel (one block, waits for the one before): {empty_us:.2f} us per call")
    try:
        for kind in kinds:
            fmt = FORMAT_OF_KIND[kind]
            for rows in rows_list:
                results: dict[str, dict[str, float]] = {}
                nbytes: dict[str, int] = {}
                for name in LAYERS:
                    n, k = LLAMA_SHAPES[name.removesuffix("+act")]
                    nbytes[name], by_label = time_shape(fns, variants, fmt, kind, rows, name, n, k)
                    for label, us in by_label.items():
                        results.setdefault(label, {})[name] = us
                    torch.cuda.empty_cache()
                print_table(fmt, rows, results, nbytes, bandwidth)
    except Exception:  # noqa: BLE001 - what was measured is printed
        traceback.print_exc()


if __name__ == "__main__":
    main()
