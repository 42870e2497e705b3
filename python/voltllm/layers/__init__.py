"""Model building blocks. Each op is a small torch function a CUDA kernel can replace; the linear and
embedding layers shard over the tensor-parallel group and take their weights from a linear method."""

from voltllm.layers.activation import SiluAndMul, silu_and_mul, swiglu
from voltllm.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from voltllm.layers.linear import (
    ColumnParallelLinear,
    LinearBase,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from voltllm.layers.linear_method import LinearMethodBase, UnquantizedLinearMethod, linear
from voltllm.layers.norm import RMSNorm, fused_add_rms_norm, rms_norm
from voltllm.layers.quantization import QuantizationConfig
from voltllm.layers.rotary import RotaryEmbedding, apply_rotary, rope_parameters_of

__all__ = [
    "ColumnParallelLinear",
    "LinearBase",
    "LinearMethodBase",
    "MergedColumnParallelLinear",
    "ParallelLMHead",
    "QKVParallelLinear",
    "QuantizationConfig",
    "RMSNorm",
    "ReplicatedLinear",
    "RotaryEmbedding",
    "RowParallelLinear",
    "SiluAndMul",
    "UnquantizedLinearMethod",
    "VocabParallelEmbedding",
    "apply_rotary",
    "fused_add_rms_norm",
    "linear",
    "rms_norm",
    "rope_parameters_of",
    "silu_and_mul",
    "swiglu",
]
