"""Layer-level checks: RoPE frequencies against transformers, config switches, clear errors."""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_config
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from voltllm.layers.attention import get_attention_backend
from voltllm.layers.linear import QKVParallelLinear
from voltllm.layers.rotary import compute_inv_freq, rope_attention_scaling, rope_parameters_of
from voltllm.models import DecoderForCausalLM, UnsupportedArchitectureError, get_model_class
from voltllm.models.decoder import layer_sliding_windows, variant_for

ROPES = [
    {"rope_type": "default", "rope_theta": 10000.0},
    {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 32768},
    {
        "rope_type": "yarn",
        "rope_theta": 1e4,
        "factor": 40.0,
        "original_max_position_embeddings": 4096,
        "beta_fast": 16,
        "beta_slow": 2,
        "mscale": 1.0,
        "mscale_all_dim": 0.707,
    },
]


@pytest.mark.parametrize("rope", ROPES, ids=lambda r: r["rope_type"])
def test_inv_freq_matches_transformers(rope: dict) -> None:
    config = LlamaConfig(
        hidden_size=1024, num_attention_heads=8, max_position_embeddings=131072, rope_parameters=rope
    )
    hf_rope = LlamaRotaryEmbedding(config)
    params = rope_parameters_of(config)
    ours = compute_inv_freq(128, params, config.max_position_embeddings)
    torch.testing.assert_close(ours, hf_rope.inv_freq.float(), rtol=1e-6, atol=0)
    assert rope_attention_scaling(params, config.max_position_embeddings) == pytest.approx(
        hf_rope.attention_scaling, rel=1e-12
    )


def test_legacy_rope_scaling_fields_are_read() -> None:
    class OldConfig:  # transformers < 5 kept theta and scaling apart
        rope_theta = 1e6
        rope_scaling = {"type": "linear", "factor": 2.0}

    params = rope_parameters_of(OldConfig())
    assert params["rope_type"] == "linear" and params["rope_theta"] == 1e6


def test_unsupported_rope_type_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="unsupported RoPE scaling type 'longrope'"):
        compute_inv_freq(64, {"rope_type": "longrope", "rope_theta": 1e4, "factor": 4.0}, 4096)


def test_qwen2_sliding_window_layers() -> None:
    config = tiny_config("Qwen2ForCausalLM")
    config.architectures = ["Qwen2ForCausalLM"]
    config.sliding_window, config.use_sliding_window, config.max_window_layers = 16, True, 1
    config.layer_types = None  # an old config: derive from use_sliding_window + max_window_layers
    assert layer_sliding_windows(config, variant_for(config)) == [None, 16]
    config.use_sliding_window = False
    assert layer_sliding_windows(config, variant_for(config)) == [None, None]


def test_fused_projections_and_tied_head() -> None:
    config = tiny_config("Qwen3ForCausalLM")
    config.architectures = ["Qwen3ForCausalLM"]
    model = DecoderForCausalLM(config, get_attention_backend("torch", "cpu"))
    attn = model.model.layers[0].self_attn
    assert isinstance(attn.qkv_proj, QKVParallelLinear)
    assert attn.qkv_proj.output_partition_sizes == [4 * 32, 2 * 32, 2 * 32]  # explicit head_dim 32
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.kv_cache_shape_per_layer(10, 16) == (2, 10, 16, 2, 32)
    assert model.num_layers == 2


def test_registry() -> None:
    config = tiny_config("MistralForCausalLM")
    config.architectures = ["MistralForCausalLM"]
    assert get_model_class(config) is DecoderForCausalLM
    config.architectures = ["GPT2LMHeadModel"]
    with pytest.raises(UnsupportedArchitectureError, match="GPT2LMHeadModel.*LlamaForCausalLM"):
        get_model_class(config)


def test_non_silu_activation_rejected() -> None:
    config = tiny_config("LlamaForCausalLM")
    config.architectures = ["LlamaForCausalLM"]
    config.hidden_act = "gelu"
    with pytest.raises(ValueError, match="silu"):
        DecoderForCausalLM(config, get_attention_backend("torch", "cpu"))
