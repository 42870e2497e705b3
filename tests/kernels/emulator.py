"""Builds a kernel harness from tests/kernels/emu against the CPU emulator and loads it with ctypes.

Kernel headers (`csrc/attention/`, `csrc/ops/`) compile with g++ against `emu/cuda_emu.h`, which
stands in for the CUDA toolchain; a harness file exposes C entry points that launch them.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
CSRC = HERE.parents[1] / "csrc"  # the include root: headers include each other by path from here
EMU = HERE / "emu"

needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ to build the kernel emulator")


def build_emulator(out_dir: Path, harness: str, defines: tuple[str, ...] = ()) -> ctypes.CDLL:
    """Compile `emu/<harness>` with the kernel headers (and `-D` each of `defines`) into `out_dir` and
    load it. `-fno-gnu-unique`: the emulator's function-local statics (the WMMA maps, the running block)
    stay each library's own when one process loads two builds of a harness."""
    lib = out_dir / (Path(harness).stem + "".join(f"-{d}" for d in defines) + ".so")
    cmd = [
        "g++", "-std=c++17", "-O1", "-fPIC", "-shared", "-fno-gnu-unique", "-Wno-unknown-pragmas",
        *(f"-D{d}" for d in defines),
        f"-I{EMU / 'include'}", f"-I{EMU}", f"-I{CSRC}", str(EMU / harness), "-o", str(lib),
    ]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return ctypes.CDLL(str(lib))


def ptr(t: torch.Tensor | None) -> ctypes.c_void_p:
    """A tensor's data pointer for a C entry point (NULL for None)."""
    return ctypes.c_void_p(None if t is None else t.data_ptr())


def fresh_generator() -> tuple[torch.Generator, int]:
    """A CPU generator on a fresh seed each run, and the seed (for the failure message: tests that draw
    fresh inputs hold them to a derived bound, so any seed must pass)."""
    seed = int(torch.randint(0, 2**31, ()))
    return torch.Generator().manual_seed(seed), seed
