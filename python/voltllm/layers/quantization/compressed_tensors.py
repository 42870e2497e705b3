"""compressed-tensors checkpoints (`quant_method: compressed-tensors`), as llm-compressor writes them.

The config lists `config_groups`, each a scheme (`weights`, `input_activations`, `output_activations`,
optionally its own `format`) and the `targets` it applies to ("Linear", exact module names or
"re:<regex>"); `ignore` names modules left in full precision (same matching, it wins over targets).
Weight-only schemes are served:

- `pack-quantized` int4 / int8 (W4A16, W8A16), group or channel strategy, symmetric or asymmetric.
  Per linear layer, in the `nn.Linear` `[out, in]` orientation, with `p = 32 / bits`:
      weight_packed     [out, in / p]       int32, p consecutive input columns per word
      weight_scale      [out, groups]       (channel strategy: [out, 1])
      weight_zero_point [out / p, groups]   int32, asymmetric only, packed along the output rows
      weight_shape      [2]                 the unpacked [out, in]
  Codes and zero points are stored offset by `2 ** (bits - 1)` (the library quantizes to signed
  integers), so the stored values are the unsigned codes of `QuantizedWeight`, and a symmetric scheme's
  zero is the midpoint.
- `float-quantized` FP8 e4m3 weights (tensor, channel or block strategy), served as W8A16 by
  `Fp8LinearMethod`; dynamic FP8 activations (FP8_DYNAMIC) run in the model's dtype instead.

Refused, naming the reason: activation quantization (static input scales, int activations), output
activations, a KV-cache scheme, sparsity or transforms, other formats and bit widths, activation order by
group (`weight_g_idx`), and a quantized lm_head.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from voltllm.layers.linear_method import LinearMethodBase
from voltllm.layers.quantization.base import (
    QuantizationConfig,
    one_setting_for_all_shards,
    register_quantization_config,
)
from voltllm.layers.quantization.fp8 import Fp8LinearMethod
from voltllm.layers.quantization.packing import unpack_int32
from voltllm.layers.quantization.quantized_method import (
    QuantizedLinearMethod,
    random_int32_,
    random_scales_,
)
from voltllm.layers.quantization.quantized_weight import QuantizedWeight


@dataclass(frozen=True)
class WeightScheme:
    """One config group's weight quantization, as voltllm runs it."""

    kind: str  # "int" (pack-quantized) or "fp8" (float-quantized)
    bits: int
    strategy: str  # "group" / "channel" (int); "tensor" / "channel" / "block" (fp8)
    group_size: int | None = None
    symmetric: bool = True
    block_size: tuple[int, int] | None = None


