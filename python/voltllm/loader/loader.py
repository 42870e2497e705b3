"""`load_model`: from a `ModelConfig` to a ready model on the target device.

Formats: a Hugging Face folder of safetensors (single file or sharded), a GGUF file (or a folder holding
one) imported once into a cached HF folder, and "dummy" random weights of the real shapes. Nothing is
ever downloaded: `model` must be a local path, or None for the embedded default model.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from voltllm.config import ModelConfig
from voltllm.layers.attention.backend import AttentionBackend
from voltllm.layers.quantization import get_quantization_config
from voltllm.layers.rotary import rope_max_positions, rope_parameters_of
from voltllm.loader.default_model import default_model_dir
from voltllm.loader.dummy import init_dummy_weights
from voltllm.loader.gguf_import import find_gguf_file, import_gguf
from voltllm.loader.weights import iterate_safetensors, safetensors_files
from voltllm.models.registry import get_model_class

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class LoadedModel:
    """A model ready to run, with the facts the engine reports in READY."""

    model: nn.Module
    hf_config: Any  # transformers.PretrainedConfig
    model_dir: Path
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    dtype: torch.dtype


def resolve_dtype(name: str, device: torch.device | str) -> torch.dtype:
    """`ModelConfig.dtype` as a torch dtype. "auto": fp16 on CUDA (Volta has no bf16 tensor cores),
    fp32 elsewhere."""
    if name == "auto":
        return torch.float16 if torch.device(device).type == "cuda" else torch.float32
    if name not in _DTYPES:
        raise ValueError(f"dtype must be one of auto, {', '.join(_DTYPES)}; got {name!r}")
    return _DTYPES[name]


def resolve_model_source(model_config: ModelConfig) -> tuple[Path, str]:
    """The HF folder to read and how to fill the weights ("safetensors" or "dummy"). GGUF sources are
    imported (or found in the cache) here."""
    load_format = model_config.load_format
    if model_config.model is None:
        model_dir = default_model_dir()
        return model_dir, "dummy" if load_format == "dummy" else "safetensors"

    path = Path(model_config.model).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"model path {str(path)!r} does not exist; voltllm loads local Hugging Face folders and "
            ".gguf files and never downloads"
        )
    is_gguf = load_format == "gguf" or (
        load_format in ("auto", "dummy") and (path.suffix == ".gguf" or _only_gguf_in(path))
    )
    if is_gguf:
        model_dir = import_gguf(find_gguf_file(path))
    elif path.is_dir():
        model_dir = path
    else:
        raise ValueError(
            f"{path} is a file; load_format={load_format!r} needs a Hugging Face model folder "
            "(or a .gguf file with load_format 'auto' or 'gguf')"
        )
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"{model_dir} has no config.json; it is not a Hugging Face model folder")
    return model_dir, "dummy" if load_format == "dummy" else "safetensors"


def _only_gguf_in(path: Path) -> bool:
    return path.is_dir() and not any(path.glob("*.safetensors")) and any(path.glob("*.gguf"))


def load_hf_config(model_dir: Path) -> Any:
    """Read `config.json` with transformers (local files only)."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(model_dir, local_files_only=True)
    except (ValueError, KeyError, OSError) as e:
        raise ValueError(f"cannot read the model config in {model_dir}: {e}") from e


def model_max_len(hf_config: Any) -> int:
    """The longest context the model supports: `max_position_embeddings` (llama3-scaled configs already
    state the scaled length), extended by the factor for YaRN."""
    value = getattr(hf_config, "max_position_embeddings", None)
    if not isinstance(value, int) or value <= 0:
        raise ValueError("the model config states no maximum context length (max_position_embeddings)")
    return rope_max_positions(rope_parameters_of(hf_config), value)


def eos_token_ids_of(model_dir: Path, hf_config: Any) -> list[int]:
    """End-of-sequence ids from generation_config.json first, then config.json, without duplicates."""
    ids: list[int] = []
    gen_path = model_dir / "generation_config.json"
    sources = [json.loads(gen_path.read_text()).get("eos_token_id")] if gen_path.is_file() else []
    sources.append(getattr(hf_config, "eos_token_id", None))
    for value in sources:
        for token_id in value if isinstance(value, list) else [value]:
            if isinstance(token_id, int) and token_id not in ids:
                ids.append(token_id)
    return ids


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Create parameters directly in the target dtype (no fp32 copy of a large model in memory)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def load_model(
    model_config: ModelConfig,
    device: torch.device | str,
    dtype: torch.dtype | None,
    attn_backend: AttentionBackend | Callable[[Any], AttentionBackend],
    progress: bool = True,
) -> LoadedModel:
    """Build the model named by `model_config` on `device` in `dtype` (None: from `model_config.dtype`)
    and fill its weights. `attn_backend` is a backend, or a function that picks one from the model's
    Hugging Face config. Raises FileNotFoundError / ValueError with the reason on bad input."""
    device = torch.device(device)
    dtype = dtype if dtype is not None else resolve_dtype(model_config.dtype, device)
    model_dir, weights_format = resolve_model_source(model_config)
    hf_config = load_hf_config(model_dir)
    model_class = get_model_class(hf_config)
    quant_config = get_quantization_config(hf_config, model_config.quantization)  # None: unquantized
    if not isinstance(attn_backend, AttentionBackend):
        attn_backend = attn_backend(hf_config)

    limit = model_max_len(hf_config)
    max_model_len = model_config.max_model_len or limit
    if max_model_len > limit:
        raise ValueError(f"max_model_len {max_model_len} exceeds the model's limit of {limit} tokens")

    with torch.device(device), _default_dtype(dtype):
        model = model_class(hf_config, attn_backend, quant_config=quant_config)
    if weights_format == "dummy":
        init_dummy_weights(model, model_config.seed)
    else:
        model.load_weights(iterate_safetensors(safetensors_files(model_dir), progress=progress))
    model.requires_grad_(False)
    model.eval()
    return LoadedModel(
        model=model,
        hf_config=hf_config,
        model_dir=model_dir,
        max_model_len=max_model_len,
        vocab_size=hf_config.vocab_size,
        eos_token_ids=eos_token_ids_of(model_dir, hf_config),
        dtype=dtype,
    )
