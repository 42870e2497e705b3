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


def build_emulator(out_dir: Path, harness: str) -> ctypes.CDLL:
    """Compile `emu/<harness>` with the kernel headers into `out_dir` and load it."""
    lib = out_dir / (Path(harness).stem + ".so")
    cmd = [
        "g++", "-std=c++17", "-O1", "-fPIC", "-shared", "-Wno-unknown-pragmas",
        f"-I{EMU / 'include'}", f"-I{EMU}", f"-I{CSRC}", str(EMU / harness), "-o", str(lib),
    ]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return ctypes.CDLL(str(lib))


def ptr(t: torch.Tensor | None) -> ctypes.c_void_p:
    """A tensor's data pointer for a C entry point (NULL for None)."""
    return ctypes.c_void_p(None if t is None else t.data_ptr())
