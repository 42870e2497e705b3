"""What voltllm does not run is refused at load with a message naming it, never loaded into a wrong
answer: unknown methods, unsupported bit widths and layouts, activation quantization, shapes that do
not match, fused shards quantized differently, a quantized lm_head, and a `--quantization`
that disagrees with the checkpoint."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from checkpoints import Format, build_model, save_quantized_model
from safetensors.torch import load_file, save_file

from voltllm.config import ModelConfig
from voltllm.layers.attention import get_attention_backend
from voltllm.loader.loader import load_model


def load(model_dir: Path, **model_config: Any):
    config = ModelConfig(model=str(model_dir), **model_config)
    return load_model(config, "cpu", None, get_attention_backend("torch", "cpu"), progress=False)


def patch_quantization_config(model_dir: Path, **changes: Any) -> None:
    path = model_dir / "config.json"
    config = json.loads(path.read_text())
    config["quantization_config"].update(changes)
    path.write_text(json.dumps(config))


def patch_tensors(model_dir: Path, **replacements: Any) -> None:
    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    tensors.update(replacements)
    save_file(tensors, path)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One small checkpoint per method, copied by each test that changes it."""
    formats = {
        "awq": Format("awq"),
        "gptq": Format("gptq", act_order=True),
        "compressed-tensors": Format("compressed-tensors"),
        "fp8": Format("fp8", bits=8, scales="block"),
    }
    root = tmp_path_factory.mktemp("quantized")
    return {
        name: (save_quantized_model("llama", fmt, root / name), root / name)[1]
        for name, fmt in formats.items()
    }


@pytest.fixture
def copy_of(checkpoints: dict[str, Path], tmp_path: Path):
    def copy(name: str) -> Path:
        out = tmp_path / name
        out.mkdir()
        for f in checkpoints[name].iterdir():
            (out / f.name).write_bytes(f.read_bytes())
        return out

    return copy


CONFIG_REFUSALS = [
    ("awq", {"quant_method": "bitsandbytes"}, "quantization method 'bitsandbytes' is not supported"),
    ("awq", {"bits": 3}, "AWQ with 3 bits is not supported"),
    ("awq", {"version": "gemv"}, "AWQ version 'gemv' is not supported"),
    ("awq", {"version": "marlin"}, "AWQ version 'marlin' is not supported"),
    ("awq", {"zero_point": False}, "AWQ without zero points"),
    ("gptq", {"bits": 3}, "GPTQ with 3 bits is not supported"),
    ("gptq", {"bits": 2}, "GPTQ with 2 bits is not supported"),
    ("gptq", {"checkpoint_format": "marlin"}, "GPTQ checkpoint_format 'marlin' is not supported"),
    ("gptq", {"lm_head": True}, "quantized lm_head"),
    ("gptq", {"pack_dtype": "int16"}, "GPTQ pack_dtype 'int16' is not supported"),
    ("gptq", {"dynamic": {"-:.*down_proj": {}}}, "per-module overrides"),
    ("fp8", {"activation_scheme": "static"}, "activation_scheme 'static' quantizes activations"),
    ("fp8", {"fmt": "e5m2"}, "FP8 format 'e5m2' is not supported"),
    ("compressed-tensors", {"kv_cache_scheme": {"num_bits": 8, "type": "float"}}, "kv_cache_scheme"),
    ("compressed-tensors", {"format": "marlin-24"}, "format 'marlin-24' are not supported"),
    ("compressed-tensors", {"ignore": []}, "quantized lm_head"),
]


@pytest.mark.parametrize(("name", "changes", "message"), CONFIG_REFUSALS)
def test_unsupported_configs_are_refused_naming_them(copy_of, name, changes, message) -> None:
    model_dir = copy_of(name)
    patch_quantization_config(model_dir, **changes)
    with pytest.raises(ValueError, match=message):
        load(model_dir)


def compressed_tensors_group(**scheme: Any) -> dict[str, Any]:
    weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32}
    return {"group_0": {"targets": ["Linear"], "weights": weights, **scheme}}


