"""Sampling kernel versions side by side in one process: each version is built as its own small torch
extension, and every (logits, batch, setting) cell is timed for all versions in turn, so that the ratios
compare like with like on one GPU.

A version is `NAME=tree` (the kernels of this tree, `torch.ops.voltllm_C`) or `NAME=DIR`, where DIR
overlays the tree's `csrc/` with its own `sampling/radix_sampling.cuh` and/or
`torch_glue/ops_sampling.cu`. The first version is the baseline of the ratio columns. Every version's
tokens are checked against `sample_tokens_ref` (the sort-based reference) on the timed inputs.

Times are medians of single calls between CUDA events, which at small batches include the host's time
to issue the call (the GPU waits for it); `--device-time` instead keeps the GPU busy (a sleep kernel)
while the host queues 10 calls, so the events see device time alone, what a step pays when the sampler
is queued behind the forward.

    python benches/sampling_ab.py --version main=/tmp/ab/main --version new=tree
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernel_bench import time_ms  # noqa: E402

from voltllm.ops.build import CSRC_DIR, device_arch, load  # noqa: E402
from voltllm.ops.sampling import random_seeds, sample_tokens_ref  # noqa: E402

VOCAB = 151_936
SETTINGS = {  # name -> (temperature, top_k, top_p)
    "T=0.6": (0.6, 0, 1.0),
    "T=0.6 top-p 0.95": (0.6, 0, 0.95),
    "T=0.6 top-k 50 top-p 0.95": (0.6, 50, 0.95),
}
SCALES = {"peaked (std 4)": 4.0, "flat (std 0.01)": 0.01}
OVERLAY_FILES = ("sampling/radix_sampling.cuh", "torch_glue/ops_sampling.cu")
# The version's one op, in a namespace of its own; `-Dvoltllm=...` renames the C++ namespace too, so
# that two versions' symbols never meet in one process. The declaration and schema come from the
# version's glue (versions differ in which filters may be None).
BINDING = """#include <optional>
#include <torch/all.h>
#include <torch/library.h>
namespace voltllm {
void radix_sampling(PARAMS);
}
TORCH_LIBRARY(NAMESPACE, m) {
  m.def("radix_sampling(SCHEMA) -> ()");
  m.impl("radix_sampling", &voltllm::radix_sampling);
}
"""
_GLUE_SIGNATURE = re.compile(r"void radix_sampling\(([^)]*)\)\s*\{")
_SCHEMA_TYPES = {  # C++ parameter type -> schema type
    "at::Tensor&": "Tensor(a!)",
    "const at::Tensor&": "Tensor",
    "const std::optional<at::Tensor>&": "Tensor?",
}


def namespace(name: str) -> str:
    return f"voltllm_ab_{name}"


def binding_for(glue: str, name: str) -> str:
    """The binding of version `name`, whose glue source is `glue`."""
    match = _GLUE_SIGNATURE.search(glue)
    if match is None:
        raise SystemExit(f"{name}: no radix_sampling definition in its ops_sampling.cu")
    params = " ".join(match.group(1).split())
    schema = []
    for param in params.split(","):
        ctype, arg = param.strip().rsplit(" ", 1)
        schema.append(f"{_SCHEMA_TYPES[ctype]} {arg}")
    text = BINDING.replace("PARAMS", params).replace("SCHEMA", ", ".join(schema))
    return text.replace("NAMESPACE", namespace(name))


def prepare_sources(name: str, overlay: Path, work: Path) -> Path:
    """The tree's csrc/ with `overlay`'s files over it, plus the version's binding, under work/name."""
    root = work / name
    shutil.rmtree(root, ignore_errors=True)
    shutil.copytree(CSRC_DIR, root)
    found = [f for f in OVERLAY_FILES if (overlay / f).is_file()]
    if not found:
        raise SystemExit(f"{overlay} holds none of {', '.join(OVERLAY_FILES)}")
    for f in found:
        shutil.copy(overlay / f, root / f)
    glue = (root / "torch_glue/ops_sampling.cu").read_text()
    (root / "ab_binding.cpp").write_text(binding_for(glue, name))
    return root


def build(name: str, root: Path, arch: str) -> None:
    """Builds (or loads the cached build of) version `name` from `root`, registering its op."""
    from torch.utils import cpp_extension

    os.environ["TORCH_CUDA_ARCH_LIST"] = arch
    rename = f"-Dvoltllm={namespace(name)}"
    build_dir = root / "build"
    build_dir.mkdir(exist_ok=True)
    cpp_extension.load(
        name=namespace(name),
        sources=[str(root / "torch_glue/ops_sampling.cu"), str(root / "ab_binding.cpp")],
        extra_include_paths=[str(root)],
        extra_cflags=["-O3", rename],
        extra_cuda_cflags=["-O3", "-lineinfo", rename],
        build_directory=str(build_dir),
        is_python_module=False,
    )


