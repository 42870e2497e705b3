"""Placing Hugging Face-named checkpoint tensors into a model's parameters.

A model names its parameters after the checkpoint, except where it fuses several checkpoint matrices
into one (q/k/v -> qkv_proj, gate/up -> gate_up_proj); `FusedShard`s say which. Each tensor goes to its
parameter's `weight_loader` (set by the layer that owns it, see `voltllm.layers.parameter`), which
copies this tensor-parallel rank's slice into the right rows, so this module knows nothing about
sharding or quantized layouts. Every parameter, and every shard of a fused one, must be filled.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from voltllm.layers.parameter import default_weight_loader


@dataclass(frozen=True)
class FusedShard:
    """Checkpoint names containing `checkpoint` are shard `shard_id` of the parameter named with `fused`."""

    checkpoint: str  # e.g. ".k_proj."
    fused: str  # e.g. ".qkv_proj."
    shard_id: int | str  # e.g. "k"


def load_checkpoint(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    fused_shards: Iterable[FusedShard] = (),
    ignored_suffixes: tuple[str, ...] = (),
    skipped: frozenset[str] = frozenset(),
) -> None:
    """Copy `weights` into `model`. Names ending in `ignored_suffixes` or in `skipped` are passed over
    (recomputed buffers, a tied head some checkpoints still store).

    Raises ValueError naming the tensor for unknown names, shape mismatches and missing tensors.
    """
    fused_shards = tuple(fused_shards)
    modules = dict(model.named_modules())
    params = dict(model.named_parameters())  # tied parameters appear once, under their first name
    loaded: set[tuple[str, int | str | None]] = set()
    for name, tensor in weights:
        if name.endswith(ignored_suffixes) or name in skipped:
            continue
        target, shard_id = name, None
        for shard in fused_shards:
            if shard.checkpoint in name:
                target, shard_id = name.replace(shard.checkpoint, shard.fused), shard.shard_id
                break
        param = params.get(target)
        if param is None:
            raise ValueError(f"checkpoint tensor {name!r} has no place in {type(model).__name__}")
        weight_loader = getattr(param, "weight_loader", None)
        try:
            if weight_loader is None:
                default_weight_loader(param, tensor)
            elif shard_id is None:
                weight_loader(param, tensor)
            else:
                weight_loader(param, tensor, shard_id)
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from e
        loaded.add((target, shard_id))
    _check_all_loaded(params, modules, loaded, fused_shards)
    for module in model.modules():
        method = getattr(module, "linear_method", None)
        if method is not None:
            method.process_weights_after_loading(module)


def _check_all_loaded(
    params: dict[str, nn.Parameter],
    modules: dict[str, nn.Module],
    loaded: set[tuple[str, int | str | None]],
    fused_shards: tuple[FusedShard, ...],
) -> None:
    missing = []
    for name in params:
        if (name, None) in loaded:  # whole, or a checkpoint that stores the fused matrix
            continue
        module = modules[name.rpartition(".")[0]]
        shard_ids = getattr(module, "shard_ids", None)
        if shard_ids is None:
            missing.append(name)
            continue
        for shard_id in shard_ids:
            if (name, shard_id) not in loaded:
                missing.append(_checkpoint_name(name, shard_id, fused_shards))
    if missing:
        shown = ", ".join(missing[:8]) + (f" (+{len(missing) - 8} more)" if len(missing) > 8 else "")
        raise ValueError(f"checkpoint is missing {len(missing)} tensors: {shown}")


def _checkpoint_name(name: str, shard_id: int | str, fused_shards: tuple[FusedShard, ...]) -> str:
    """The checkpoint's name for shard `shard_id` of the fused parameter `name`."""
    for shard in fused_shards:
        if shard.fused in name and shard.shard_id == shard_id:
            return name.replace(shard.fused, shard.checkpoint)
    return f"{name} (shard {shard_id!r})"
