"""Random weights of a model's real shapes, for benchmarks that need no checkpoint."""

from __future__ import annotations

import torch
from torch import nn

from voltllm.layers.norm import RMSNorm

# Small, bounded values keep fp16 activations finite through any depth (norms are reset to 1).
DUMMY_WEIGHT_RANGE = 0.02


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int) -> None:
    """Fill every parameter deterministically from `seed`: norm weights 1, the rest uniform in
    +-DUMMY_WEIGHT_RANGE. Same seed, same device -> same weights."""
    generators: dict[torch.device, torch.Generator] = {}
    seen: set[int] = set()
    for module in model.modules():
        for param in module.parameters(recurse=False):
            if id(param) in seen:  # tied parameters are filled once
                continue
            seen.add(id(param))
            if isinstance(module, RMSNorm):
                param.fill_(1.0)
                continue
            if param.device not in generators:
                generators[param.device] = torch.Generator(device=param.device).manual_seed(seed)
            param.uniform_(-DUMMY_WEIGHT_RANGE, DUMMY_WEIGHT_RANGE, generator=generators[param.device])
