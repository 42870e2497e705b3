"""Build and load the CUDA extension (`torch.ops.voltllm_C`) for the GPU in this machine.

The kernel sources live in the repository's top-level `csrc/` and ship inside the package as
`voltllm/_csrc/` (in the source tree a symlink to `../../csrc`; the wheel holds the files themselves,
pyproject.toml's `[tool.maturin] include`), so an installed wheel can build them. The first use compiles
them with `torch.utils.cpp_extension.load` for the current device's compute capability and caches the
result under `voltllm.cache_dirs.kernels_cache_dir()` (`~/.cache/voltllm/kernels/` by default); later
processes load the cached library. To build ahead of time (for example on a V100 with a CUDA 12.x
toolkit and a CUDA 12 build of torch):

    python -m voltllm.ops              # for the GPU present
    python -m voltllm.ops --arch 7.0   # for an explicit compute capability

The cache is keyed by what the library is made of: torch's and CUDA's versions, the compute capability
and a digest of the kernel sources and build flags. A library found under its key is loaded as it is,
without asking ninja (whose mtime checks miss a source that changed but is older than the build, and
rebuild one that was only copied), so a library built ahead of time on a machine without a GPU, for the
same torch and CUDA, can be carried to the GPU machine and loaded there.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import threading
from pathlib import Path

import torch

from voltllm.cache_dirs import kernels_cache_dir


def _csrc_dir() -> Path:
    """The kernel sources: the package's `_csrc/` (a wheel's copy, or the source tree's symlink), else the
    source tree's `csrc/` itself (a copy of the tree that dropped the symlink)."""
    package = Path(__file__).resolve().parent.parent
    for candidate in (package / "_csrc", package.parent.parent / "csrc"):
        if (candidate / "common.cuh").is_file():
            return candidate.resolve()
    return package / "_csrc"  # missing: the build fails and says where it looked


# The include root: every source includes the others by their path from here ("attention/...").
CSRC_DIR = _csrc_dir()
# The translation units: the torch glue (`torch_glue/`), which includes the torch-free kernels.
SOURCES = (
    "torch_glue/ops_elementwise.cu",
    "torch_glue/ops_decode_attention.cu",
    "torch_glue/ops_prefill_attention.cu",
    "torch_glue/ops_linear.cu",
    "torch_glue/ops_moe.cu",
    "torch_glue/ops_moe_decode.cu",
    "torch_glue/ops_moe_quant.cu",
    "torch_glue/ops_quant.cu",
    "torch_glue/ops_sampling.cu",
    "torch_glue/ops_structured.cu",
    "torch_glue/torch_bindings.cpp",
)
_lock = threading.Lock()
_loaded_arch: str | None = None


class KernelBuildError(RuntimeError):
    """The CUDA extension cannot be built or loaded here."""


# What the compiler is told besides the sources; part of the cache key.
CFLAGS = ("-O3",)
CUDA_CFLAGS = ("-O3", "-lineinfo")
# The files a build reads: the translation units and every header they include (csrc/README.md is not).
_COMPILED_SUFFIXES = (".cu", ".cuh", ".cpp", ".h")


def source_digest() -> str:
    """A digest of every kernel source (path and bytes) and the build flags: equal digests, equal builds."""
    digest = hashlib.sha256(repr((SOURCES, CFLAGS, CUDA_CFLAGS)).encode())
    for path in sorted(CSRC_DIR.rglob("*")):
        if path.suffix in _COMPILED_SUFFIXES and path.is_file():
            digest.update(str(path.relative_to(CSRC_DIR)).encode() + b"\0")
            digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()


def cache_dir(arch: str) -> Path:
    """Where the extension for compute capability `arch` (e.g. "9.0") is built and cached: one folder per
    torch version, CUDA version, architecture and source digest."""
    cuda = (torch.version.cuda or "nocuda").replace(".", "")
    tag = f"torch{torch.__version__.split('+')[0]}-cu{cuda}-sm{arch.replace('.', '')}-{source_digest()[:16]}"
    return kernels_cache_dir() / tag


def library_name(arch: str) -> str:
    """The extension's name (and its library's file stem) for compute capability `arch`."""
    return f"voltllm_C_sm{arch.replace('.', '')}"


def device_arch(device: torch.device | int | None = None) -> str:
    major, minor = torch.cuda.get_device_capability(device)
    return f"{major}.{minor}"


def load(arch: str | None = None, verbose: bool = False) -> str:
    """Build (once) and load the extension; returns the compute capability it was built for.

    Raises KernelBuildError when there is no CUDA device (and no `arch`), no CUDA toolkit, or the build
    fails.
    """
    global _loaded_arch
    with _lock:
        if _loaded_arch is not None:
            return _loaded_arch
        if arch is None:
            if not torch.cuda.is_available():
                raise KernelBuildError("no CUDA device: the voltllm kernels need one (or pass an arch)")
            arch = device_arch()
        if torch.version.cuda is None:
            raise KernelBuildError("this torch build has no CUDA support")
        missing = [s for s in SOURCES if not (CSRC_DIR / s).is_file()]
        if missing:
            raise KernelBuildError(f"the kernel sources are missing from {CSRC_DIR}: {', '.join(missing)}")
        build_dir = cache_dir(arch)
        if not _load_cached(build_dir / f"{library_name(arch)}.so"):
            _build(arch, build_dir, verbose)
        _loaded_arch = arch
        return arch


def _load_cached(library: Path) -> bool:
    """Load a library built before from these very sources; False when there is none that loads (a build
    cut short, say: the build then writes it anew)."""
    if not library.is_file():
        return False
    try:
        torch.ops.load_library(str(library))
    except OSError:
        return False
    return True


def _build(arch: str, build_dir: Path, verbose: bool) -> None:
    """Compile the extension for `arch` into `build_dir` and load it."""
    from torch.utils import cpp_extension

    build_dir.mkdir(parents=True, exist_ok=True)
    previous = os.environ.get("TORCH_CUDA_ARCH_LIST")
    os.environ["TORCH_CUDA_ARCH_LIST"] = arch  # torch turns this into -gencode flags
    try:
        cpp_extension.load(
            name=library_name(arch),
            sources=[str(CSRC_DIR / s) for s in SOURCES],
            extra_include_paths=[str(CSRC_DIR)],
            extra_cflags=list(CFLAGS),
            extra_cuda_cflags=list(CUDA_CFLAGS),
            build_directory=str(build_dir),
            is_python_module=False,
            verbose=verbose,
        )
    except (OSError, RuntimeError, ImportError) as err:
        sm = arch.replace(".", "")
        raise KernelBuildError(f"building the voltllm CUDA kernels for sm_{sm} failed: {err}") from err
    finally:
        if previous is None:
            os.environ.pop("TORCH_CUDA_ARCH_LIST", None)
        else:
            os.environ["TORCH_CUDA_ARCH_LIST"] = previous


def main() -> None:
    parser = argparse.ArgumentParser(description="Build the voltllm CUDA kernels ahead of time.")
    parser.add_argument("--arch", help='compute capability, e.g. "7.0" (default: the GPU present)')
    parser.add_argument("--verbose", action="store_true", help="show the compiler commands")
    args = parser.parse_args()
    try:
        arch = load(args.arch, verbose=args.verbose)
    except KernelBuildError as err:
        raise SystemExit(f"error: {err}") from err
    print(f"voltllm kernels built for sm_{arch.replace('.', '')} in {cache_dir(arch)}")


if __name__ == "__main__":
    main()
