"""The linear-layer seams in one process: the unquantized method computes what the old dense layer did,
the fused q/k/v and gate/up loaders put each checkpoint shard in its rows, a rank's shard is the right
slice (with a fake tensor-parallel rank: loading needs no collective), and a quantization method plugs
in through `QuantizationConfig` without touching the model."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from paged_batch import PagedBatch
from safetensors.torch import load_file, save_file
from tiny_models import save_tiny_model
from torch import nn

from voltllm.config import ModelConfig
from voltllm.distributed import TensorParallelGroup, parallel_state
from voltllm.layers import quantization
from voltllm.layers.activation import silu_and_mul
from voltllm.layers.attention import get_attention_backend
from voltllm.layers.embedding import ParallelLMHead, VocabParallelEmbedding, VocabShard
from voltllm.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from voltllm.layers.linear_method import LinearMethodBase, UnquantizedLinearMethod
from voltllm.layers.norm import RMSNorm, fused_add_rms_norm
from voltllm.layers.parameter import set_weight_attrs
from voltllm.layers.quantization import QuantizationConfig
from voltllm.loader import load_model

GEN = torch.Generator().manual_seed(0)


def randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=GEN)


@pytest.fixture
def fake_rank(monkeypatch: pytest.MonkeyPatch):
    """`fake_rank(rank, size)`: layers built afterwards shard as that rank would (no process group)."""

    def set_rank(rank: int, size: int) -> None:
        monkeypatch.setattr(parallel_state, "_tp_group", TensorParallelGroup(rank, size))

    return set_rank


# ---------------------------------------------------------------- tp_size 1: what the dense layer did


def test_unquantized_layers_compute_the_dense_linear() -> None:
    x, w, b = randn(3, 16), randn(8, 16), randn(8)
    for layer in (ReplicatedLinear(16, 8, bias=True), ColumnParallelLinear(16, 8, bias=True)):
        assert isinstance(layer.linear_method, UnquantizedLinearMethod)
        layer.weight.weight_loader(layer.weight, w)
        layer.bias.weight_loader(layer.bias, b)
        assert torch.equal(layer(x), F.linear(x, w, b))
    row = RowParallelLinear(16, 8, bias=True)
    row.weight.weight_loader(row.weight, w)
    row.bias.weight_loader(row.bias, b)
    assert torch.equal(row(x), F.linear(x, w, b))


def test_gate_up_swiglu_and_the_folded_norm_match_the_unfused_modules() -> None:
    x, residual, w = randn(2, 16), randn(2, 16), randn(12, 16)
    norm = RMSNorm(16, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * randn(16))
    plain = MergedColumnParallelLinear(16, [6, 6])
    gated = MergedColumnParallelLinear(16, [6, 6], swiglu=True)
    for layer in (plain, gated):
        layer.weight.weight_loader(layer.weight, w)  # a checkpoint that stores gate_up fused
    assert torch.equal(plain(x), F.linear(x, w))
    assert torch.equal(gated(x), silu_and_mul(F.linear(x, w)))

    normed, summed = fused_add_rms_norm(x, residual, norm.weight, norm.eps)
    out, new_residual = gated.add_norm_forward(x, residual, norm)
    assert torch.equal(new_residual, summed)
    assert torch.equal(out, silu_and_mul(F.linear(normed, w)))
    with pytest.raises(ValueError, match="two equal shards"):
        MergedColumnParallelLinear(16, [6, 4], swiglu=True)


def test_qkv_loader_stacks_the_checkpoint_shards() -> None:
    layer = QKVParallelLinear(16, head_size=4, total_num_heads=4, total_num_kv_heads=2, bias=True)
    assert layer.output_partition_sizes == [16, 8, 8] and layer.shard_ids == ("q", "k", "v")
    q, k, v = randn(16, 16), randn(8, 16), randn(8, 16)
    for shard_id, tensor in zip("qkv", (q, k, v), strict=True):
        layer.weight.weight_loader(layer.weight, tensor, shard_id)
        layer.bias.weight_loader(layer.bias, tensor[:, 0], shard_id)
    assert torch.equal(layer.weight, torch.cat([q, k, v]))
    assert torch.equal(layer.bias, torch.cat([q, k, v])[:, 0])
    with pytest.raises(ValueError, match=r"checkpoint shape \(9, 16\) != expected \(8, 16\)"):
        layer.weight.weight_loader(layer.weight, randn(9, 16), "k")
    with pytest.raises(ValueError, match="shard 'x'"):
        layer.weight.weight_loader(layer.weight, k, "x")


# ---------------------------------------------------------------- a rank's shard


def test_column_row_and_merged_shards_of_rank_1_of_2(fake_rank) -> None:
    fake_rank(1, 2)
    w, b = randn(8, 16), randn(8)
    column = ColumnParallelLinear(16, 8, bias=True)
    column.weight.weight_loader(column.weight, w)
    column.bias.weight_loader(column.bias, b)
    assert torch.equal(column.weight, w[4:]) and torch.equal(column.bias, b[4:])

    row = RowParallelLinear(16, 8, bias=True)
    row.weight.weight_loader(row.weight, w)
    row.bias.weight_loader(row.bias, b)
    assert torch.equal(row.weight, w[:, 8:]) and torch.equal(row.bias, b)  # the bias is whole

    gate, up = randn(6, 16), randn(6, 16)
    merged = MergedColumnParallelLinear(16, [6, 6], swiglu=True)
    merged.weight.weight_loader(merged.weight, gate, 0)
    merged.weight.weight_loader(merged.weight, up, 1)
    assert torch.equal(merged.weight, torch.cat([gate[3:], up[3:]]))  # [gate_r | up_r]
    prefused = MergedColumnParallelLinear(16, [6, 6])
    prefused.weight.weight_loader(prefused.weight, torch.cat([gate, up]))
    assert torch.equal(prefused.weight, merged.weight)
    with pytest.raises(ValueError, match="not divisible by the tensor-parallel size 2"):
        ColumnParallelLinear(16, 7)


@pytest.mark.parametrize(("rank", "size", "kv_head"), [(0, 4, 0), (1, 4, 0), (2, 4, 1), (3, 4, 1), (1, 2, 1)])
def test_qkv_shard_replicates_kv_heads_beyond_their_number(fake_rank, rank, size, kv_head) -> None:
    fake_rank(rank, size)
    head = 2
    layer = QKVParallelLinear(8, head_size=head, total_num_heads=8, total_num_kv_heads=2)
    heads_per_rank = 8 // size
    assert (layer.num_heads, layer.num_kv_heads) == (heads_per_rank, 1)
    assert layer.num_kv_head_replicas == size // 2
    q, k, v = randn(8 * head, 8), randn(2 * head, 8), randn(2 * head, 8)
    for shard_id, tensor in zip("qkv", (q, k, v), strict=True):
        layer.weight.weight_loader(layer.weight, tensor, shard_id)
    q_rows = slice(rank * heads_per_rank * head, (rank + 1) * heads_per_rank * head)
    kv_rows = slice(kv_head * head, (kv_head + 1) * head)
    assert torch.equal(layer.weight, torch.cat([q[q_rows], k[kv_rows], v[kv_rows]]))
    prefused = QKVParallelLinear(8, head_size=head, total_num_heads=8, total_num_kv_heads=2)
    prefused.weight.weight_loader(prefused.weight, torch.cat([q, k, v]))
    assert torch.equal(prefused.weight, layer.weight)


def test_kv_heads_that_do_not_replicate_evenly_are_refused(fake_rank) -> None:
    fake_rank(0, 4)
    with pytest.raises(ValueError, match="cannot be replicated evenly"):
        QKVParallelLinear(8, head_size=2, total_num_heads=4, total_num_kv_heads=3)


def test_vocab_shards_are_padded_only_when_sharded(fake_rank) -> None:
    assert VocabShard.of(200, 0, 1, 64) == VocabShard(200, 200, 200, 0, 200)
    assert VocabShard.of(200, 0, 2, 64) == VocabShard(200, 256, 128, 0, 128)
    assert VocabShard.of(200, 1, 2, 64) == VocabShard(200, 256, 128, 128, 200)
    fake_rank(1, 2)
    table = randn(200, 8)
    embedding = VocabParallelEmbedding(200, 8)
    embedding.weight.weight_loader(embedding.weight, table)
    assert embedding.weight.shape == (128, 8)
    assert torch.equal(embedding.weight[:72], table[128:]) and not embedding.weight[72:].any()
    head = ParallelLMHead(200, 8, tied_to=embedding)
    assert head.weight is embedding.weight and head.shard == embedding.shard
    with pytest.raises(ValueError, match="200 vocab rows"):
        embedding.weight.weight_loader(embedding.weight, randn(201, 8))


# ---------------------------------------------------------------- a quantization method is an addition


class PackedPairsMethod(LinearMethodBase):
    """A toy packed format: `qweight [out / 2, in, 2]` holds output rows 2i and 2i + 1 side by side
    (`packed_dim` 0, `pack_factor` 2), as int4 formats pack several outputs per stored element."""

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, *_) -> None:
        qweight = nn.Parameter(torch.empty(sum(output_partition_sizes) // 2, input_size_per_partition, 2))
        set_weight_attrs(qweight, {"output_dim": 0, "input_dim": 1, "packed_dim": 0, "pack_factor": 2})
        layer.register_parameter("qweight", qweight)

    def apply(self, layer, x, bias=None) -> torch.Tensor:
        return F.linear(x, unpack_pairs(layer.qweight), bias)


def pack_pairs(weight: torch.Tensor) -> torch.Tensor:
    return weight.unflatten(0, (-1, 2)).transpose(1, 2).contiguous()


def unpack_pairs(qweight: torch.Tensor) -> torch.Tensor:
    return qweight.transpose(1, 2).flatten(0, 1)


def test_packed_parameters_load_fused_shards_in_storage_units(fake_rank) -> None:
    class Config(QuantizationConfig):
        @classmethod
        def from_config(cls, config: dict[str, Any]) -> QuantizationConfig:
            return cls()

        def get_linear_method(self, layer, prefix):
            return PackedPairsMethod()

    q, k, v = randn(8, 4), randn(4, 4), randn(4, 4)
    for rank, size in ((0, 1), (1, 2)):
        fake_rank(rank, size)
        layer = QKVParallelLinear(
            4, head_size=2, total_num_heads=4, total_num_kv_heads=2, quant_config=Config()
        )
        for shard_id, tensor in zip("qkv", (q, k, v), strict=True):
            layer.qweight.weight_loader(layer.qweight, pack_pairs(tensor), shard_id)
        q_rows, kv_rows = (
            slice(rank * 8 // size, (rank + 1) * 8 // size),
            slice(rank * 2, rank * 2 + 4 // size),
        )
        expected = torch.cat([q[q_rows], k[kv_rows], v[kv_rows]])
        assert torch.equal(unpack_pairs(layer.qweight), expected)


class Int8Method(LinearMethodBase):
    """A toy weight-only int8 format: `qweight [out, in]` int8 and one fp32 scale per output row."""

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, *_) -> None:
        rows = sum(output_partition_sizes)
        qweight = nn.Parameter(
            torch.empty(rows, input_size_per_partition, dtype=torch.int8), requires_grad=False
        )
        scales = nn.Parameter(torch.empty(rows, dtype=torch.float32), requires_grad=False)
        set_weight_attrs(qweight, {"output_dim": 0, "input_dim": 1})
        set_weight_attrs(scales, {"output_dim": 0})
        layer.register_parameter("qweight", qweight)
        layer.register_parameter("scales", scales)

    def apply(self, layer, x, bias=None) -> torch.Tensor:
        return F.linear(x, dequantize(layer.qweight, layer.scales), bias)


class Int8Config(QuantizationConfig):
    name = "toy_int8"

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> QuantizationConfig:
        return cls()

    def get_linear_method(self, layer, prefix):
        return Int8Method() if ".mlp." in prefix or ".self_attn." in prefix else None


def dequantize(qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return qweight.float() * scales[:, None]


def test_a_quantization_method_plugs_in_through_the_checkpoint_config(tmp_path, monkeypatch) -> None:
    save_tiny_model("Qwen2ForCausalLM", tmp_path)  # biases on q/k/v: they stay unquantized
    weights = load_file(tmp_path / "model.safetensors")
    quantized, dequantized = {}, {}
    for name, tensor in weights.items():
        if name.endswith("_proj.weight"):
            scales = tensor.abs().amax(dim=1) / 127
            qweight = torch.round(tensor / scales[:, None]).to(torch.int8)
            quantized[name.replace(".weight", ".qweight")] = qweight
            quantized[name.replace(".weight", ".scales")] = scales
            dequantized[name] = dequantize(qweight, scales)
        else:
            quantized[name] = dequantized[name] = tensor
    save_file(dequantized, tmp_path / "model.safetensors")
    quant_dir = tmp_path / "int8"
    quant_dir.mkdir()
    save_file(quantized, quant_dir / "model.safetensors")
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "toy_int8"}
    (quant_dir / "config.json").write_text(json.dumps(config))

    def load(model_dir):
        backend = get_attention_backend("torch", "cpu")
        return load_model(ModelConfig(model=str(model_dir)), "cpu", None, backend, progress=False).model

    with pytest.raises(ValueError, match="quantization method 'toy_int8' is not supported"):
        load(quant_dir)
    monkeypatch.setitem(quantization.base._CONFIGS, "toy_int8", Int8Config)
    model, reference = load(quant_dir), load(tmp_path)
    down = model.model.layers[1].mlp.down_proj
    assert isinstance(down.linear_method, Int8Method) and down.qweight.dtype == torch.int8
    assert isinstance(model.lm_head.weight, nn.Parameter)  # the head stays unquantized

    outputs = []
    for m in (model, reference):
        kv_caches = [torch.zeros(m.kv_cache_shape_per_layer(8, 4)) for _ in range(m.num_layers)]
        metadata = PagedBatch(1, num_blocks=8, block_size=4).step([7])
        with torch.inference_mode():
            hidden = m(torch.arange(7) * 3, torch.arange(7), metadata, kv_caches)
            outputs.append(m.compute_logits(hidden))
    assert torch.equal(outputs[0], outputs[1])  # the same dequantized weights, the same arithmetic
