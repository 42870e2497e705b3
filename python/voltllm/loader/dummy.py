"""Random weights of a model's real shapes, for benchmarks that need no checkpoint.

A quantized model gets random checkpoint-layout tensors (packed codes, zero points, scales) from its
format's method, directly on the model's device, and each layer is converted (`process_weights_after_
loading`) right after it is filled: the model never holds a dense or unpacked copy of more than one
layer, so a Qwen3-32B-shape AWQ model fits in its packed size.
"""

from __future__ import annotations

import torch
from torch import nn

from voltllm.layers.fused_moe.quantized import QuantizedFusedMoEMethod
from voltllm.layers.norm import RMSNorm
from voltllm.layers.quantization.quantized_method import DUMMY_WEIGHT_RANGE, QuantizedLinearMethod
from voltllm.models.checkpoint import process_weights_after_loading

__all__ = ["DUMMY_WEIGHT_RANGE", "init_dummy_weights"]


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int) -> None:
    """Fill every parameter deterministically from `seed`: norm weights 1, quantized layers as their
    format's `fill_dummy` says, the rest uniform in +-DUMMY_WEIGHT_RANGE; then let every weight method
    convert its layer. Same seed, same device -> same weights."""
    generators: dict[torch.device, torch.Generator] = {}

    def generator(device: torch.device) -> torch.Generator:
        if device not in generators:
            generators[device] = torch.Generator(device=device).manual_seed(seed)
        return generators[device]

    seen: set[int] = set()
    for module in model.modules():
        method = getattr(module, "linear_method", None)
        quantized = method if isinstance(method, QuantizedLinearMethod) else None
        moe_method = getattr(module, "moe_method", None)
        if isinstance(moe_method, QuantizedFusedMoEMethod):
            quantized = moe_method  # the same checkpoint_params / fill_dummy interface
        own = set(quantized.checkpoint_params) if quantized is not None else set()
        for name, param in module.named_parameters(recurse=False):
            if id(param) in seen or name in own:  # tied parameters are filled once
                continue
            seen.add(id(param))
            if isinstance(module, RMSNorm):
                param.fill_(1.0)
            else:
                param.uniform_(-DUMMY_WEIGHT_RANGE, DUMMY_WEIGHT_RANGE, generator=generator(param.device))
        if quantized is not None:
            device = getattr(module, quantized.checkpoint_params[0]).device
            quantized.fill_dummy(module, generator(device))
        process_weights_after_loading(module)
