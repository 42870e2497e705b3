"""Weight loading: Hugging Face safetensors folders, GGUF import, dummy weights, the default model."""

from voltllm.loader.default_model import DefaultModelMissingError, default_model_dir
from voltllm.loader.gguf_import import GGUFImportError, import_gguf
from voltllm.loader.loader import LoadedModel, load_model, resolve_dtype

__all__ = [
    "DefaultModelMissingError",
    "GGUFImportError",
    "LoadedModel",
    "default_model_dir",
    "import_gguf",
    "load_model",
    "resolve_dtype",
]
