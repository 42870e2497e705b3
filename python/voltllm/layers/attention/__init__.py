"""Attention backends behind one interface (`backend.AttentionBackend`)."""

from voltllm.layers.attention.backend import AttentionBackend, AttentionMetadata, AttentionSpec

__all__ = ["AttentionBackend", "AttentionMetadata", "AttentionSpec"]
