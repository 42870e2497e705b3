"""Model implementations and the architecture registry."""

from voltllm.models.decoder import DecoderForCausalLM, DecoderVariant
from voltllm.models.registry import UnsupportedArchitectureError, get_model_class, supported_architectures

__all__ = [
    "DecoderForCausalLM",
    "DecoderVariant",
    "UnsupportedArchitectureError",
    "get_model_class",
    "supported_architectures",
]
