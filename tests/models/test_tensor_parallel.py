"""Tensor parallelism on the CPU: two gloo ranks (torch.multiprocessing) run sharded layers and whole
sharded models and must match the unsharded ones.

One spawn covers it all (starting the ranks is most of the cost; `tp_ranks.py` holds what they run):
a gate/up -> down MLP (column then row parallel, the all-reduce), a column layer that gathers its
output, a QKV projection whose single KV head both ranks share, the vocab-parallel embedding
(all-reduce) and LM head (gather, padding cut off), and two tiny decoders loaded from checkpoints:
Qwen3 (q/k norm, tied head, one KV head per rank) and Llama with biases (o_proj/down_proj bias added
once) and one KV head for both ranks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp
from tiny_models import randomize_, tiny_config
from tp_ranks import WORLD_SIZE, run_rank
from transformers import AutoModelForCausalLM


def save_model(arch: str, out_dir: Path, **overrides: object) -> tuple[Path, dict[str, Any]]:
    """A random checkpoint of `arch` in `out_dir`, and its config as a plain dict (for the ranks)."""
    config = tiny_config(arch)
    config.architectures = [arch]
    for key, value in overrides.items():
        setattr(config, key, value)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize_(model, 0)
    model.save_pretrained(out_dir)
    return out_dir, config.to_dict()


def test_sharded_layers_and_models_match_unsharded(tmp_path: Path) -> None:
    models = [
        save_model("Qwen3ForCausalLM", tmp_path / "qwen3"),
        save_model(
            "LlamaForCausalLM",
            tmp_path / "llama",
            num_key_value_heads=1,
            attention_bias=True,
            mlp_bias=True,
            tie_word_embeddings=False,
        ),
    ]
    # Forked, not spawned: a spawned rank would spend seconds importing torch again. The ranks run
    # with one thread each (the parent's thread pool does not survive the fork).
    mp.start_processes(
        run_rank, (str(tmp_path / "rendezvous"), models), nprocs=WORLD_SIZE, join=True, start_method="fork"
    )
