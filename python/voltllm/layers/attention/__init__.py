"""Attention backends behind one interface (`backend.AttentionBackend`)."""

from voltllm.layers.attention.backend import (
    AttentionBackend,
    AttentionMetadata,
    AttentionPrologue,
    AttentionSpec,
)
from voltllm.layers.attention.layer import Attention
from voltllm.layers.attention.selector import (
    available_attention_backends,
    get_attention_backend,
    register_attention_backend,
)
from voltllm.layers.attention.torch_ref import TorchAttentionBackend

__all__ = [
    "Attention",
    "AttentionBackend",
    "AttentionMetadata",
    "AttentionPrologue",
    "AttentionSpec",
    "TorchAttentionBackend",
    "available_attention_backends",
    "get_attention_backend",
    "register_attention_backend",
]
