"""Times quantized GEMV kernel variants side by side in one process on a GPU: session 8's kernel (the
headers of commit BASELINE_REV, taken with `git archive`, or from `--baseline-src` on a machine with no
git checkout) against the current header's kernel at several shapes (weight rows
per warp, chunks in flight, warps per block), on the Llama-3-8B projections.

Each variant is compiled by nvcc to a cubin (no torch extension build) and launched through the CUDA
driver API on torch's stream, inside CUDA graphs over weight copies larger than L2 (benches/
quantization.py's timing), without programmatic dependent launch; the `ext` column is the built
extension's kernel (`voltllm.ops.quantized_linear.quant_gemv`, with it). Every variant's output is
checked against the dequantize + fp32 product first.

    python tools/quant_ab/gemv_ab.py [--rows 1,2,4]
    # where the tree has no .git (the GPU machine), make the baseline beforehand and carry it:
    git archive d6c86fd csrc/quantization | tar -x -C .carry/quant_base
    python tools/quant_ab/gemv_ab.py --baseline-src .carry/quant_base/csrc
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
from quantization import LLAMA_SHAPES, fp16_copies, packed_copies  # noqa: E402

from voltllm.ops import quantized_linear as ql  # noqa: E402

# (label, MATS, UNROLL, WARPS, blocks per SM); MATS None = session 8's kernel; blocks per SM 0 = the
# one-shot quant_gemv_kernel (a warp per row group), else quant_gemv_persistent_kernel on that many
# blocks per SM.
INT4_VARIANTS = [
    ("s8", None, 0, 0, 0),
    ("4x2w4", 4, 2, 4, 0),
    ("p4x2w8b1", 4, 2, 8, 1),
    ("p2x4w8b1", 2, 4, 8, 1),
    ("p4x1w8b1", 4, 1, 8, 1),
    ("p2x2w8b1", 2, 2, 8, 1),
    ("p4x1w8b2", 4, 1, 8, 2),
    ("p2x2w8b2", 2, 2, 8, 2),
    ("p4x2w4b2", 4, 2, 4, 2),
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


def kernel_name(persistent: bool) -> str:
    return "quant_gemv_persistent_kernel" if persistent else "quant_gemv_kernel"


def mangled(
    kind: int, rows: int, swiglu: bool, shape: tuple[int, int, int] | None, persistent: bool = False
) -> str:
    args = f"Li{kind}ELi{rows}ELb{int(swiglu)}E"
    if shape is not None:
        args += "".join(f"Li{v}E" for v in shape)
    name = kernel_name(persistent)
    return f"_ZN7voltllm{len(name)}{name}I{args}EEvNS_15QuantGemvParamsE"


# Weight-streaming GEMM shapes (m fragments, n fragments, ring depth), int4.
STREAM_SHAPES = [(1, 1, 8), (1, 2, 4), (1, 2, 8), (2, 1, 8), (2, 2, 4), (4, 1, 4), (4, 1, 2), (4, 2, 2)]
FINALIZE = "_ZN7voltllm26quant_gemm_finalize_kernelENS_23QuantGemmFinalizeParamsE"


def stream_mangled(shape: tuple[int, int, int]) -> str:
    args = "Li0E" + "".join(f"Li{v}E" for v in shape)
    return f"_ZN7voltllm24quant_gemm_stream_kernelI{args}EEvNS_15QuantGemmParamsE"


def stream_explicit(shape: tuple[int, int, int]) -> str:
    args = ", ".join(map(str, (0, *shape)))
    return f"template __global__ void voltllm::quant_gemm_stream_kernel<{args}>(voltllm::QuantGemmParams);\n"


def explicit(
    kind: int, rows: int, swiglu: bool, shape: tuple[int, int, int] | None, persistent: bool = False
) -> str:
    args = f"{kind}, {rows}, {'true' if swiglu else 'false'}"
    if shape is not None:
        args += ", " + ", ".join(map(str, shape))
    name = kernel_name(persistent)
    return f"template __global__ void voltllm::{name}<{args}>(voltllm::QuantGemvParams);\n"


@dataclasses.dataclass
class Variant:
    label: str
    kind: int
    rows: int
    swiglu: bool
    shape: tuple[int, int, int] | None  # (MATS, UNROLL, WARPS); None: session 8
    blocks_per_sm: int = 0  # 0: the one-shot kernel; else the persistent one

    @property
    def name(self) -> str:
        return mangled(self.kind, self.rows, self.swiglu, self.shape, self.blocks_per_sm > 0)

    def grid(self, n: int) -> int:
        blocks = (n + self.features_per_block - 1) // self.features_per_block
        if self.blocks_per_sm:
            sms = torch.cuda.get_device_properties(0).multi_processor_count
            blocks = min(blocks, sms * self.blocks_per_sm)
        return blocks

    @property
    def features_per_block(self) -> int:
        mats, _, warps = self.shape or (2, 4, 4)
        return warps * (mats // 2 if self.swiglu else mats)

    @property
    def threads(self) -> int:
        return 32 * (self.shape or (2, 4, 4))[2]


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
        for persistent in (False, True):
            units[f"new{kind}{'p' if persistent else ''}"] = [
                v for v in variants if v.shape and v.kind == kind and (v.blocks_per_sm > 0) == persistent
            ]
    stream_units = {f"stream{i}": STREAM_SHAPES[i::3] for i in range(3)}
    procs = {}
    for unit in [*units, *stream_units]:
        src = workdir / f"{unit}.cu"
        if unit in stream_units:
            include = '#include "quantization/quant_gemm_stream.cuh"\n'
            instances = [stream_explicit(shape) for shape in stream_units[unit]]
        else:
            include = '#include "quantization/quant_gemv.cuh"\n'
            instances = sorted(
                {explicit(v.kind, v.rows, v.swiglu, v.shape, v.blocks_per_sm > 0) for v in units[unit]}
            )
        if not instances:
            continue
        src.write_text(include + "".join(instances))
        includes = [f"-I{baseline}"] if unit == "old" else []
        cmd = [str(nvcc), "-cubin", f"-arch=sm_{major}{minor}", "-O3", "-std=c++17", *includes,
               f"-I{REPO / 'csrc'}", "-o", str(workdir / f"{unit}.cubin"), str(src)]  # fmt: skip
        procs[unit] = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    cuda = ctypes.CDLL("libcuda.so.1")
    functions: dict[str, object] = {}
    names = {unit: [stream_mangled(shape) for shape in shapes] for unit, shapes in stream_units.items()}
    names["stream0"].append(FINALIZE)
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


class GemmParams(ctypes.Structure):
    """csrc/quantization/quant_gemm_wmma.cuh QuantGemmParams."""

    _fields_ = [
        *((name, ctypes.c_void_p) for name in ("out", "partial", "x", "weight", "group_params", "bias")),
        ("out_stride", ctypes.c_longlong),
        ("x_stride", ctypes.c_longlong),
        *(
            (name, ctypes.c_int)
            for name in ("m", "n", "k", "num_groups", "chunk_group_shift", "k_tiles_per_split")
        ),
    ]


class FinalizeParams(ctypes.Structure):
    _fields_ = [
        ("out", ctypes.c_void_p),
        ("partial", ctypes.c_void_p),
        ("bias", ctypes.c_void_p),
        ("out_stride", ctypes.c_longlong),
        ("m", ctypes.c_int),
        ("n", ctypes.c_int),
    ]


def stream_launcher(fns, shape, splits: int, weights: list[ql.PackedQuantWeight], x: torch.Tensor):
    """fn(i): the streaming GEMM (and with splits > 1 the zeroing and the finalize) on weight copy i."""
    cuda = fns["_cuda"]
    fn, finalize = fns[stream_mangled(shape)], fns[FINALIZE]
    mf, nf, _ = shape
    n, k = weights[0].shape
    m = x.shape[0]
    out = torch.empty(m, n, dtype=torch.float16, device="cuda")
    partial = torch.zeros(m, n, dtype=torch.float32, device="cuda")
    k_tiles = k // 64
    # quant_gemm_stream.cuh: 8 warps of 16 * nf rows, each a [16 nf][72] fp16 tile, then x's 16 mf rows
    # of the split, padded by 8 columns; a split's x must fit the opt-in shared memory.
    fixed = 8 * 16 * nf * 72 * 2
    optin = torch.cuda.get_device_properties(0).shared_memory_per_block_optin
    max_chunks = ((optin - fixed) // (16 * mf * 2) - 8) // 64
    splits = max(splits, -(-k_tiles // max_chunks))
    per_split = -(-k_tiles // splits)
    splits = -(-k_tiles // per_split)
    num_groups = weights[0].group_params.shape[1]
    shift = 0 if num_groups == 1 else (weights[0].group_size // 32).bit_length() - 1
    partial_ptr = partial.data_ptr() if splits > 1 else None
    params = [
        GemmParams(
            out.data_ptr(),
            partial_ptr,
            x.data_ptr(),
            w.packed.data_ptr(),
            w.group_params.data_ptr(),
            None,
            out.stride(0),
            x.stride(0),
            m,
            n,
            k,
            num_groups,
            shift,
            per_split,
        )  # fmt: skip
        for w in weights
    ]
    args = [(ctypes.c_void_p * 1)(ctypes.cast(ctypes.pointer(p), ctypes.c_void_p)) for p in params]
    fparams = FinalizeParams(out.data_ptr(), partial.data_ptr(), None, out.stride(0), m, n)
    fargs = (ctypes.c_void_p * 1)(ctypes.cast(ctypes.pointer(fparams), ctypes.c_void_p))
    grid = (-(-n // (128 * nf)), -(-m // (16 * mf)), splits)
    smem = fixed + 16 * mf * (per_split * 64 + 8) * 2
    max_dynamic_smem = 8  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    check(cuda.cuFuncSetAttribute(fn, max_dynamic_smem, smem), "cuFuncSetAttribute")

    def run(i: int) -> torch.Tensor:
        if splits > 1:
            partial.zero_()
        launch(cuda, fn, grid, 256, smem, args[i], str(shape))
        if splits > 1:
            launch(cuda, finalize, (m, 1, 1), 256, 0, fargs, "finalize")
        return out

    run.keep_alive = (params, args, fparams, fargs, partial)
    return run


def gemm_tables(fns) -> None:
    fmt = FORMAT_OF_KIND[0]
    for rows in (16, 64):
        shapes = [s for s in STREAM_SHAPES if 16 * s[0] <= rows]
        print(f"\n### {fmt} GEMM, {rows} rows: us (best split); speed-up = cuBLAS fp16 / time")
        print(
            "| layer | cuBLAS fp16 | ext quant_gemm | "
            + " | ".join(f"stream {s}" for s in shapes)
            + " | best speed-up |"
        )
        print("|" + " --- |" * (len(shapes) + 4))
        for name, (n, k) in LLAMA_SHAPES.items():
            weights = packed_copies(fmt, n, k)
            dense = fp16_copies(n, k)
            x = torch.randn(rows, k, device="cuda").half()
            ref = F.linear(x.float(), ql.dequantize_packed(weights[0]).float())
            tol = 3e-3 * float(ref.abs().max()) + 1e-3
            c_us = time_us(lambda i: F.linear(x, dense[i]), len(dense))  # noqa: B023
            e_us = time_us(lambda i: ql.quant_gemm(weights[i], x), len(weights))  # noqa: B023
            s_us = time_us(lambda i: ql.quant_gemm_stream(weights[i], x), len(weights))  # noqa: B023
            cells, best = [f"{s_us:.1f}"], min(e_us, s_us)
            for shape in shapes:
                results = []
                for splits in (1, 2, 4, 8):
                    run = stream_launcher(fns, shape, splits, weights, x)
                    err = float((run(0).float() - ref).abs().max())
                    if not err <= tol:
                        raise AssertionError(
                            f"stream {shape} splits {splits} {name}: error {err:.4g} > {tol:.4g}"
                        )
                    results.append((time_us(run, len(weights)), splits))
                us, splits = min(results)
                best = min(best, us)
                cells.append(f"{us:.1f}/s{splits}")
            print(
                f"| {name} | {c_us:.1f} | {e_us:.1f} | " + " | ".join(cells) + f" | {c_us / best:.2f}x |",
                flush=True,
            )


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
        launch(cuda, fn, (grid, 1, 1), v.threads, 0, arg_arrays[i], v.label)
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
    """(bytes read, label -> us) of every variant of (kind, rows) and the extension's kernel on one layer."""
    swiglu = name.endswith("+act")
    weights = packed_copies(fmt, n, k)
    x = torch.randn(rows, k, device="cuda").half()
    by_label = {}
    for v in [v for v in variants if v.kind == kind and v.rows == rows and v.swiglu == swiglu]:
        run = launcher(fns, v, weights, x)
        verify(run, weights, x, swiglu, f"{fmt} {name} {v.label}")
        by_label[v.label] = time_us(run, len(weights))
    by_label["ext"] = time_us(lambda i: ql.quant_gemv(weights[i], x, swiglu=swiglu), len(weights))
    return weights[0].nbytes, by_label


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="1")
    parser.add_argument("--kinds", default="0,1,2")
    parser.add_argument("--gemm", action="store_true", help="also the streaming GEMM at 16 and 64 rows")
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
        for rows in rows_list:
            for swiglu in (False, True):
                for label, mats, unroll, warps, blocks_per_sm in table:
                    if swiglu and mats is not None and mats % 2:
                        continue
                    shape = None if mats is None else (mats, unroll, warps)
                    variants.append(Variant(label, kind, rows, swiglu, shape, blocks_per_sm))
    with tempfile.TemporaryDirectory() as tmp:
        fns = build(variants, Path(tmp), baseline_headers(args.baseline_src, Path(tmp)))
    try:
        for kind in kinds:
            fmt = FORMAT_OF_KIND[kind]
            for rows in rows_list:
                labels = [v.label for v in variants if v.kind == kind and v.rows == rows and not v.swiglu]
                print(f"\n### {fmt}, {rows} row(s): us per call (fraction of copy bandwidth)")
                print("| layer | MB | " + " | ".join(labels) + " | ext |")
                print("|" + " --- |" * (len(labels) + 3))
                totals = {label: 0.0 for label in [*labels, "ext"]}
                total_bytes = 0
                for name, (n, k) in [*LLAMA_SHAPES.items(), ("gate_up+act", LLAMA_SHAPES["gate_up"])]:
                    swiglu = name.endswith("+act")
                    nbytes, by_label = time_shape(fns, variants, fmt, kind, rows, name, n, k)
                    if not swiglu:
                        total_bytes += nbytes
                        for label in totals:
                            totals[label] += by_label.get(label, float("nan"))
                    row = " | ".join(
                        f"{by_label[label]:.1f} ({nbytes / (by_label[label] * 1e-6) / bandwidth:.2f})"
                        if label in by_label else "-"
                        for label in [*labels, "ext"]
                    )  # fmt: skip
                    print(f"| {name} | {nbytes / 1e6:.1f} | {row} |", flush=True)
                    torch.cuda.empty_cache()
                row = " | ".join(
                    f"{totals[label]:.1f} (**{total_bytes / (totals[label] * 1e-6) / bandwidth:.2f}**)"
                    for label in [*labels, "ext"]
                )
                print(f"| all four | {total_bytes / 1e6:.1f} | {row} |", flush=True)
    except Exception:  # noqa: BLE001 - the GEMM table still runs
        traceback.print_exc()
    if args.gemm:
        gemm_tables(fns)


if __name__ == "__main__":
    main()
