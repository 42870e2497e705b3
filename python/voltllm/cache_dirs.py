"""Where voltllm keeps what it makes once and reuses: imported models and built CUDA kernels.

The root is `$VOLTLLM_CACHE_DIR`, else `$XDG_CACHE_HOME/voltllm`, else `~/.cache/voltllm`. The kernels'
folder alone can be put elsewhere with `$VOLTLLM_KERNEL_CACHE`: a device call points it at libraries
built on another machine (tools/prebuild_kernels.sh). Folders are created by the code that writes into
them."""

from __future__ import annotations

import os
from pathlib import Path


def voltllm_cache_dir() -> Path:
    """Root of voltllm's cache."""
    env = os.environ.get("VOLTLLM_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "voltllm"


def models_cache_dir() -> Path:
    """Imported models (the default model, GGUF files converted to safetensors folders)."""
    return voltllm_cache_dir() / "models"


def kernels_cache_dir() -> Path:
    """Built CUDA extensions, one folder per build key (`voltllm.ops.build.cache_dir`)."""
    env = os.environ.get("VOLTLLM_KERNEL_CACHE")
    return Path(env).expanduser() if env else voltllm_cache_dir() / "kernels"
