"""Import a GGUF checkpoint into a Hugging Face-style folder, once, so later runs load safetensors.

transformers reads and dequantizes the GGUF (config, weights, tokenizer with its chat template); the
weights are then written as fp16 safetensors. The folder is built under a temporary name next to its
destination and renamed into place, so a crashed or concurrent import never leaves a half-written
folder where a reader would take it for complete.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from voltllm.cache_dirs import models_cache_dir

IMPORT_RECORD = "voltllm_import.json"
IMPORT_DTYPE = torch.float16


class GGUFImportError(RuntimeError):
    """The GGUF file could not be converted."""


def find_gguf_file(path: Path) -> Path:
    """`path` itself if it is a `.gguf` file, else the single `.gguf` inside the folder `path`."""
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"{path} is not a .gguf file")
        return path
    candidates = sorted(path.glob("*.gguf"))
    if len(candidates) != 1:
        found = ", ".join(c.name for c in candidates) or "none"
        raise ValueError(f"expected exactly one .gguf file in {path}, found {found}; pass the file itself")
    return candidates[0]


def _fingerprint(gguf_path: Path) -> str:
    """Identifies the file's content cheaply (path, size, mtime): a changed file gets a new folder."""
    st = gguf_path.stat()
    key = f"{gguf_path.resolve()}:{st.st_size}:{st.st_mtime_ns}"
    return hashlib.sha256(key.encode()).hexdigest()[:12]


def gguf_cache_dir(gguf_path: Path) -> Path:
    """Default destination of an imported GGUF file."""
    return models_cache_dir() / "gguf" / f"{gguf_path.stem}-{_fingerprint(gguf_path)}"


def import_gguf(gguf_path: Path, out_dir: Path | None = None) -> Path:
    """Convert `gguf_path` into an HF folder at `out_dir` (default: `gguf_cache_dir`) unless it exists.

    Returns the folder. Safe against concurrent imports of the same file: the loser's copy is discarded.
    """
    gguf_path = find_gguf_file(Path(gguf_path))
    out_dir = Path(out_dir) if out_dir is not None else gguf_cache_dir(gguf_path)
    if (out_dir / IMPORT_RECORD).is_file():
        return out_dir
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        _convert(gguf_path, tmp_dir)
        _make_readable(tmp_dir)
        try:
            os.rename(tmp_dir, out_dir)
        except OSError as e:
            if not (out_dir / IMPORT_RECORD).is_file():  # not a lost race: something else sits there
                raise GGUFImportError(
                    f"{out_dir} exists but is not a finished voltllm import; remove it and retry"
                ) from e
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    return out_dir


def _convert(gguf_path: Path, dest: Path) -> None:
    # Everything needed is in the file; never let transformers reach for a model hub.
    os.environ["HF_HUB_OFFLINE"] = "1"
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src_dir, name = str(gguf_path.parent), gguf_path.name
    try:
        # fp32 is transformers' fast path for dequantizing; the cast to IMPORT_DTYPE happens on save.
        model = AutoModelForCausalLM.from_pretrained(
            src_dir, gguf_file=name, dtype=torch.float32, local_files_only=True
        )
        tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=name, local_files_only=True)
    except (ValueError, OSError, ImportError, KeyError) as e:
        raise GGUFImportError(f"cannot import {gguf_path} with transformers: {e}") from e

    _save_weights(model, dest)
    config = model.config
    # The weights are written dequantized; the GGUF quantization note would mislead readers.
    config.__dict__.pop("quantization_config", None)
    config.dtype = IMPORT_DTYPE  # what model.safetensors holds
    config.architectures = [type(model).__name__]  # transformers leaves it unset for GGUF loads
    config.save_pretrained(dest)
    model.generation_config.save_pretrained(dest)
    tokenizer.save_pretrained(dest)
    _ensure_chat_template(tokenizer.chat_template, dest)
    st = gguf_path.stat()
    record = {"source": str(gguf_path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    (dest / IMPORT_RECORD).write_text(json.dumps(record, indent=2) + "\n")


def _make_readable(folder: Path) -> None:
    """mkdtemp creates the folder owner-only; a shared cache should follow the umask like any folder."""
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask)
    for path in folder.iterdir():
        path.chmod(0o666 & ~umask)


def _save_weights(model: torch.nn.Module, dest: Path) -> None:
    from safetensors.torch import save_file

    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    tensors = {
        name: t.detach().to(IMPORT_DTYPE).contiguous()
        for name, t in model.state_dict().items()
        if not (tied and name == "lm_head.weight")
    }
    save_file(tensors, dest / "model.safetensors", metadata={"format": "pt"})


def _ensure_chat_template(template: str | None, dest: Path) -> None:
    """Front ends read the template from tokenizer_config.json or chat_template.jinja: write both."""
    if not template:
        return
    config_path = dest / "tokenizer_config.json"
    tok_config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    if tok_config.get("chat_template") != template:
        tok_config["chat_template"] = template
        config_path.write_text(json.dumps(tok_config, indent=2, ensure_ascii=False) + "\n")
    (dest / "chat_template.jinja").write_text(template)
