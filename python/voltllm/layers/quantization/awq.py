"""AWQ checkpoints (`quant_method: awq`), AutoAWQ's GEMM layout: 4-bit codes with zero points.

Per linear layer, in the checkpoint's `[in, out]` orientation (transposed from `nn.Linear`):
    qweight [in, out / 8]          int32, eight output columns per word in AutoAWQ's interleaved order
    qzeros  [in / group, out / 8]  int32, packed the same way
    scales  [in / group, out]      float16
    W[n, k] = (code[k, n] - zero[k // group, n]) * scale[k // group, n]

Only the GEMM version is read: GEMV, GEMV-fast and Marlin checkpoints pack differently and are refused,
as are other bit widths and checkpoints without zero points. `modules_to_not_convert` names modules
AutoAWQ left in full precision, matched as AutoAWQ does (a substring of the module name).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from voltllm.layers.linear_method import LinearMethodBase
from voltllm.layers.quantization.base import (
    QuantizationConfig,
    one_setting_for_all_shards,
    register_quantization_config,
)
from voltllm.layers.quantization.packing import AWQ_REVERSE_ORDER, unpack_int32
from voltllm.layers.quantization.quantized_method import (
    QuantizedLinearMethod,
    random_int32_,
    random_scales_,
)
from voltllm.layers.quantization.quantized_weight import QuantizedWeight

PACK_FACTOR = 8  # 4-bit codes per int32


@register_quantization_config
class AWQConfig(QuantizationConfig):
    name = "awq"

    def __init__(self, group_size: int, modules_to_not_convert: list[str]) -> None:
        self.group_size = group_size
        self.modules_to_not_convert = modules_to_not_convert

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> AWQConfig:
        bits = config.get("bits", config.get("w_bit"))
        group_size = config.get("group_size", config.get("q_group_size"))
        version = str(config.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"AWQ version {version!r} is not supported: voltllm reads the GEMM layout only")
        if bits != 4:
            raise ValueError(f"AWQ with {bits} bits is not supported (4-bit only)")
        if not config.get("zero_point", True):
            raise ValueError("AWQ without zero points (zero_point: false) is not supported")
        if not isinstance(group_size, int) or group_size <= 0:
            raise ValueError(f"AWQ group_size {group_size!r} is not supported (a positive group size)")
        return cls(group_size, list(config.get("modules_to_not_convert") or []))

    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethodBase | None:
        skipped = [self._skipped(name) for name in self.checkpoint_modules(prefix)]
        if one_setting_for_all_shards(prefix, skipped, "modules_to_not_convert membership"):
            return None
        return AWQLinearMethod(self.group_size)

    def _skipped(self, module_name: str) -> bool:
        return any(name in module_name for name in self.modules_to_not_convert)


class AWQLinearMethod(QuantizedLinearMethod):
    """qweight / qzeros / scales as AutoAWQ writes them; the output dimension is the packed one."""

    def __init__(self, group_size: int) -> None:
        super().__init__()
        self.group_size = group_size

    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
    ) -> None:
        group = self.group_size
        if input_size_per_partition % group:
            raise ValueError(
                f"{layer.prefix}: {input_size_per_partition} input features per rank are not a multiple "
                f"of the AWQ group size {group}"
            )
        self.check_packs(layer, output_partition_sizes, PACK_FACTOR, "output features")
        rows, groups = sum(output_partition_sizes), input_size_per_partition // group
        packed = {"input_dim": 0, "output_dim": 1, "packed_dim": 1, "pack_factor": PACK_FACTOR}
        words = rows // PACK_FACTOR
        self.register(
            layer, "qweight", torch.empty(input_size_per_partition, words, dtype=torch.int32), **packed
        )
        self.register(layer, "qzeros", torch.empty(groups, words, dtype=torch.int32), **packed)
        self.register(
            layer, "scales", torch.empty(groups, rows, dtype=torch.float16), input_dim=0, output_dim=1
        )

    def to_quantized_weight(self, layer: nn.Module) -> QuantizedWeight:
        codes = unpack_int32(layer.qweight.data, 4, dim=1, order=AWQ_REVERSE_ORDER)  # [in, out]
        zeros = unpack_int32(layer.qzeros.data, 4, dim=1, order=AWQ_REVERSE_ORDER)  # [groups, out]
        return QuantizedWeight(
            codes=codes.t().contiguous(),
            scales=layer.scales.data.t().contiguous(),
            zeros=zeros.t().contiguous(),
            bits=4,
            group_size=self.group_size,
        )

    def fill_dummy(self, layer: nn.Module, generator: torch.Generator) -> None:
        random_int32_(layer.qweight.data, generator)
        random_int32_(layer.qzeros.data, generator)
        random_scales_(layer.scales.data, generator, largest_code_distance=15)
