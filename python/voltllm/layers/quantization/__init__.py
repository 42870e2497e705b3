"""The quantization hook: a checkpoint's `quantization_config` picks the linear method of each layer.

A format is a `QuantizationConfig` subclass registered under its `quant_method` name (the value in
`config.json`), plus the `LinearMethodBase` it returns: the method creates the format's parameters
(e.g. qweight / qzeros / scales), loads them through the layers' shard-aware loaders and computes with
its own kernel. No format is implemented yet; a checkpoint that names one is refused with the reason.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from torch import nn

from voltllm.layers.linear_method import LinearMethodBase, UnquantizedLinearMethod


class QuantizationConfig(ABC):
    """One quantization format's settings, read from the checkpoint's `quantization_config`."""

    name: str = "abstract"  # the `quant_method` value in config.json

    @classmethod
    @abstractmethod
    def from_config(cls, config: dict[str, Any]) -> QuantizationConfig:
        """Build from the checkpoint's `quantization_config` dict."""

    @abstractmethod
    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethodBase | None:
        """The method for the linear layer `prefix` (e.g. "model.layers.0.mlp.down_proj"); None keeps it
        unquantized (formats often leave some layers in full precision)."""


_CONFIGS: dict[str, type[QuantizationConfig]] = {}


def register_quantization_config(config_class: type[QuantizationConfig]) -> type[QuantizationConfig]:
    """Make a format loadable by its `name` (usable as a class decorator)."""
    _CONFIGS[config_class.name] = config_class
    return config_class


def get_quantization_config(hf_config: Any) -> QuantizationConfig | None:
    """The format named by `hf_config.quantization_config`, or None for an unquantized checkpoint.

    Raises ValueError for a format voltllm does not implement.
    """
    raw = getattr(hf_config, "quantization_config", None)
    if raw is None:
        return None
    raw = raw if isinstance(raw, dict) else raw.to_dict()
    method = raw.get("quant_method")
    if method not in _CONFIGS:
        supported = ", ".join(sorted(_CONFIGS)) or "none yet"
        raise ValueError(f"quantization method {method!r} is not supported (supported: {supported})")
    return _CONFIGS[method].from_config(raw)


def linear_method_for(
    quant_config: QuantizationConfig | None, layer: nn.Module, prefix: str
) -> LinearMethodBase:
    """The method `quant_config` picks for `layer`, the unquantized one when there is none."""
    method = quant_config.get_linear_method(layer, prefix) if quant_config is not None else None
    return method if method is not None else UnquantizedLinearMethod()
