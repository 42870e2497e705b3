"""How a parameter carries its loading rules, so the model's loader never needs to know the layer.

A linear method creates its layer's parameters and marks each with plain attributes:
    output_dim   the dimension that holds output features: sharded by column-parallel layers, and the
                 one fused checkpoint shards (q/k/v, gate/up) are stacked along
    input_dim    the dimension that holds input features: sharded by row-parallel layers
    packed_dim, pack_factor
                 a quantized parameter stores `pack_factor` logical elements per entry along
                 `packed_dim` (int4 packed into int32: 8), so offsets along it are divided by it
    weight_loader(param, loaded_weight, shard_id=None)
                 copies this rank's slice of a checkpoint tensor (shard `shard_id` of a fused
                 parameter) into `param`; the layer sets it, `default_weight_loader` is the fallback
A dimension left unmarked is neither sharded nor stacked: the checkpoint tensor fills it whole.
"""

from __future__ import annotations

from typing import Any

import torch


def set_weight_attrs(param: torch.Tensor, attrs: dict[str, Any]) -> None:
    """Attach loading rules (the attributes above) to `param`; each may be set only once."""
    for key, value in attrs.items():
        if hasattr(param, key):
            raise AttributeError(f"parameter already has {key!r}")
        setattr(param, key, value)


def copy_checked(dst: torch.Tensor, src: torch.Tensor) -> None:
    """`dst.copy_(src)` when the shapes agree; a ValueError naming both shapes otherwise."""
    if dst.shape != src.shape:
        raise ValueError(f"checkpoint shape {tuple(src.shape)} != expected {tuple(dst.shape)}")
    with torch.no_grad():
        dst.copy_(src)


def default_weight_loader(param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
    """For parameters no layer shards or fuses (norms, unsharded buffers): copy the whole tensor."""
    copy_checked(param.data, loaded_weight)


def rank_slice(loaded_weight: torch.Tensor, dim: int, index: int, num_parts: int, size: int) -> torch.Tensor:
    """Part `index` of `num_parts` equal parts of `loaded_weight` along `dim`, each `size` long.

    With one part this is the whole tensor, so the unsharded model checks and copies the checkpoint
    tensor as it is.
    """
    if num_parts == 1:
        return loaded_weight
    if loaded_weight.shape[dim] != size * num_parts:
        raise ValueError(
            f"checkpoint shape {tuple(loaded_weight.shape)} does not split into {num_parts} parts of "
            f"{size} along dim {dim}"
        )
    return loaded_weight.narrow(dim, index * size, size)


def packed_units(param: torch.Tensor, dim: int, logical: int) -> int:
    """`logical` elements along `dim` in `param`'s storage units (see `pack_factor`)."""
    if getattr(param, "packed_dim", None) != dim:
        return logical
    factor = param.pack_factor
    if logical % factor:
        raise ValueError(f"{logical} elements do not pack into units of {factor}")
    return logical // factor
