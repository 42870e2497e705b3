"""FP8 checkpoints (`quant_method: fp8`): e4m3 weights, served as W8A16 (Volta has no FP8 arithmetic).

Per linear layer, in the `nn.Linear` `[out, in]` orientation:
    weight [out, in] float8_e4m3fn
    block scales (`weight_block_size: [bn, bk]`, Qwen3-FP8, DeepSeek):
        weight_scale_inv [ceil(out / bn), ceil(in / bk)] float32
        W[n, k] = weight[n, k] * weight_scale_inv[n // bn, k // bk]   (despite its name, a multiplier)
    otherwise one scale per checkpoint tensor:
        weight_scale [] float32:  W = weight * weight_scale

The weights stay 8-bit in memory; the kernels (or the torch reference) convert them. Activations stay
in the model's dtype: `activation_scheme: dynamic` (activations quantized on the fly by FP8 GPUs) is
served as W8A16, while `static` (checkpoint input scales: activation quantization) is refused.
`ignored_layers` / `modules_to_not_convert` name layers left in full precision.

`Fp8LinearMethod` also serves compressed-tensors' float-quantized weights (`compressed_tensors.py`),
which add a per-output-channel scale `[out, 1]`.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import nn

from voltllm.layers.linear_method import LinearMethodBase
from voltllm.layers.quantization.base import (
    QuantizationConfig,
    one_setting_for_all_shards,
    register_quantization_config,
)
from voltllm.layers.quantization.quantized_method import DUMMY_WEIGHT_RANGE, QuantizedLinearMethod
from voltllm.layers.quantization.quantized_weight import QuantizedWeight

ScaleStrategy = Literal["tensor", "channel", "block"]
E4M3_MAX = 448.0


@register_quantization_config
class Fp8Config(QuantizationConfig):
    name = "fp8"

    def __init__(self, block_size: tuple[int, int] | None, ignored_layers: list[str]) -> None:
        self.block_size = block_size
        self.ignored_layers = ignored_layers

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Fp8Config:
        fmt = config.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise ValueError(f"FP8 format {fmt!r} is not supported (e4m3)")
        scheme = config.get("activation_scheme", "dynamic")
        if scheme != "dynamic":
            raise ValueError(
                f"FP8 activation_scheme {scheme!r} quantizes activations, which voltllm does not run "
                "(weights-only: 'dynamic' is served as W8A16)"
            )
        block = config.get("weight_block_size")
        if block is not None and (len(block) != 2 or any(not isinstance(b, int) or b <= 0 for b in block)):
            raise ValueError(f"FP8 weight_block_size {block!r} is not [block_n, block_k]")
        ignored = list(config.get("ignored_layers") or []) + list(config.get("modules_to_not_convert") or [])
        return cls(tuple(block) if block is not None else None, ignored)

    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethodBase | None:
        skipped = [_listed(name, self.ignored_layers) for name in self.checkpoint_modules(prefix)]
        if one_setting_for_all_shards(prefix, skipped, "ignored_layers membership"):
            return None
        if self.block_size is not None:
            return Fp8LinearMethod("block", "weight_scale_inv", self.block_size)
        return Fp8LinearMethod("tensor", "weight_scale")


def _listed(module_name: str, names: list[str]) -> bool:
    """A module named exactly, or by a trailing part of its name ("lm_head", "mlp.gate")."""
    return any(module_name == name or module_name.endswith(f".{name}") for name in names)


class Fp8LinearMethod(QuantizedLinearMethod):
    """e4m3 `weight [out, in]` with block, per-channel or per-tensor scales (`scale_name`)."""

    def __init__(
        self, strategy: ScaleStrategy, scale_name: str, block_size: tuple[int, int] | None = None
    ) -> None:
        super().__init__()
        self.strategy = strategy
        self.scale_name = scale_name
        self.block_size = block_size

    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
    ) -> None:
        rows = sum(output_partition_sizes)
        self.register(
            layer,
            "weight",
            torch.empty(rows, input_size_per_partition, dtype=torch.float8_e4m3fn),
            output_dim=0,
            input_dim=1,
        )
        if self.strategy == "block":
            self._block_scales(layer, input_size_per_partition, output_partition_sizes, input_size)
        elif self.strategy == "channel":
            self.register(layer, self.scale_name, torch.empty(rows, 1, dtype=torch.float32), output_dim=0)
        else:  # one scalar per checkpoint tensor, i.e. per shard of a fused layer
            scale = self.register(
                layer, self.scale_name, torch.empty(len(output_partition_sizes), dtype=torch.float32)
            )
            scale.weight_loader = _ShardScalarLoader(layer)

    def _block_scales(
        self, layer: nn.Module, input_per_partition: int, output_partition_sizes: list[int], input_size: int
    ) -> None:
        block_n, block_k = self.block_size
        rows = sum(output_partition_sizes)
        # Several shards (q/k/v, gate/up, or a rank's slice) each take whole blocks of rows; a single
        # unsharded matrix may end in a partial block.
        if len(output_partition_sizes) > 1 or layer.tp_size > 1:
            for size in output_partition_sizes:
                if size % block_n:
                    raise ValueError(
                        f"{layer.prefix}: {size} output features per shard are not a multiple of the FP8 "
                        f"block size {block_n}"
                    )
        if input_per_partition != input_size and input_per_partition % block_k:
            raise ValueError(
                f"{layer.prefix}: {input_per_partition} input features per rank are not a multiple of "
                f"the FP8 block size {block_k}"
            )
        shape = (-(-rows // block_n), -(-input_per_partition // block_k))
        attrs: dict[str, Any] = {"input_dim": 1}
        if rows % block_n == 0:  # shards' row offsets count whole blocks
            attrs.update(output_dim=0, packed_dim=0, pack_factor=block_n)
        # else one unsharded matrix ending in a partial block: its scales load whole
        self.register(layer, self.scale_name, torch.empty(shape, dtype=torch.float32), **attrs)

    def to_quantized_weight(self, layer: nn.Module) -> QuantizedWeight:
        weight = layer.weight.data
        rows, cols = weight.shape
        scale = getattr(layer, self.scale_name).data
        if self.strategy == "block":
            block_n, block_k = self.block_size
            scales, group_size = scale.repeat_interleave(block_n, dim=0)[:rows], block_k
        elif self.strategy == "channel":
            scales, group_size = scale, cols
        else:
            sizes = torch.tensor(layer.output_partition_sizes, device=scale.device)
            scales, group_size = scale.repeat_interleave(sizes).unsqueeze(1), cols
        return QuantizedWeight(
            codes=weight.view(torch.uint8),
            scales=scales.float().contiguous(),
            zeros=None,
            bits=8,
            group_size=group_size,
            kind="fp8",
        )

    def fill_dummy(self, layer: nn.Module, generator: torch.Generator) -> None:
        weight = layer.weight.data
        values = torch.empty(weight.shape, dtype=torch.float16, device=weight.device)
        weight.copy_(values.uniform_(-E4M3_MAX, E4M3_MAX, generator=generator))
        getattr(layer, self.scale_name).data.fill_(DUMMY_WEIGHT_RANGE / E4M3_MAX)


class _ShardScalarLoader:
    """Loads one checkpoint tensor's scalar scale into its shard's entry of a `[num_shards]` parameter
    (a fused layer keeps every shard's own scale)."""

    def __init__(self, layer: nn.Module) -> None:
        self.layer = layer

    def __call__(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | str | None = None) -> None:
        if loaded.numel() != 1:
            raise ValueError(
                f"a per-tensor scale has one value, got shape {tuple(loaded.shape)} "
                "(per-channel scales need a channel-strategy config)"
            )
        with torch.no_grad():
            if shard_id is None:
                param.data.fill_(loaded.item())  # the whole (possibly prefused) matrix
            else:
                param.data[self.layer.shard_ids.index(shard_id)] = loaded.reshape(())
