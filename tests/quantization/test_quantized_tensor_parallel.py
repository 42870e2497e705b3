"""Quantized checkpoints sharded over two gloo ranks (CPU) give the unsharded model's logits: the packed
dimensions split in storage units (AWQ's packed output columns, GPTQ's packed input rows and, with
act-order, every group's scales kept on each row-parallel rank; compressed-tensors' zero points packed
along the output rows; FP8 blocks of scales). One fork runs every format (`run_rank` below)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from checkpoints import Format, save_quantized_model
from tp_ranks import WORLD_SIZE, run_steps

from voltllm.distributed import destroy_tensor_parallel, init_tensor_parallel
from voltllm.layers.attention import get_attention_backend
from voltllm.layers.quantization import get_quantization_config
from voltllm.loader.loader import load_hf_config
from voltllm.loader.weights import iterate_safetensors, safetensors_files
from voltllm.models import DecoderForCausalLM

FORMATS = {
    "awq": Format("awq", group_size=32),
    "gptq-act_order": Format("gptq", bits=4, group_size=32, act_order=True),
    "gptq-8bit-channel": Format("gptq", bits=8, group_size=-1),
    "ct-w4a16-asym": Format("compressed-tensors", bits=4, group_size=32),
    "fp8-block": Format("fp8", bits=8, scales="block", block=(32, 32)),
    "fp8-tensor": Format("fp8", bits=8, scales="tensor"),
}


def test_sharded_quantized_models_match_unsharded(tmp_path: Path) -> None:
    model_dirs = []
    for name, fmt in FORMATS.items():
        save_quantized_model("llama", fmt, tmp_path / name)
        model_dirs.append(tmp_path / name)
    # Forked, not spawned (a spawned rank re-imports torch for seconds); one thread per rank.
    mp.start_processes(
        run_rank,
        (str(tmp_path / "rendezvous"), model_dirs),
        nprocs=WORLD_SIZE,
        join=True,
        start_method="fork",
    )


def run_rank(rank: int, init_file: str, model_dirs: list[Path]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD_SIZE)
    try:
        for model_dir in model_dirs:
            check_model(model_dir)
    finally:
        destroy_tensor_parallel()
        dist.destroy_process_group()


def check_model(model_dir: Path) -> None:
    hf_config = load_hf_config(model_dir)

    def load() -> Any:
        model = DecoderForCausalLM(
            hf_config, get_attention_backend("torch", "cpu"), quant_config=get_quantization_config(hf_config)
        )
        model.load_weights(iterate_safetensors(safetensors_files(model_dir), progress=False))
        return model.eval()

    reference = load()
    init_tensor_parallel()  # up while the sharded model runs: its collectives go through the group
    try:
        sharded = load()
        down = sharded.model.layers[0].mlp.down_proj
        assert down.quantized_matmul.weight.shape == (128, 128), model_dir.name  # half of 256 inputs
        logits = [run_steps(model) for model in (reference, sharded)]
    finally:
        destroy_tensor_parallel()
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-4, atol=1e-4, msg=model_dir.name)
