"""Maps a checkpoint's `config.json` `architectures` to the voltllm model class that runs it."""

from __future__ import annotations

from typing import Any

from torch import nn

from voltllm.models.decoder import VARIANTS, DecoderForCausalLM, architecture_names

_MODEL_CLASSES: dict[str, type[nn.Module]] = {arch: DecoderForCausalLM for arch in VARIANTS}


class UnsupportedArchitectureError(ValueError):
    """The checkpoint's architecture has no voltllm implementation."""


def supported_architectures() -> list[str]:
    return sorted(_MODEL_CLASSES)


def get_model_class(hf_config: Any) -> type[nn.Module]:
    """The model class for the first supported entry of `hf_config.architectures` (or, when the config
    names none, for its `model_type`). Raises UnsupportedArchitectureError otherwise."""
    architectures = architecture_names(hf_config)
    for arch in architectures:
        if arch in _MODEL_CLASSES:
            return _MODEL_CLASSES[arch]
    named = architectures or getattr(hf_config, "model_type", None) or "(none in config.json)"
    raise UnsupportedArchitectureError(
        f"unsupported model architecture {named}; voltllm supports: {', '.join(supported_architectures())}"
    )
