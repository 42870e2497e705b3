"""Placing Hugging Face-named checkpoint tensors into a model's parameters.

A model names its parameters after the checkpoint, except where it fuses several checkpoint matrices
into one (q/k/v -> qkv_proj, gate/up -> gate_up_proj); `FusedShard`s say which. Mixture-of-experts
layers stack every expert's matrices into one parameter (`experts.<e>.gate_proj` ->
`experts.w13_weight`, shard `(e, "w1")`); `ExpertShard`s say which. Each tensor goes to its parameter's
`weight_loader` (set by the layer that owns it, see `voltllm.layers.parameter`), which copies this
tensor-parallel rank's slice into the right rows, so this module knows nothing about sharding or
quantized layouts. Every parameter, and every shard of a fused one, must be filled.
"""

from __future__ import annotations

import re
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
    shard_id: int | str | None  # e.g. "k"; None: the checkpoint tensor fills the whole parameter


@dataclass(frozen=True)
class ExpertShard:
    """Checkpoint names `<block>.experts.<e>.<checkpoint>.<suffix>` are shard `(e, kind)` of the stacked
    parameter `<block>.experts.<fused><suffix>`."""

    checkpoint: str  # one expert's matrix in checkpoints, e.g. "gate_proj" (Qwen) or "w1" (Mixtral)
    fused: str  # the stacked parameter's name before the suffix, e.g. "w13_"
    kind: str  # e.g. "w1" (see voltllm.layers.fused_moe.layer)


ShardId = int | str | tuple[int, str] | None


def load_checkpoint(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    fused_shards: Iterable[FusedShard] = (),
    ignored_suffixes: tuple[str, ...] = (),
    skipped: frozenset[str] = frozenset(),
    expert_shards: Iterable[ExpertShard] = (),
) -> None:
    """Copy `weights` into `model`. Names ending in `ignored_suffixes` or in `skipped` are passed over
    (recomputed buffers, a tied head some checkpoints still store).

    Raises ValueError naming the tensor for unknown names, shape mismatches and missing tensors.
    """
    fused_shards = tuple(fused_shards)
    experts = _ExpertNames(tuple(expert_shards))
    modules = dict(model.named_modules())
    params = dict(model.named_parameters())  # tied parameters appear once, under their first name
    loaded: set[tuple[str, ShardId]] = set()
    for name, tensor in weights:
        if name.endswith(ignored_suffixes) or name in skipped:
            continue
        target, shard_id = experts.target(name)
        if shard_id is None:
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
    _check_all_loaded(params, modules, loaded, fused_shards, experts)
    for module in model.modules():
        process_weights_after_loading(module)


def process_weights_after_loading(module: nn.Module) -> None:
    """Let `module`'s weight method (linear or fused-experts) convert what was loaded into it, e.g. a
    quantized format's checkpoint tensors into its kernel's form. Once per module, after its last tensor."""
    for attr in ("linear_method", "moe_method"):
        method = getattr(module, attr, None)
        if method is not None:
            method.process_weights_after_loading(module)


def packed_modules_mapping(fused_shards: Iterable[FusedShard]) -> dict[str, tuple[str, ...]]:
    """Fused module name -> the checkpoint modules it holds, in order (`{"qkv_proj": ("q_proj", "k_proj",
    "v_proj"), ...}`), for quantization configs that name checkpoint modules."""
    mapping: dict[str, tuple[str, ...]] = {}
    for shard in fused_shards:
        if shard.shard_id is not None:
            fused, part = shard.fused.strip("."), shard.checkpoint.strip(".")
            mapping[fused] = (*mapping.get(fused, ()), part)
    return mapping


class _ExpertNames:
    """Maps per-expert checkpoint names onto stacked expert parameters and back."""

    def __init__(self, shards: tuple[ExpertShard, ...]) -> None:
        self.by_checkpoint = {s.checkpoint: s for s in shards}
        self.by_param = {(s.fused, s.kind): s for s in shards}
        names = "|".join(re.escape(s.checkpoint) for s in shards)
        self.pattern = re.compile(rf"\.experts\.(\d+)\.({names})\.") if shards else None

    def target(self, name: str) -> tuple[str, ShardId]:
        """`(parameter name, (expert, kind))` for a per-expert tensor, `(name, None)` otherwise."""
        match = self.pattern.search(name) if self.pattern is not None else None
        if match is None:
            return name, None
        shard = self.by_checkpoint[match.group(2)]
        target = f"{name[: match.start()]}.experts.{shard.fused}{name[match.end() :]}"
        return target, (int(match.group(1)), shard.kind)

    def checkpoint_name(self, name: str, shard_id: tuple[int, str]) -> str | None:
        expert, kind = shard_id
        for (fused, shard_kind), shard in self.by_param.items():
            marker = f".experts.{fused}"
            if shard_kind == kind and marker in name:
                return name.replace(marker, f".experts.{expert}.{shard.checkpoint}.")
        return None


def _check_all_loaded(
    params: dict[str, nn.Parameter],
    modules: dict[str, nn.Module],
    loaded: set[tuple[str, ShardId]],
    fused_shards: tuple[FusedShard, ...],
    experts: _ExpertNames,
) -> None:
    missing = []
    for name, param in params.items():
        if (name, None) in loaded:  # whole, or a checkpoint that stores the fused matrix
            continue
        # Stacked experts list their shards on the parameter (w13 and w2 differ), fused linears on the layer.
        shard_ids = getattr(param, "shard_ids", None)
        if shard_ids is None:
            shard_ids = getattr(modules[name.rpartition(".")[0]], "shard_ids", None)
        if shard_ids is None:
            missing.append(name)
            continue
        for shard_id in shard_ids:
            if (name, shard_id) not in loaded:
                missing.append(_checkpoint_name(name, shard_id, fused_shards, experts))
    if missing:
        shown = ", ".join(missing[:8]) + (f" (+{len(missing) - 8} more)" if len(missing) > 8 else "")
        raise ValueError(f"checkpoint is missing {len(missing)} tensors: {shown}")


def _checkpoint_name(
    name: str, shard_id: ShardId, fused_shards: tuple[FusedShard, ...], experts: _ExpertNames
) -> str:
    """The checkpoint's name for shard `shard_id` of the fused parameter `name`."""
    if isinstance(shard_id, tuple):
        return experts.checkpoint_name(name, shard_id) or f"{name} (shard {shard_id!r})"
    for shard in fused_shards:
        if shard.fused in name and shard.shard_id == shard_id:
            return name.replace(shard.fused, shard.checkpoint)
    return f"{name} (shard {shard_id!r})"
