"""Reading Hugging Face safetensors checkpoints: one file or an index of shards, memory-mapped."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from tqdm.auto import tqdm

INDEX_FILE = "model.safetensors.index.json"


def safetensors_files(model_dir: Path) -> list[Path]:
    """The checkpoint's weight files: those named by the shard index if there is one, else every
    `*.safetensors` in the folder. Raises FileNotFoundError when there are none or a shard is missing."""
    index_path = model_dir / INDEX_FILE
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{index_path} is not a valid safetensors index: {e}") from e
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{index_path} names shards that do not exist: {', '.join(missing)}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir}")
    return files


def iterate_safetensors(files: list[Path], progress: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(name, tensor)` for every tensor of `files`. Tensors are CPU views of the memory-mapped
    file, so only what the caller copies is ever read from disk."""
    total = 0
    for path in files:
        try:
            with safe_open(path, framework="pt", device="cpu") as f:
                total += len(f.keys())
        except SafetensorError as e:  # reading every header first means no half-loaded model on failure
            raise ValueError(f"{path} is not a readable safetensors file: {e}") from e
    with tqdm(total=total, desc="Loading weights", unit="tensor", disable=not progress) as bar:
        for path in files:
            with safe_open(path, framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                    yield name, f.get_tensor(name)
                    bar.update(1)
