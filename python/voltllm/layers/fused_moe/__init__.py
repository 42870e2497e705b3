"""Mixture-of-experts layers: the router's top-k, the stacked experts and their weight methods."""

from voltllm.layers.fused_moe.experts_torch import (
    experts_dense,
    experts_gathered,
    experts_grouped,
    fused_experts,
)
from voltllm.layers.fused_moe.layer import FusedMoE
from voltllm.layers.fused_moe.method import (
    FusedMoEMethodBase,
    UnquantizedFusedMoEMethod,
    fused_moe_method_for,
)
from voltllm.layers.fused_moe.router import select_experts

__all__ = [
    "FusedMoE",
    "FusedMoEMethodBase",
    "UnquantizedFusedMoEMethod",
    "experts_dense",
    "experts_gathered",
    "experts_grouped",
    "fused_experts",
    "fused_moe_method_for",
    "select_experts",
]
