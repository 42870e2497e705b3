"""Test helper: what each gloo rank of `test_tensor_parallel.py` runs."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from paged_batch import PagedBatch

from voltllm.distributed import destroy_tensor_parallel, init_tensor_parallel
from voltllm.layers.activation import silu_and_mul
from voltllm.layers.attention import get_attention_backend
from voltllm.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from voltllm.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from voltllm.loader.weights import iterate_safetensors, safetensors_files
from voltllm.models import DecoderForCausalLM

WORLD_SIZE = 2


def run_rank(rank: int, init_file: str, models: list[tuple[Path, dict[str, Any]]]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD_SIZE)
    try:
        check_layers(rank)
        for model_dir, config in models:
            check_model(model_dir, SimpleNamespace(**config))
    finally:
        destroy_tensor_parallel()
        dist.destroy_process_group()


def check_layers(rank: int) -> None:
    gen = torch.Generator().manual_seed(0)  # the same tensors on every rank

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    x, w_gate_up, b_gate_up, w_down, b_down = randn(3, 16), randn(12, 16), randn(12), randn(16, 6), randn(16)
    w_qkv, table, head_table, hidden = randn(24, 16), randn(200, 8), randn(200, 8), randn(3, 8)
    ids = torch.tensor([0, 5, 127, 128, 150, 199])
    init_tensor_parallel()
    try:
        gate_up = MergedColumnParallelLinear(16, [6, 6], bias=True, swiglu=True)
        for shard in (0, 1):
            rows = slice(6 * shard, 6 * (shard + 1))
            gate_up.weight.weight_loader(gate_up.weight, w_gate_up[rows], shard)
            gate_up.bias.weight_loader(gate_up.bias, b_gate_up[rows], shard)
        down = RowParallelLinear(6, 16, bias=True)
        down.weight.weight_loader(down.weight, w_down)
        down.bias.weight_loader(down.bias, b_down)
        assert down.weight.shape == (16, 3)
        expected = F.linear(silu_and_mul(F.linear(x, w_gate_up, b_gate_up)), w_down, b_down)
        torch.testing.assert_close(down(gate_up(x)), expected, rtol=1e-5, atol=1e-5)

        gathered = ColumnParallelLinear(16, 12, gather_output=True)
        gathered.weight.weight_loader(gathered.weight, w_gate_up)
        torch.testing.assert_close(gathered(x), F.linear(x, w_gate_up), rtol=1e-5, atol=1e-5)

        # 4 query heads of size 4 over one KV head: each rank holds 2 query heads and the KV head.
        qkv = QKVParallelLinear(16, head_size=4, total_num_heads=4, total_num_kv_heads=1)
        assert (qkv.num_heads, qkv.num_kv_heads, qkv.num_kv_head_replicas) == (2, 1, 2)
        for shard_id, rows in zip("qkv", (slice(0, 16), slice(16, 20), slice(20, 24)), strict=True):
            qkv.weight.weight_loader(qkv.weight, w_qkv[rows], shard_id)
        full = F.linear(x, w_qkv)
        local_q = full[:, 8 * rank : 8 * (rank + 1)]
        torch.testing.assert_close(qkv(x), torch.cat([local_q, full[:, 16:]], dim=1), rtol=1e-5, atol=1e-5)

        embedding = VocabParallelEmbedding(200, 8)
        embedding.weight.weight_loader(embedding.weight, table)
        assert embedding.weight.shape == (128, 8)  # 200 padded to 256 rows over two ranks
        assert torch.equal(embedding(ids), F.embedding(ids, table))
        lm_head = ParallelLMHead(200, 8)
        lm_head.weight.weight_loader(lm_head.weight, head_table)
        out = torch.full((3, 200), float("nan"))
        lm_head(hidden, out=out)
        torch.testing.assert_close(out, F.linear(hidden, head_table), rtol=1e-5, atol=1e-5)
        tied = ParallelLMHead(200, 8, tied_to=embedding)
        torch.testing.assert_close(tied(hidden), F.linear(hidden, table), rtol=1e-5, atol=1e-5)
    finally:
        destroy_tensor_parallel()


def check_model(model_dir: Path, hf_config: Any) -> None:
    def load() -> DecoderForCausalLM:
        model = DecoderForCausalLM(hf_config, get_attention_backend("torch", "cpu"))
        model.load_weights(iterate_safetensors(safetensors_files(model_dir), progress=False))
        return model.eval()

    reference = load()
    init_tensor_parallel()  # up while the sharded model runs: its collectives go through the group
    try:
        sharded = load()
        assert sharded.num_kv_heads == 1 and sharded.model.layers[0].self_attn.num_heads == 2
        logits = [run_steps(model) for model in (reference, sharded)]
    finally:
        destroy_tensor_parallel()
    assert logits[1].shape == (10, 200)
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-5, atol=1e-5)


def run_steps(model: torch.nn.Module) -> torch.Tensor:
    """Logits of every token of a two-sequence prefill and a decode step after it."""
    gen = torch.Generator().manual_seed(1)
    kv_caches = [torch.zeros(model.kv_cache_shape_per_layer(8, 4)) for _ in range(model.num_layers)]
    batch, out = PagedBatch(2, num_blocks=8, block_size=4), []
    for query_lens in ([5, 3], [1, 1]):
        metadata = batch.step(query_lens)
        input_ids = torch.randint(0, 200, (sum(query_lens),), generator=gen)
        with torch.inference_mode():
            hidden = model(input_ids, batch.positions(query_lens), metadata, kv_caches)
            out.append(model.compute_logits(hidden))
    return torch.cat(out)
