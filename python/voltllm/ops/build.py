"""Build and load the CUDA extension (`torch.ops.voltllm_C`) for the GPU in this machine.

The kernel sources live in the repository's top-level `csrc/` and ship inside the package as
`voltllm/_csrc/` (in the source tree a symlink to `../../csrc`; the wheel holds the files themselves,
pyproject.toml's `[tool.maturin] include`), so an installed wheel can build them. The first use compiles
them with `torch.utils.cpp_extension.load` for the current device's compute capability and caches the
result under `~/.cache/voltllm/kernels/` (or `$XDG_CACHE_HOME`); later processes load the cached
library. To build ahead of time (for example on a V100 with a CUDA 12.x
toolkit and a CUDA 12 build of torch):

    python -m voltllm.ops              # for the GPU present
    python -m voltllm.ops --arch 7.0   # for an explicit compute capability
"""

from __future__ import annotations

import argparse
import os
import threading
from pathlib import Path

import torch


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


def cache_dir(arch: str) -> Path:
    """Where the extension for compute capability `arch` (e.g. "9.0") is built and cached."""
    root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "voltllm" / "kernels"
    cuda = (torch.version.cuda or "nocuda").replace(".", "")
    tag = f"torch{torch.__version__.split('+')[0]}-cu{cuda}-sm{arch.replace('.', '')}"
    return root / tag


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
        from torch.utils import cpp_extension

        build_dir = cache_dir(arch)
        build_dir.mkdir(parents=True, exist_ok=True)
        previous = os.environ.get("TORCH_CUDA_ARCH_LIST")
        os.environ["TORCH_CUDA_ARCH_LIST"] = arch  # torch turns this into -gencode flags
        try:
            cpp_extension.load(
                name=f"voltllm_C_sm{arch.replace('.', '')}",
                sources=[str(CSRC_DIR / s) for s in SOURCES],
                extra_include_paths=[str(CSRC_DIR)],
                extra_cflags=["-O3"],
                extra_cuda_cflags=["-O3", "-lineinfo"],
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
        _loaded_arch = arch
        return arch


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