def _parse_scheme(name: str, group: dict[str, Any], default_format: str | None) -> WeightScheme:
    """A config group as a `WeightScheme`; ValueError naming what voltllm does not run."""
    weights = group.get("weights")
    where = f"compressed-tensors config group {name!r}"
    if not weights:
        raise ValueError(f"{where} quantizes no weights (activation-only quantization is not supported)")
    if group.get("output_activations"):
        raise ValueError(f"{where} quantizes output activations, which voltllm does not run")
    fmt = group.get("format") or default_format
    kind, bits, strategy = weights.get("type", "int"), weights.get("num_bits"), weights.get("strategy")
    inputs = group.get("input_activations")
    fp8_dynamic_inputs = bool(inputs) and inputs.get("type") == "float" and inputs.get("dynamic") is True
    if inputs and not (kind == "float" and fp8_dynamic_inputs):
        raise ValueError(
            f"{where} quantizes input activations ({inputs.get('type')}, {inputs.get('num_bits')} bits, "
            f"dynamic={inputs.get('dynamic')}), which voltllm does not run (weight-only schemes)"
        )
    if weights.get("dynamic"):
        raise ValueError(f"{where} has dynamic weight quantization, which is not a stored format")
    if weights.get("actorder") in ("group", "dynamic"):
        raise ValueError(f"{where}: activation order by group (weight_g_idx) is not supported")
    if kind == "int":
        if fmt != "pack-quantized":
            raise ValueError(f"{where}: int weights in format {fmt!r} are not supported (pack-quantized)")
        if bits not in (4, 8):
            raise ValueError(f"{where}: {bits}-bit int weights are not supported (4 or 8)")
        if strategy not in ("group", "channel"):
            raise ValueError(f"{where}: int weights with strategy {strategy!r} are not supported")
        group_size = weights.get("group_size") if strategy == "group" else None
        if strategy == "group" and (not isinstance(group_size, int) or group_size <= 0):
            raise ValueError(f"{where}: group strategy needs a positive group_size, got {group_size!r}")
        return WeightScheme("int", bits, strategy, group_size, bool(weights.get("symmetric", True)))
    if kind == "float":
        if fmt != "float-quantized":
            raise ValueError(f"{where}: float weights in format {fmt!r} are not supported (float-quantized)")
        if bits != 8:
            raise ValueError(f"{where}: {bits}-bit float weights are not supported (FP8)")
        if strategy not in ("tensor", "channel", "block"):
            raise ValueError(f"{where}: FP8 weights with strategy {strategy!r} are not supported")
        if not weights.get("symmetric", True):
            raise ValueError(f"{where}: asymmetric FP8 weights are not supported")
        block = weights.get("block_structure") if strategy == "block" else None
        if strategy == "block" and (not block or len(block) != 2):
            raise ValueError(
                f"{where}: block strategy needs a block_structure [rows, columns], got {block!r}"
            )
        return WeightScheme("fp8", 8, strategy, block_size=tuple(block) if block else None)
    raise ValueError(f"{where}: weight type {kind!r} is not supported (int or float)")


def _matches(name: str, patterns: Iterable[str]) -> bool:
    """compressed-tensors' matching of a module name: exact, "re:<regex>" from the start, or the
    class name "Linear" (every linear layer voltllm builds is one)."""
    for pattern in patterns:
        if pattern.startswith("re:"):
            if re.match(pattern[3:], name):
                return True
        elif pattern in (name, "Linear"):
            return True
    return False


@register_quantization_config
class CompressedTensorsConfig(QuantizationConfig):
    name = "compressed-tensors"

    def __init__(self, schemes: list[tuple[list[str], WeightScheme]], ignore: list[str]) -> None:
        self.schemes = schemes
        self.ignore = ignore

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> CompressedTensorsConfig:
        for key in ("kv_cache_scheme", "transform_config"):
            if config.get(key):
                raise ValueError(f"compressed-tensors {key} is not supported")
        sparsity = config.get("sparsity_config") or {}
        if sparsity.get("format") not in (None, "dense"):
            raise ValueError(f"compressed-tensors sparsity ({sparsity.get('format')!r}) is not supported")
        groups = config.get("config_groups") or {}
        if not groups:
            raise ValueError("compressed-tensors config has no config_groups")
        schemes = [
            (list(group.get("targets") or []), _parse_scheme(name, group, config.get("format")))
            for name, group in groups.items()
        ]
        result = cls(schemes, list(config.get("ignore") or []))
        if result.scheme_for("lm_head") is not None:
            raise ValueError(
                "compressed-tensors with a quantized lm_head is not supported (add it to ignore)"
            )
        return result

    def scheme_for(self, module_name: str) -> WeightScheme | None:
        """The scheme the checkpoint applied to `module_name`, None if it left it in full precision."""
        if _matches(module_name, self.ignore):
            return None
        for targets, scheme in self.schemes:
            if _matches(module_name, targets):
                return scheme
        return None

    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethodBase | None:
        schemes = [self.scheme_for(name) for name in self.checkpoint_modules(prefix)]
        scheme = one_setting_for_all_shards(prefix, schemes, "quantization schemes")
        if scheme is None:
            return None
        if scheme.kind == "fp8":
            return Fp8LinearMethod(scheme.strategy, "weight_scale", scheme.block_size)
        return PackedIntLinearMethod(scheme)


