"""Model building blocks. Each op is a small torch function a CUDA kernel can later replace."""

from voltllm.layers.activation import SiluAndMul, silu_and_mul
from voltllm.layers.embedding import LMHead, VocabEmbedding
from voltllm.layers.linear import Linear, MergedLinear, linear
from voltllm.layers.norm import RMSNorm, fused_add_rms_norm, rms_norm
from voltllm.layers.rotary import RotaryEmbedding, apply_rotary, rope_parameters_of

__all__ = [
    "LMHead",
    "Linear",
    "MergedLinear",
    "RMSNorm",
    "RotaryEmbedding",
    "SiluAndMul",
    "VocabEmbedding",
    "apply_rotary",
    "fused_add_rms_norm",
    "linear",
    "rms_norm",
    "rope_parameters_of",
    "silu_and_mul",
]