@pytest.mark.parametrize(
    ("group", "message"),
    [
        # W8A8: int8 activations quantized per token.
        (
            {"input_activations": {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True}},
            "quantizes input activations",
        ),
        # FP8 with static input scales.
        (
            {"input_activations": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}},
            "quantizes input activations",
        ),
        ({"output_activations": {"num_bits": 8, "type": "float"}}, "output activations"),
        ({"weights": {"num_bits": 3, "type": "int", "strategy": "group", "group_size": 32}}, "3-bit int"),
        (
            {
                "weights": {
                    "num_bits": 4,
                    "type": "int",
                    "strategy": "group",
                    "group_size": 32,
                    "actorder": "group",
                }
            },
            "activation order by group",
        ),
        ({"weights": {"num_bits": 4, "type": "int", "strategy": "tensor"}}, "strategy 'tensor'"),
    ],
)
def test_compressed_tensors_activation_quantization_and_other_schemes_are_refused(
    copy_of, group, message
) -> None:
    model_dir = copy_of("compressed-tensors")
    patch_quantization_config(model_dir, config_groups=compressed_tensors_group(**group))
    with pytest.raises(ValueError, match=message):
        load(model_dir)


def test_a_group_size_the_checkpoint_was_not_packed_with_is_a_shape_error(copy_of) -> None:
    model_dir = copy_of("awq")
    patch_quantization_config(model_dir, group_size=64)  # packed with groups of 32
    with pytest.raises(ValueError, match=r"\.qzeros: checkpoint shape \(\d+, 16\) != expected"):
        load(model_dir)


def test_a_group_size_that_does_not_divide_the_layer_is_refused(copy_of) -> None:
    model_dir = copy_of("awq")
    patch_quantization_config(model_dir, group_size=48)
    with pytest.raises(ValueError, match="not a multiple of the AWQ group size 48"):
        load(model_dir)


def test_a_weight_shape_that_does_not_match_is_refused(copy_of) -> None:
    model_dir = copy_of("compressed-tensors")
    patch_tensors(model_dir, **{"model.layers.0.mlp.down_proj.weight_shape": torch.tensor([128, 512])})
    with pytest.raises(ValueError, match=r"down_proj: checkpoint weight_shape \[128, 512\] does not match"):
        load(model_dir)


def test_fp8_blocks_that_do_not_tile_the_fused_shards_are_refused(copy_of) -> None:
    model_dir = copy_of("fp8")
    patch_quantization_config(model_dir, weight_block_size=[128, 128])  # k/v have 64 rows
    with pytest.raises(
        ValueError, match="64 output features per shard are not a multiple of the FP8 block size 128"
    ):
        load(model_dir)


def test_fused_shards_quantized_differently_are_refused(copy_of) -> None:
    model_dir = copy_of("awq")
    patch_quantization_config(model_dir, modules_to_not_convert=["layers.0.self_attn.k_proj"])
    with pytest.raises(ValueError, match="qkv_proj: its fused shards have different modules_to_not_convert"):
        load(model_dir)


def test_gptq_shards_with_different_act_order_are_refused(copy_of, checkpoints) -> None:
    model_dir = copy_of("gptq")
    tensors = load_file(checkpoints["gptq"] / "model.safetensors")
    g_idx = tensors["model.layers.0.self_attn.k_proj.g_idx"]
    patch_tensors(model_dir, **{"model.layers.0.self_attn.k_proj.g_idx": g_idx.flip(0).contiguous()})
    with pytest.raises(ValueError, match="shard '[qk]' has a different g_idx"):
        load(model_dir)


def test_gptq_act_order_without_desc_act_is_refused(copy_of) -> None:
    model_dir = copy_of("gptq")
    patch_quantization_config(model_dir, desc_act=False)
    with pytest.raises(ValueError, match="g_idx reorders the groups but the config has desc_act false"):
        load(model_dir)


def test_the_quantization_flag_must_agree_with_the_checkpoint(checkpoints, tmp_path) -> None:
    assert load(checkpoints["awq"], quantization="awq").model is not None  # agreeing is fine
    with pytest.raises(
        ValueError,
        match="'gptq' was asked for but the checkpoint's quantization_config says quant_method 'awq'",
    ):
        load(checkpoints["awq"], quantization="gptq")
    build_model("llama").save_pretrained(tmp_path / "dense")
    with pytest.raises(
        ValueError, match="checkpoint has no quantization_config: voltllm .* does not quantize at load"
    ):
        load(tmp_path / "dense", quantization="fp8")
    with pytest.raises(ValueError, match="quantization must be one of"):
        ModelConfig(model=str(tmp_path / "dense"), quantization="awq_marlin")
