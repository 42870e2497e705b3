"""Linear layers that decide each tensor-parallel rank's shard of their matrix.

The layer decides the shard and where the collective happens; its linear method
(`voltllm.layers.linear_method`, picked by the `QuantizationConfig`) decides the parameters and the
arithmetic. Weights are `[out_features, in_features]`, as in `torch.nn.Linear` and checkpoints.

- `ReplicatedLinear`: every rank holds the whole matrix.
- `ColumnParallelLinear`: rank r holds rows (output features) r of tp_size; the output stays sharded
  unless `gather_output`.
- `MergedColumnParallelLinear`: several column layers over one input in one matrix (gate/up); each
  rank holds its slice of every shard, so `[gate_r | up_r]` and SwiGLU of the local output is the
  rank's slice of the activation (`swiglu=True` returns that activation).
- `QKVParallelLinear`: q/k/v sharded by heads; when tp_size exceeds the KV heads, each rank holds one
  KV head and ranks share it (replicated).
- `RowParallelLinear`: rank r holds columns (input features) r of tp_size of a sharded input; the
  outputs are summed over the ranks (all-reduce), the bias added once.

Pre-norm blocks pass a `ResidualStream` from one sublayer to the next: the residual and the last
sublayer's output, which the next norm adds in. A column layer after a norm takes the stream
(`stream_forward`: its method may fold the add + norm into its kernel); a row layer that ends a block
puts its output into the stream (`add_to_stream`: its method may run the add and the next norm in its
own kernel instead, and hands on the normalized rows).

Checkpoints store q/k/v and gate/up as separate matrices; each parameter's `weight_loader` takes one
with its `shard_id` ("q"/"k"/"v", or the index into `output_sizes`) and copies this rank's slice into
its rows, so the model's loader never needs to know which layers are fused or sharded. At
tp_size == 1 every layer is a plain one: no slicing, no collective.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import nn

from voltllm.distributed import (
    divide,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)
from voltllm.layers.linear_method import LinearMethodBase, linear
from voltllm.layers.norm import RMSNorm
from voltllm.layers.parameter import (
    copy_checked,
    default_weight_loader,
    packed_units,
    rank_slice,
    set_weight_attrs,
)
from voltllm.layers.quantization import QuantizationConfig, linear_method_for

__all__ = [
    "ColumnParallelLinear",
    "LinearBase",
    "MergedColumnParallelLinear",
    "QKVParallelLinear",
    "ReplicatedLinear",
    "ResidualStream",
    "RowParallelLinear",
    "linear",
]


class ResidualStream(NamedTuple):
    """What passes between the sublayers of pre-norm blocks. `hidden` is the last sublayer's output, for
    the next norm to add into `residual` and normalize; or, when `normed`, that norm's result already
    (the model normalizes its embedding before the first layer; a projection ending a block may run the
    add and the next norm in its kernel: `RowParallelLinear.add_to_stream`)."""

    hidden: torch.Tensor
    residual: torch.Tensor
    normed: bool = False


class LinearBase(nn.Module):
    """`y = x W^T (+ b)` over this rank's shard; the parameters are its `linear_method`'s."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        input_size_per_partition: int,
        output_partition_sizes: Sequence[int],
        bias: bool,
        quant_config: QuantizationConfig | None,
        prefix: str,
    ) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.input_size_per_partition = input_size_per_partition
        self.output_partition_sizes = list(output_partition_sizes)
        self.output_size_per_partition = sum(self.output_partition_sizes)
        self.prefix = prefix
        self.tp_rank = get_tensor_model_parallel_rank()
        self.tp_size = get_tensor_model_parallel_world_size()
        params_dtype = torch.get_default_dtype()
        self.linear_method: LinearMethodBase = linear_method_for(quant_config, self, prefix)
        self.linear_method.create_weights(
            self, input_size_per_partition, self.output_partition_sizes, input_size, output_size, params_dtype
        )
        if bias:
            # Unquantized whatever the method: one value per output feature of this rank.
            self.bias = nn.Parameter(torch.empty(self.output_size_per_partition, dtype=params_dtype))
            set_weight_attrs(self.bias, {"output_dim": 0})
        else:
            self.register_parameter("bias", None)
        for param in self.parameters(recurse=False):
            if not hasattr(param, "weight_loader"):  # a method may bring its own
                set_weight_attrs(param, {"weight_loader": self.weight_loader})

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: int | str | None = None
    ) -> None:
        default_weight_loader(param, loaded_weight)

    def _load_rows(
        self,
        param: nn.Parameter,
        loaded_weight: torch.Tensor,
        offset: int,
        size: int,
        index: int,
        num_parts: int,
    ) -> None:
        """Copy part `index` of `num_parts` of `loaded_weight` (along the output dim) into `param`'s
        output rows `offset : offset + size` (logical units; packed parameters convert)."""
        dim = getattr(param, "output_dim", None)
        if dim is None:  # nothing per output feature (a per-tensor scale): the whole tensor
            default_weight_loader(param, loaded_weight)
            return
        dst = param.data.narrow(dim, packed_units(param, dim, offset), packed_units(param, dim, size))
        copy_checked(dst, rank_slice(loaded_weight, dim, index, num_parts, dst.shape[dim]))

    def streamed_weights(self) -> tuple[torch.Tensor, ...]:
        """The tensors a forward of this layer streams from memory (`LinearMethodBase.streamed_weights`)."""
        return self.linear_method.streamed_weights(self)

    def extra_repr(self) -> str:
        return (
            f"in={self.input_size_per_partition}, out={self.output_size_per_partition}, "
            f"bias={self.bias is not None}, tp={self.tp_rank}/{self.tp_size}, "
            f"method={type(self.linear_method).__name__}"
        )


