"""Mixture-of-experts models sharded over two gloo ranks on the CPU match the unsharded model: each
rank holds half of every expert's intermediate features (and of the shared expert's), the experts' and
the shared expert's partial sums are reduced once. Qwen2-MoE from per-expert checkpoint tensors,
Mixtral from transformers' stacked layout (`experts.gate_up_proj`, split per rank at load)."""

from __future__ import annotations

from pathlib import Path

import torch.multiprocessing as mp
from tiny_models import moe_config, save_moe_model
from tp_ranks import WORLD_SIZE, run_rank


def test_sharded_moe_models_match_unsharded(tmp_path: Path) -> None:
    models = []
    for name, save_kwargs in (
        ("qwen2_moe-e6-top2-shared", {}),
        ("mixtral-e4-top2", {"save_original_format": False}),
    ):
        save_moe_model(name, tmp_path / name, **save_kwargs)
        models.append((tmp_path / name, moe_config(name).to_dict()))
    # Forked like test_tensor_parallel.py: a spawned rank would import torch again.
    mp.start_processes(
        run_rank, (str(tmp_path / "rendezvous"), models), nprocs=WORLD_SIZE, join=True, start_method="fork"
    )