def build_all(overlays: dict[str, Path], work: Path, arch: str) -> None:
    """Builds every overlay version in parallel (one process each), then loads them here."""
    roots = {name: prepare_sources(name, overlay, work) for name, overlay in overlays.items()}
    procs = [
        subprocess.Popen([sys.executable, __file__, "--build-one", name, str(root), arch])
        for name, root in roots.items()
    ]
    if any(p.wait() != 0 for p in procs):
        raise SystemExit("a version failed to build (its compiler output is above)")
    for name, root in roots.items():
        build(name, root, arch)


def device_ms(call: Callable[[], None], reps: int, calls: int = 10) -> float:
    """Median device time of one call: the host queues `calls` calls behind a sleep kernel (so it is
    ahead of the GPU), the events around them see only the GPU's time."""
    call()
    torch.cuda.synchronize()
    samples = []
    for _ in range(reps):
        torch.cuda._sleep(2_000_000)  # ~1 ms: longer than the host needs to queue the calls
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            call()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / calls)
    return statistics.median(samples)


def op_of(name: str, source: str) -> Callable[..., None]:
    if source == "tree":
        load()
        return torch.ops.voltllm_C.radix_sampling
    return getattr(torch.ops, namespace(name)).radix_sampling


def takes_none(op: Callable[..., None]) -> bool:
    """Whether the op takes None for a filter no row uses (it then launches nothing for it)."""
    return "Tensor? top_k" in str(op.default._schema)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--version", action="append", default=[], help="NAME=tree or NAME=DIR (repeatable)")
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--device-time", action="store_true", help="device time per call (see above)")
    p.add_argument("--build-one", nargs=3, metavar=("NAME", "ROOT", "ARCH"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.build_one:
        name, root, arch = args.build_one
        build(name, Path(root), arch)
        return
    versions = dict(v.split("=", 1) for v in args.version)
    if not versions or not all(n.isidentifier() for n in versions):
        raise SystemExit("give at least one --version NAME=tree|DIR, NAME an identifier")
    work = Path(os.environ.get("SAMPLING_AB_DIR", Path(tempfile.gettempdir()) / "sampling_ab"))
    arch = device_arch()
    build_all({n: Path(s) for n, s in versions.items() if s != "tree"}, work, arch)
    ops = {n: op_of(n, s) for n, s in versions.items()}
    names = list(ops)
    base = names[0]
    gpu = torch.cuda.get_device_name()
    kind = "device time per call" if args.device_time else "single calls"
    print(f"GPU: {gpu}; vocab {VOCAB}; fp32 logits; median of {args.reps} {kind} (ms)")
    ratios = " | ".join(f"{n} / {base}" for n in names[1:])
    print(f"| logits | batch | sampling | {' | '.join(names)} | {ratios} | mismatches vs reference |")
    print("| --- " * (3 + 2 * len(names) - 1 + 1) + "|")
    for label, scale in SCALES.items():
        for rows in (1, 64, 256):
            torch.manual_seed(rows)
            logits = torch.randn(rows, VOCAB, device="cuda") * scale
            seeds = random_seeds(rows, torch.device("cuda"))
            for setting, (t, k, top_p) in SETTINGS.items():
                inputs = (
                    logits,
                    torch.full((rows,), t, device="cuda"),
                    torch.full((rows,), k, dtype=torch.int32, device="cuda"),
                    torch.full((rows,), top_p, device="cuda"),
                    torch.zeros(rows, device="cuda"),
                    seeds,
                )
                want = sample_tokens_ref(*inputs)
                logits_, temperature, top_k, top_p_, min_p, seeds_ = inputs
                lean = (
                    logits_,
                    temperature,
                    top_k if k else None,
                    top_p_ if top_p < 1 else None,
                    None,
                    seeds_,
                )
                times, wrong = {}, []
                for n, op in ops.items():
                    out = torch.empty(rows, dtype=torch.int64, device="cuda")
                    args_ = lean if takes_none(op) else inputs
                    op(out, *args_)
                    wrong.append(f"{n} {int((out != want).sum())}")
                    call = partial(op, out, *args_)
                    if args.device_time:
                        times[n] = device_ms(call, args.reps)
                    else:
                        times[n] = time_ms(lambda i, call=call: call(), iters=1, repeats=args.reps)
                cells = " | ".join(f"{times[n]:.3f}" for n in names)
                ratio_cells = " | ".join(f"{times[n] / times[base]:.2f}" for n in names[1:])
                print(f"| {label} | {rows} | {setting} | {cells} | {ratio_cells} | {', '.join(wrong)} |")


if __name__ == "__main__":
    main()