class ReplicatedLinear(LinearBase):
    """The whole matrix on every rank (small layers, e.g. an MoE router)."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__(input_size, output_size, input_size, [output_size], bias, quant_config, prefix)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_method.apply(self, x, self.bias)


class ColumnParallelLinear(LinearBase):
    """Output features sharded over the ranks: `x [T, in] -> [T, out / tp_size]` (or `[T, out]` with
    `gather_output`)."""

    swiglu = False  # MergedColumnParallelLinear(swiglu=True) returns silu(gate) * up instead

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        gather_output: bool = False,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
        output_partition_sizes: Sequence[int] | None = None,  # fused subclasses: rows per shard
    ) -> None:
        if output_partition_sizes is None:
            output_partition_sizes = [
                divide(output_size, get_tensor_model_parallel_world_size(), "output size")
            ]
        super().__init__(
            input_size, output_size, input_size, output_partition_sizes, bias, quant_config, prefix
        )
        self.gather_output = gather_output

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        method = self.linear_method
        out = (method.apply_swiglu if self.swiglu else method.apply)(self, x, self.bias)
        return tensor_model_parallel_all_gather(out) if self.gather_output else out

    def add_norm_forward(
        self, hidden: torch.Tensor, residual: torch.Tensor, norm: RMSNorm
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`self(norm(hidden + residual))` with the add and norm fused where the method can (the
        projection after a pre-norm block). Returns `(out, new_residual)`; `hidden` and `residual` may
        be consumed."""
        out, residual = self.linear_method.apply_add_rms_norm(
            self, hidden, residual, norm, self.bias, self.swiglu
        )
        return (tensor_model_parallel_all_gather(out) if self.gather_output else out), residual

    def stream_forward(self, stream: ResidualStream, norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """`self(norm(hidden + residual))` of the stream (of `hidden` as it is when the stream is
        normed already) and the new residual."""
        if stream.normed:
            return self(stream.hidden), stream.residual
        return self.add_norm_forward(stream.hidden, stream.residual, norm)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: int | str | None = None
    ) -> None:
        self._load_rows(param, loaded_weight, 0, self.output_size_per_partition, self.tp_rank, self.tp_size)


