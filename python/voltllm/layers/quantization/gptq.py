"""GPTQ checkpoints (`quant_method: gptq`) as AutoGPTQ and GPTQModel write them: 4- or 8-bit codes.

Per linear layer, in the checkpoint's `[in, out]` orientation, with `p = 32 / bits` codes per word:
    qweight [in / p, out]       int32, p consecutive input rows per word (sequential order)
    qzeros  [groups, out / p]   int32, p consecutive output columns per word
    scales  [groups, out]       float16
    g_idx   [in]                int32, the group of each input row
    W[n, k] = (code[k, n] - zero[g_idx[k], n]) * scale[g_idx[k], n]

Checkpoint format v1 (`checkpoint_format: gptq`, AutoGPTQ's) stores each zero point minus one; v2
(`gptq_v2`, GPTQModel's) stores it as is. `group_size: -1` is one group over the whole input (per
output channel). `desc_act` (act-order) checkpoints quantized the input rows in a permuted order, so
`g_idx` is not `k // group_size`: it is carried into the `QuantizedWeight`. Without desc_act, `g_idx`
must be that contiguous grouping and is checked.

Tensor parallelism: a row-parallel layer slices the input rows (qweight, g_idx) and, without desc_act,
its groups too; with desc_act a rank's rows belong to any group, so it keeps every group's scales and
zeros. q/k/v (and gate/up) share their input, hence their act-order permutation: their g_idx must be
identical, or the fused matrix is refused.
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
from voltllm.layers.quantization.packing import unpack_int32
from voltllm.layers.quantization.quantized_method import (
    QuantizedLinearMethod,
    random_int32_,
    random_scales_,
)
from voltllm.layers.quantization.quantized_weight import QuantizedWeight

CHECKPOINT_FORMATS = {"gptq": 1, "gptq_v2": 2}  # the format name -> how zero points are stored


@register_quantization_config
class GPTQConfig(QuantizationConfig):
    name = "gptq"

    def __init__(
        self,
        bits: int,
        group_size: int,
        desc_act: bool,
        format_version: int,
        modules_to_not_convert: list[str],
    ) -> None:
        self.bits = bits
        self.group_size = group_size
        self.desc_act = desc_act
        self.format_version = format_version
        self.modules_to_not_convert = modules_to_not_convert

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> GPTQConfig:
        bits = config.get("bits")
        group_size = config.get("group_size", -1)
        checkpoint_format = config.get("checkpoint_format", config.get("format", "gptq"))
        if bits not in (4, 8):
            raise ValueError(f"GPTQ with {bits} bits is not supported (4 or 8)")
        if checkpoint_format not in CHECKPOINT_FORMATS:
            raise ValueError(
                f"GPTQ checkpoint_format {checkpoint_format!r} is not supported "
                f"({', '.join(CHECKPOINT_FORMATS)})"
            )
        if not isinstance(group_size, int) or (group_size <= 0 and group_size != -1):
            raise ValueError(f"GPTQ group_size {group_size!r} is not supported (positive, or -1 per channel)")
        if config.get("pack_dtype", "int32") != "int32":
            raise ValueError(f"GPTQ pack_dtype {config['pack_dtype']!r} is not supported (int32)")
        if config.get("lm_head"):
            raise ValueError("GPTQ with a quantized lm_head is not supported")
        if config.get("dynamic"):
            raise ValueError("GPTQ per-module overrides (dynamic) are not supported")
        return cls(
            bits,
            group_size,
            bool(config.get("desc_act", False)),
            CHECKPOINT_FORMATS[checkpoint_format],
            list(config.get("modules_to_not_convert") or []),
        )

    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethodBase | None:
        skipped = [
            any(name in module for name in self.modules_to_not_convert)
            for module in self.checkpoint_modules(prefix)
        ]
        if one_setting_for_all_shards(prefix, skipped, "modules_to_not_convert membership"):
            return None
        return GPTQLinearMethod(self)


class GPTQLinearMethod(QuantizedLinearMethod):
    """qweight (packed along the input) / qzeros (packed along the output) / scales / g_idx."""

    def __init__(self, config: GPTQConfig) -> None:
        super().__init__()
        self.config = config
        self.pack_factor = 32 // config.bits

    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
    ) -> None:
        config, pack = self.config, self.pack_factor
        group = config.group_size if config.group_size != -1 else input_size
        self.check_packs(layer, [input_size_per_partition], pack, "input features")
        self.check_packs(layer, output_partition_sizes, pack, "output features")
        sharded_input = input_size_per_partition != input_size
        # Groups follow the rank's input rows only for contiguous groups that tile them.
        shard_groups = sharded_input and not config.desc_act and config.group_size != -1
        if shard_groups and input_size_per_partition % group:
            raise ValueError(
                f"{layer.prefix}: {input_size_per_partition} input features per rank are not a multiple "
                f"of the GPTQ group size {group}"
            )
        groups = input_size_per_partition // group if shard_groups else -(-input_size // group)
        rows = sum(output_partition_sizes)
        group_dim = {"input_dim": 0} if shard_groups else {}
        self.register(
            layer,
            "qweight",
            torch.empty(input_size_per_partition // pack, rows, dtype=torch.int32),
            input_dim=0,
            output_dim=1,
            packed_dim=0,
            pack_factor=pack,
        )
        self.register(
            layer,
            "qzeros",
            torch.empty(groups, rows // pack, dtype=torch.int32),
            output_dim=1,
            packed_dim=1,
            pack_factor=pack,
            **group_dim,
        )
        self.register(
            layer, "scales", torch.empty(groups, rows, dtype=torch.float16), output_dim=1, **group_dim
        )
        g_idx = self.register(
            layer, "g_idx", torch.empty(input_size_per_partition, dtype=torch.int32), input_dim=0
        )
        g_idx.weight_loader = _SharedAcrossShards(layer, "g_idx")
        self.group = group
        self.first_group = layer.tp_rank * groups if shard_groups else 0  # this rank's first group

    def to_quantized_weight(self, layer: nn.Module) -> QuantizedWeight:
        bits = self.config.bits
        codes = unpack_int32(layer.qweight.data, bits, dim=0)  # [in, out]
        zeros = unpack_int32(layer.qzeros.data, bits, dim=1)  # [groups, out]
        if self.config.format_version == 1:
            if bits == 8 and bool((zeros == 255).any()):
                raise ValueError(f"{layer.prefix}: a v1 zero point of 256 does not fit 8 bits")
            zeros = zeros + 1  # a stored 15 (4-bit) means 16: representable in uint8, as v1 kernels read it
        g_idx = layer.g_idx.data
        contiguous = (
            torch.arange(g_idx.numel(), device=g_idx.device) + self.first_group * self.group
        ) // self.group
        if not self.config.desc_act and not torch.equal(g_idx.long(), contiguous):
            raise ValueError(f"{layer.prefix}: g_idx reorders the groups but the config has desc_act false")
        return QuantizedWeight(
            codes=codes.t().contiguous(),
            scales=layer.scales.data.t().contiguous(),
            zeros=zeros.t().contiguous(),
            bits=bits,
            group_size=self.group,
            g_idx=g_idx.clone() if self.config.desc_act else None,
        )

    def fill_dummy(self, layer: nn.Module, generator: torch.Generator) -> None:
        bits = self.config.bits
        random_int32_(layer.qweight.data, generator)
        random_int32_(layer.qzeros.data, generator)
        random_scales_(layer.scales.data, generator, largest_code_distance=2**bits)
        if self.config.format_version == 1 and bits == 8:
            layer.qzeros.data &= 0x7F7F7F7F  # no stored 255 (a zero point of 256)
        groups = torch.arange(layer.g_idx.numel(), device=layer.g_idx.device)
        layer.g_idx.data.copy_((groups + self.first_group * self.group) // self.group)


class _SharedAcrossShards:
    """Loader of a tensor that every shard of a fused layer carries and that must agree (GPTQ's g_idx):
    the first shard's is loaded, the later ones are compared with it."""

    def __init__(self, layer: nn.Module, name: str) -> None:
        self.layer = layer
        self.name = name
        self.first: torch.Tensor | None = None

    def __call__(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | str | None = None) -> None:
        if self.first is None:
            self.layer.weight_loader(param, loaded, shard_id)
            self.first = loaded
        elif not torch.equal(loaded, self.first):
            raise ValueError(
                f"{self.layer.prefix}: shard {shard_id!r} has a different {self.name} from the others; "
                "shards of one fused matrix must share it"
            )
