"""Mixture-of-experts models on the CPU: Qwen3-MoE, Qwen2-MoE and Mixtral against transformers (a
flattened multi-sequence prefill, then decodes mixed with a chunked-prefill continuation over the paged
cache), the checkpoint layouts the experts load from, and the torch expert forms against each other.

The whole-engine greedy comparison is `test_moe_engine.py`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_decoder_parity import check_against_transformers
from tiny_models import MOE_CONFIGS, moe_config, save_moe_model

from voltllm.config import ModelConfig
from voltllm.layers.attention import get_attention_backend
from voltllm.layers.fused_moe import (
    FusedMoE,
    experts_dense,
    experts_gathered,
    experts_grouped,
    fused_experts,
    select_experts,
)
from voltllm.loader import load_model
from voltllm.loader.weights import iterate_safetensors, safetensors_files
from voltllm.models import DecoderForCausalLM, get_model_class
from voltllm.models.moe import SparseMoeBlock, sparse_layer_ids


@pytest.mark.parametrize("name", sorted(MOE_CONFIGS))
def test_matches_transformers_cpu_fp32(name: str, tmp_path: Path) -> None:
    save_moe_model(name, tmp_path)
    check_against_transformers(tmp_path, "cpu", torch.float32, "torch", atol=2e-4, block_size=4)


@pytest.mark.parametrize("name", ["qwen2_moe-e6-top2-shared", "mixtral-e4-top2"])
def test_stacked_expert_checkpoint_loads(name: str, tmp_path: Path) -> None:
    # transformers >= 5 can write the experts stacked (experts.gate_up_proj [E, 2I, H], down_proj).
    save_moe_model(name, tmp_path, save_original_format=False)
    names = [n for n, _ in iterate_safetensors(safetensors_files(tmp_path), progress=False)]
    assert any(n.endswith(".mlp.experts.gate_up_proj") for n in names)
    check_against_transformers(tmp_path, "cpu", torch.float32, "torch", atol=2e-4, block_size=4)


def _build(name: str) -> DecoderForCausalLM:
    return DecoderForCausalLM(moe_config(name), get_attention_backend("torch", "cpu"))


def test_layers_follow_the_config() -> None:
    step2 = _build("qwen3_moe-e8-top2-norm-step2").model.layers
    assert not isinstance(step2[0].mlp, SparseMoeBlock) and isinstance(step2[1].mlp, SparseMoeBlock)
    mlp_only = _build("qwen3_moe-e16-top8-mlp_only").model.layers
    assert isinstance(mlp_only[0].mlp, SparseMoeBlock) and not isinstance(mlp_only[1].mlp, SparseMoeBlock)
    experts = mlp_only[0].mlp.experts
    assert (experts.top_k, experts.renormalize) == (8, False)
    assert experts.w13_weight.shape == (16, 64, 64) and experts.w2_weight.shape == (16, 64, 32)
    assert mlp_only[0].mlp.shared_expert is None
    qwen2 = _build("qwen2_moe-e4-top1-norm-shared").model.layers[0]
    assert qwen2.mlp.shared_expert.down_proj.weight.shape == (64, 80)
    assert qwen2.self_attn.qkv_proj.bias is not None  # Qwen2-MoE's qkv_bias
    mixtral = _build("mixtral-e4-top2").model.layers[1].mlp.experts
    assert mixtral.renormalize and mixtral.w13_weight.shape == (4, 64, 64)  # intermediate_size wide
    config = moe_config("qwen3_moe-e4-top1")
    config.num_hidden_layers, config.decoder_sparse_step, config.mlp_only_layers = 6, 3, [5]
    assert sparse_layer_ids(config, 4) == [2]
    assert sparse_layer_ids(config, 0) == []


def test_registry_and_model_types() -> None:
    for name in MOE_CONFIGS:
        config = moe_config(name)
        assert get_model_class(config) is DecoderForCausalLM
        config.architectures = None  # converters that leave it out: model_type decides
        assert get_model_class(config) is DecoderForCausalLM


def test_missing_expert_tensor_is_named(tmp_path: Path) -> None:
    save_moe_model("mixtral-e4-top2", tmp_path)
    weights = iterate_safetensors(safetensors_files(tmp_path), progress=False)
    kept = [(n, t) for n, t in weights if n != "model.layers.1.block_sparse_moe.experts.3.w3.weight"]
    with pytest.raises(ValueError, match=r"missing 1 tensors: model\.layers\.1\.mlp\.experts\.3\.w3\.weight"):
        _build("mixtral-e4-top2").load_weights(kept)
    with pytest.raises(ValueError, match="not one of experts"):
        _build("mixtral-e4-top2").load_weights(
            [("model.layers.1.block_sparse_moe.experts.4.w1.weight", torch.zeros(32, 64))]
        )


def test_dummy_weights_cover_the_experts(tmp_path: Path) -> None:
    moe_config("qwen2_moe-e6-top2-shared").save_pretrained(tmp_path)
    loaded = load_model(
        ModelConfig(model=str(tmp_path), load_format="dummy"),
        "cpu",
        torch.float32,
        get_attention_backend("torch", "cpu"),
        progress=False,
    )
    experts = loaded.model.model.layers[0].mlp.experts
    assert experts.w13_weight.abs().max() <= 0.02 and experts.w13_weight.std() > 0.005
    assert experts.w2_weight.abs().max() <= 0.02 and experts.w2_weight.std() > 0.005


# --- the router and the expert forms ------------------------------------------------------------


def reference_moe(x, w13, w2, router_logits, top_k, renormalize):
    """Token by token, as the architectures define it."""
    probs = torch.softmax(router_logits.double(), dim=-1)
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        weights, ids = torch.topk(probs[t], top_k)
        if renormalize:
            weights = weights / weights.sum()
        for w, e in zip(weights, ids, strict=True):
            gate, up = (w13[e].double() @ x[t].double()).chunk(2)
            out[t] += w * (w2[e].double() @ (F.silu(gate) * up))
    return out


def random_moe(num_tokens: int, num_experts: int, seed: int, hidden: int = 24, inter: int = 16):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=gen)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden**0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=gen) / inter**0.5
    logits = torch.randn(num_tokens, num_experts, generator=gen)
    return x, w13, w2, logits


FORMS = [experts_grouped, experts_gathered, experts_dense, fused_experts]


@pytest.mark.parametrize("form", FORMS, ids=lambda f: f.__name__)
@pytest.mark.parametrize(
    ("num_tokens", "num_experts", "top_k"), [(1, 8, 2), (7, 4, 1), (33, 16, 8), (5, 60, 4)]
)
@pytest.mark.parametrize("renormalize", [False, True])
def test_expert_forms_match_the_definition(form, num_tokens, num_experts, top_k, renormalize) -> None:
    x, w13, w2, logits = random_moe(num_tokens, num_experts, seed=num_tokens * 100 + num_experts)
    weights, ids = select_experts(logits, top_k, renormalize)
    assert weights.dtype == torch.float32 and ids.shape == (num_tokens, top_k)
    expected = reference_moe(x, w13, w2, logits, top_k, renormalize)
    torch.testing.assert_close(form(x, w13, w2, weights, ids).double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("form", FORMS, ids=lambda f: f.__name__)
def test_idle_experts_and_one_expert_for_all(form) -> None:
    x, w13, w2, _ = random_moe(9, 6, seed=3)
    logits = torch.full((9, 6), -10.0)
    logits[:, 2] = 5.0  # every token's first choice: expert 2; experts 0, 1, 5 get nothing
    logits[:4, 4], logits[4:, 3] = 1.0, 1.0
    weights, ids = select_experts(logits, 2, True)
    expected = reference_moe(x, w13, w2, logits, 2, True)
    torch.testing.assert_close(form(x, w13, w2, weights, ids).double(), expected, atol=1e-5, rtol=1e-5)


def test_fp16_weights_accumulate_in_fp32() -> None:
    x, w13, w2, logits = random_moe(6, 8, seed=5)
    weights, ids = select_experts(logits.half(), 2, False)
    expected = reference_moe(x, w13, w2, logits.half().float(), 2, False)
    for form in (experts_gathered, experts_dense, experts_grouped):
        got = form(x.half(), w13.half(), w2.half(), weights, ids)
        assert got.dtype == torch.float16
        torch.testing.assert_close(got.double(), expected, atol=5e-3, rtol=5e-3)


def test_fused_moe_layer_loads_both_layouts() -> None:
    x, w13, w2, logits = random_moe(5, 4, seed=7, hidden=64, inter=32)
    per_expert, stacked = (FusedMoE(4, 2, 64, 32, renormalize=True) for _ in range(2))
    for e in range(4):
        gate, up = w13[e].chunk(2)
        for kind, tensor in (("w1", gate), ("w3", up)):
            per_expert.w13_weight.weight_loader(per_expert.w13_weight, tensor, (e, kind))
        per_expert.w2_weight.weight_loader(per_expert.w2_weight, w2[e], (e, "w2"))
    stacked.w13_weight.weight_loader(stacked.w13_weight, w13)
    stacked.w2_weight.weight_loader(stacked.w2_weight, w2)
    expected = reference_moe(x, w13, w2, logits, 2, True)
    for layer in (per_expert, stacked):
        with torch.no_grad():
            torch.testing.assert_close(layer(x, logits).double(), expected, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="checkpoint shape"):
        per_expert.w13_weight.weight_loader(per_expert.w13_weight, torch.zeros(33, 64), (0, "w1"))
