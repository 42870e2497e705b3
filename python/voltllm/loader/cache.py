"""Where voltllm keeps imported models: `$VOLTLLM_CACHE_DIR` or `~/.cache/voltllm`."""

from __future__ import annotations

import os
from pathlib import Path


def voltllm_cache_dir() -> Path:
    """Root of voltllm's cache (created on demand by the code that writes into it)."""
    env = os.environ.get("VOLTLLM_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "voltllm"


def models_cache_dir() -> Path:
    return voltllm_cache_dir() / "models"
