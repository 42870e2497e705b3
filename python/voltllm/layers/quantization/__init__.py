"""Quantized checkpoints: each format is a `QuantizationConfig` registered by its `quant_method`.

`base.py` holds the hook (the config class, its registry, `get_quantization_config`); each format's
module (`awq.py`, `gptq.py`, `compressed_tensors.py`, `fp8.py`) reads its checkpoint layout and converts
it, once loaded, to the one `QuantizedWeight` (`quantized_weight.py`) the kernels and the torch
reference compute with. Importing this package registers every format (each module registers its
config class when imported).
"""

from voltllm.layers.quantization import awq, compressed_tensors, fp8, gptq  # noqa: F401 - registration
from voltllm.layers.quantization.base import (
    QuantizationConfig,
    get_quantization_config,
    linear_method_for,
    register_quantization_config,
)

__all__ = [
    "QuantizationConfig",
    "get_quantization_config",
    "linear_method_for",
    "register_quantization_config",
]