class _FusedColumnLinear(ColumnParallelLinear):
    """Column layers stored as one matrix, stacked along the output dim; loads one shard at a time."""

    shard_ids: tuple[int | str, ...]  # what a checkpoint tensor's shard_id may be, in stacking order

    def _shard_rows(self, shard_id: int | str) -> tuple[int, int, int, int]:
        """`(offset, size, index, num_parts)`: the shard's local rows in the fused parameter, and which
        part of the checkpoint tensor they hold."""
        raise NotImplementedError

    def _full_sizes(self) -> list[int]:
        """Each shard's output features in the whole (unsharded) layer."""
        raise NotImplementedError

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: int | str | None = None
    ) -> None:
        if shard_id is None:
            self._load_prefused(param, loaded_weight)
            return
        if shard_id not in self.shard_ids:
            raise ValueError(f"shard {shard_id!r} is not one of {self.shard_ids}")
        self._load_rows(param, loaded_weight, *self._shard_rows(shard_id))

    def _load_prefused(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        """A checkpoint that stores the fused matrix already: split it and load shard by shard."""
        dim = getattr(param, "output_dim", None)
        if dim is None:
            default_weight_loader(param, loaded_weight)
            return
        sizes = [packed_units(param, dim, size) for size in self._full_sizes()]
        if loaded_weight.shape[dim] != sum(sizes):
            raise ValueError(
                f"fused checkpoint shape {tuple(loaded_weight.shape)} != {sum(sizes)} along dim {dim}"
            )
        for shard_id, part in zip(self.shard_ids, loaded_weight.split(sizes, dim=dim), strict=True):
            self._load_rows(param, part, *self._shard_rows(shard_id))


class MergedColumnParallelLinear(_FusedColumnLinear):
    """Column-parallel layers over one input in one matrix: shard i has `output_sizes[i]` features.

    With `swiglu` the two shards are `[gate, up]` and the layer returns `silu(gate) * up`, fused into
    the GEMM's epilogue where the method can.
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: Sequence[int],
        bias: bool = False,
        gather_output: bool = False,
        swiglu: bool = False,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ) -> None:
        tp_size = get_tensor_model_parallel_world_size()
        self.output_sizes = tuple(output_sizes)
        if swiglu and (len(self.output_sizes) != 2 or self.output_sizes[0] != self.output_sizes[1]):
            raise ValueError(f"swiglu needs two equal shards [gate, up], got {self.output_sizes}")
        local = [divide(size, tp_size, "output size") for size in self.output_sizes]
        super().__init__(
            input_size,
            sum(self.output_sizes),
            bias,
            gather_output,
            quant_config,
            prefix,
            output_partition_sizes=local,
        )
        self.swiglu = swiglu
        self.shard_ids = tuple(range(len(self.output_sizes)))
        self._offsets = [sum(local[:i]) for i in range(len(local))]

    def _shard_rows(self, shard_id: int | str) -> tuple[int, int, int, int]:
        return self._offsets[shard_id], self.output_partition_sizes[shard_id], self.tp_rank, self.tp_size

    def _full_sizes(self) -> list[int]:
        return list(self.output_sizes)


class QKVParallelLinear(_FusedColumnLinear):
    """The fused q/k/v projection, sharded by attention heads: rank r holds query heads r of tp_size and
    their KV heads. When tp_size exceeds the KV heads, each rank holds one KV head, shared by
    `num_kv_head_replicas` consecutive ranks (their query heads all attend to it)."""

    def __init__(
        self,
        hidden_size: int,
        head_size: int,
        total_num_heads: int,
        total_num_kv_heads: int | None = None,
        bias: bool = False,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ) -> None:
        tp_size = get_tensor_model_parallel_world_size()
        self.head_size = head_size
        self.total_num_heads = total_num_heads
        self.total_num_kv_heads = total_num_kv_heads or total_num_heads
        self.num_heads = divide(total_num_heads, tp_size, "num_attention_heads")
        if tp_size >= self.total_num_kv_heads:
            if tp_size % self.total_num_kv_heads:
                raise ValueError(
                    f"tensor-parallel size {tp_size} is not a multiple of num_key_value_heads "
                    f"{self.total_num_kv_heads}: the KV heads cannot be replicated evenly"
                )
            self.num_kv_heads = 1
            self.num_kv_head_replicas = tp_size // self.total_num_kv_heads
        else:
            self.num_kv_heads = divide(self.total_num_kv_heads, tp_size, "num_key_value_heads")
            self.num_kv_head_replicas = 1
        self.q_size = self.num_heads * head_size  # this rank's
        self.kv_size = self.num_kv_heads * head_size
        super().__init__(
            hidden_size,
            (total_num_heads + 2 * self.total_num_kv_heads) * head_size,
            bias,
            False,
            quant_config,
            prefix,
            output_partition_sizes=[self.q_size, self.kv_size, self.kv_size],
        )
        self.shard_ids = ("q", "k", "v")

    def _shard_rows(self, shard_id: int | str) -> tuple[int, int, int, int]:
        if shard_id == "q":
            return 0, self.q_size, self.tp_rank, self.tp_size
        kv_rank, kv_parts = (
            self.tp_rank // self.num_kv_head_replicas,
            self.tp_size // self.num_kv_head_replicas,
        )
        offset = self.q_size if shard_id == "k" else self.q_size + self.kv_size
        return offset, self.kv_size, kv_rank, kv_parts

    def _full_sizes(self) -> list[int]:
        kv = self.total_num_kv_heads * self.head_size
        return [self.total_num_heads * self.head_size, kv, kv]


class RowParallelLinear(LinearBase):
    """Input features sharded over the ranks: `x [T, in / tp_size]` (a column layer's sharded output)
    -> `[T, out]`, summed over the ranks unless `reduce_results=False`."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        reduce_results: bool = True,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ) -> None:
        input_per_partition = divide(input_size, get_tensor_model_parallel_world_size(), "input size")
        super().__init__(
            input_size, output_size, input_per_partition, [output_size], bias, quant_config, prefix
        )
        self.reduce_results = reduce_results

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias if self.tp_rank == 0 else None  # added once, not once per rank
        out = self.linear_method.apply(self, x, bias)
        if self.reduce_results and self.tp_size > 1:
            out = tensor_model_parallel_all_reduce(out)
        return out

    def add_to_stream(self, x: torch.Tensor, residual: torch.Tensor, next_norm: RMSNorm) -> ResidualStream:
        """`self(x)`, the output of a block, as the stream's next sublayer output. On one rank, where
        the method can (`apply_then_add_rms_norm`: quantized GEMVs at decode rows), the projection's
        kernel also adds it into `residual` and runs `next_norm`, and the stream comes back normed."""
        if self.tp_size == 1 and self.reduce_results:
            fused = self.linear_method.apply_then_add_rms_norm(self, x, residual, next_norm, self.bias)
            if fused is not None:
                return ResidualStream(*fused, normed=True)
        return ResidualStream(self(x), residual)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: int | str | None = None
    ) -> None:
        dim = getattr(param, "input_dim", None)
        if dim is not None:
            size = param.shape[dim]  # storage units: the checkpoint's are the same (packed or grouped)
            loaded_weight = rank_slice(loaded_weight, dim, self.tp_rank, self.tp_size, size)
        copy_checked(param.data, loaded_weight)