class PackedIntLinearMethod(QuantizedLinearMethod):
    """pack-quantized int4 / int8: weight_packed, weight_scale, weight_zero_point, weight_shape."""

    def __init__(self, scheme: WeightScheme) -> None:
        super().__init__()
        self.scheme = scheme
        self.pack_factor = 32 // scheme.bits

    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
    ) -> None:
        scheme, pack = self.scheme, self.pack_factor
        self.check_packs(layer, [input_size_per_partition], pack, "input features")
        grouped = scheme.strategy == "group"
        self.group_size = scheme.group_size if grouped else input_size_per_partition
        sharded_input = input_size_per_partition != input_size
        if grouped and sharded_input and input_size_per_partition % self.group_size:
            raise ValueError(
                f"{layer.prefix}: {input_size_per_partition} input features per rank are not a multiple "
                f"of the group size {self.group_size}"
            )
        rows, groups = sum(output_partition_sizes), -(-input_size_per_partition // self.group_size)
        group_dim = {"input_dim": 1} if grouped else {}
        self.register(
            layer,
            "weight_packed",
            torch.empty(rows, input_size_per_partition // pack, dtype=torch.int32),
            output_dim=0,
            input_dim=1,
            packed_dim=1,
            pack_factor=pack,
        )
        self.register(
            layer, "weight_scale", torch.empty(rows, groups, dtype=torch.float32), output_dim=0, **group_dim
        )
        if not scheme.symmetric:
            self.check_packs(layer, output_partition_sizes, pack, "output features (zero points)")
            self.register(
                layer,
                "weight_zero_point",
                torch.empty(rows // pack, groups, dtype=torch.int32),
                output_dim=0,
                packed_dim=0,
                pack_factor=pack,
                **group_dim,
            )
        shape = self.register(
            layer, "weight_shape", torch.zeros(len(output_partition_sizes), 2, dtype=torch.int64)
        )
        shape.weight_loader = _ShardRowLoader(layer)

    def to_quantized_weight(self, layer: nn.Module) -> QuantizedWeight:
        self._check_shapes(layer)
        bits = self.scheme.bits
        zeros = None
        if not self.scheme.symmetric:
            zeros = unpack_int32(layer.weight_zero_point.data, bits, dim=0).contiguous()  # [out, groups]
        return QuantizedWeight(
            codes=unpack_int32(layer.weight_packed.data, bits, dim=1).contiguous(),  # [out, in]
            scales=layer.weight_scale.data.to(torch.float16),
            zeros=zeros,
            bits=bits,
            group_size=self.group_size,
        )

    def _check_shapes(self, layer: nn.Module) -> None:
        """weight_shape, the checkpoint's unpacked `[out, in]` of each shard, against the layer."""
        for i, (out_features, in_features) in enumerate(layer.weight_shape.data.tolist()):
            local_rows = layer.output_partition_sizes[i]
            rows_match = out_features == local_rows or layer.tp_size > 1  # a rank holds a slice
            if in_features != layer.input_size or not rows_match:
                raise ValueError(
                    f"{layer.prefix}: checkpoint weight_shape [{out_features}, {in_features}] does not match "
                    f"the layer's [{local_rows}, {layer.input_size}]"
                )

    def fill_dummy(self, layer: nn.Module, generator: torch.Generator) -> None:
        random_int32_(layer.weight_packed.data, generator)
        random_scales_(layer.weight_scale.data, generator, largest_code_distance=2**self.scheme.bits)
        if not self.scheme.symmetric:
            random_int32_(layer.weight_zero_point.data, generator)
        for i, size in enumerate(layer.output_partition_sizes):
            layer.weight_shape.data[i] = torch.tensor([size, layer.input_size])


class _ShardRowLoader:
    """Loads a per-checkpoint-tensor vector (weight_shape) into its shard's row of a
    `[num_shards, n]` parameter."""

    def __init__(self, layer: nn.Module) -> None:
        self.layer = layer

    def __call__(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | str | None = None) -> None:
        if shard_id is None and param.shape[0] > 1:
            raise ValueError(
                f"{self.layer.prefix}: one weight_shape for a fused layer of {param.shape[0]} shards"
            )
        index = 0 if shard_id is None else self.layer.shard_ids.index(shard_id)
        if loaded.shape != param.shape[1:]:
            raise ValueError(f"weight_shape {tuple(loaded.shape)} is not a pair [out, in]")
        with torch.no_grad():
            param.data[index] = loaded
