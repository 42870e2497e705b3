"""The quantization hook: a checkpoint's `quantization_config` picks the linear method of each layer.

A format is a `QuantizationConfig` subclass registered under its `quant_method` name (the value in
`config.json`), plus the `LinearMethodBase` it returns: the method creates the format's parameters
(e.g. qweight / qzeros / scales), loads them through the layers' shard-aware loaders and, once loaded,
converts them to a `QuantizedWeight` (`quantized_method.py`). A checkpoint that names a method voltllm
does not implement, or a combination a format does not run, is refused with the reason.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

from torch import nn

from voltllm.config import QUANTIZATION_METHODS
from voltllm.layers.linear_method import LinearMethodBase, UnquantizedLinearMethod


class QuantizationConfig(ABC):
    """One quantization format's settings, read from the checkpoint's `quantization_config`."""

    name: str = "abstract"  # the `quant_method` value in config.json

    # Fused layer name -> the checkpoint modules it holds ("qkv_proj" -> q/k/v_proj), set by the model
    # before it builds its layers, so that per-module settings (modules_to_not_convert, ignore, targets)
    # can be checked against the names the checkpoint uses.
    packed_modules_mapping: dict[str, tuple[str, ...]]

    @classmethod
    @abstractmethod
    def from_config(cls, config: dict[str, Any]) -> QuantizationConfig:
        """Build from the checkpoint's `quantization_config` dict. Raises ValueError naming what
        voltllm does not run."""

    @abstractmethod
    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethodBase | None:
        """The method for the linear layer `prefix` (e.g. "model.layers.0.mlp.down_proj"); None keeps it
        unquantized (formats often leave some layers in full precision)."""

    def checkpoint_modules(self, prefix: str) -> list[str]:
        """The checkpoint's module names behind the layer `prefix`: one, or each shard of a fused layer
        (`model.layers.0.self_attn.qkv_proj` -> its q_proj, k_proj and v_proj)."""
        head, _, last = prefix.rpartition(".")
        parts = getattr(self, "packed_modules_mapping", {}).get(last)
        if not parts:
            return [prefix]
        return [f"{head}.{part}" if head else part for part in parts]


def one_setting_for_all_shards(prefix: str, settings: Sequence[Any], what: str) -> Any:
    """The one value `settings` (one per checkpoint module of the layer `prefix`) agree on; a fused
    layer whose shards a checkpoint quantized differently cannot be one matrix, so it is refused."""
    if any(s != settings[0] for s in settings[1:]):
        raise ValueError(
            f"{prefix}: its fused shards have different {what} ({settings}); voltllm cannot fuse them"
        )
    return settings[0]


_CONFIGS: dict[str, type[QuantizationConfig]] = {}


def register_quantization_config(config_class: type[QuantizationConfig]) -> type[QuantizationConfig]:
    """Make a format loadable by its `name` (usable as a class decorator)."""
    _CONFIGS[config_class.name] = config_class
    return config_class


def get_quantization_config(hf_config: Any, requested: str | None = None) -> QuantizationConfig | None:
    """The format named by `hf_config.quantization_config`, or None for an unquantized checkpoint.

    `requested` is the user's `--quantization` (vLLM's spelling): it must agree with the checkpoint.
    Raises ValueError for a format voltllm does not implement, a disagreement, or a request to quantize
    a checkpoint that is not quantized (voltllm serves checkpoints quantized ahead of time).
    """
    if requested is not None and requested not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization {requested!r} is not one of {', '.join(QUANTIZATION_METHODS)}")
    raw = getattr(hf_config, "quantization_config", None)
    if raw is None:
        if requested is not None:
            raise ValueError(
                f"quantization {requested!r} was asked for but the checkpoint has no quantization_config: "
                "voltllm serves checkpoints quantized ahead of time and does not quantize at load"
            )
        return None
    raw = raw if isinstance(raw, dict) else raw.to_dict()
    method = raw.get("quant_method")
    if requested is not None and requested != method:
        raise ValueError(
            f"quantization {requested!r} was asked for but the checkpoint's quantization_config says "
            f"quant_method {method!r}"
        )
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
