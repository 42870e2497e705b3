"""Quantized mixture-of-experts checkpoints (AWQ, GPTQ, compressed-tensors, FP8) through the whole engine on
the CPU against transformers running the same model with the dequantized weights: 32 greedy tokens of
each prompt, token for token, with chunked prefill and mixed steps.

The checkpoints are written as the quantizing tools write MoE models: one quantized matrix per expert
(`mlp.experts.<e>.gate_proj.qweight`, Mixtral's `experts.<e>.w1`), the attention projections and the
shared expert quantized too, the router (`mlp.gate`) left in full precision. Each matrix is packed by
`checkpoints.py`'s packers, from the formats' published layouts.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from checkpoints import (
    PROJECTIONS,
    QUANTIZERS,
    SHARED_INPUT,
    Format,
    quantization_config,
    shuffled_g_idx,
    write_config,
)
from safetensors.torch import save_file
from test_formats import NEW_TOKENS
from tiny_models import assert_greedy_matches_hf, cpu_test_engine, moe_config
from transformers import AutoModelForCausalLM

from voltllm.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from voltllm.engine.llm_engine import LLMEngine
from voltllm.layers.fused_moe import FusedMoE
from voltllm.layers.fused_moe.quantized import QuantizedFusedMoEMethod
from voltllm.layers.quantization.quantized_method import DUMMY_WEIGHT_RANGE
from voltllm.models.moe import sparse_layer_ids
from voltllm.protocol import EngineCoreRequest, EngineSamplingParams

# Checkpoint names of one expert's (gate, up, down), by family.
EXPERT_NAMES = {"mixtral": ("w1", "w3", "w2")}
QWEN_EXPERT_NAMES = ("gate_proj", "up_proj", "down_proj")


def _g_idx(weight: torch.Tensor, fmt: Format, gen: torch.Generator) -> torch.Tensor | None:
    return shuffled_g_idx(weight.shape[1], fmt.group_size, gen) if fmt.act_order else None


def _routers_kept_dense(name: str, fmt: Format) -> Format:
    """`fmt` leaving the routers (and Qwen2-MoE's one-output shared-expert gates) in full precision, as
    the quantizing tools do: AWQ/GPTQ list each sparse layer's (they match names as substrings),
    compressed-tensors ignores them by regex."""
    if fmt.method == "compressed-tensors":
        return replace(fmt, skipped=("re:.*mlp\\.gate$", "re:.*shared_expert_gate$"))
    config = moe_config(name, plain=True)
    experts = getattr(config, "num_experts", None) or config.num_local_experts
    layers = sparse_layer_ids(config, experts)
    kept = [f"model.layers.{i}.mlp.{gate}" for i in layers for gate in ("gate", "shared_expert_gate")]
    return replace(fmt, skipped=tuple(kept))


def save_quantized_moe(
    name: str, fmt: Format, out_dir: Path, seed: int = 0, sizes: dict[str, int] | None = None
) -> torch.nn.Module:
    """Write the tiny MoE model `name` quantized as `fmt` (its config's `sizes` replaced, e.g. for the
    GPU kernels' head sizes); returns transformers' model holding the dequantized weights (fp32, eval)."""
    config = moe_config(name, plain=True)
    for key, value in (sizes or {}).items():
        setattr(config, key, value)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    tensors = {n: t.detach().clone().contiguous() for n, t in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        tensors.pop("lm_head.weight")
    g_idx_of_input: dict[tuple[str, str], torch.Tensor | None] = {}
    for prefix, module in model.named_modules():
        block, _, proj = prefix.rpartition(".")
        if proj in PROJECTIONS and hasattr(module, "weight"):
            del tensors[f"{prefix}.weight"]
            # q/k/v (and gate/up) see the same input: GPTQ orders their columns the same way
            key = (block, SHARED_INPUT.get(proj, proj))
            if key not in g_idx_of_input:
                g_idx_of_input[key] = _g_idx(module.weight.data, fmt, gen)
            packed, dequantized = QUANTIZERS[fmt.method](module.weight.data, fmt, g_idx_of_input[key])
            tensors.update({f"{prefix}.{k}": v.contiguous().clone() for k, v in packed.items()})
            module.weight.data.copy_(dequantized)
        elif prefix.endswith(".experts"):
            gate_name, up_name, down_name = EXPERT_NAMES.get(config.model_type, QWEN_EXPERT_NAMES)
            gate_up, down = module.gate_up_proj.data, module.down_proj.data  # [E, 2I, H], [E, H, I]
            del tensors[f"{prefix}.gate_up_proj"], tensors[f"{prefix}.down_proj"]
            inter = down.shape[2]
            for e in range(gate_up.shape[0]):
                # gate and up see the same input: GPTQ orders their columns the same way
                g_idx = _g_idx(gate_up[e], fmt, gen)
                mats = ((gate_name, gate_up[e, :inter], g_idx), (up_name, gate_up[e, inter:], g_idx))
                mats += ((down_name, down[e], _g_idx(down[e], fmt, gen)),)
                for mat_name, weight, mat_g_idx in mats:
                    packed, dequantized = QUANTIZERS[fmt.method](weight, fmt, mat_g_idx)
                    key = f"{prefix}.{e}.{mat_name}"
                    tensors.update({f"{key}.{k}": v.contiguous().clone() for k, v in packed.items()})
                    weight.copy_(dequantized)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out_dir / "model.safetensors")
    write_config(model.config, quantization_config(fmt), out_dir)
    return model


FORMATS = {
    "awq-g32": Format("awq", group_size=32),
    "gptq-4bit-g32-sym": Format("gptq", bits=4, group_size=32, symmetric=True),
    "gptq-4bit-g16-act_order": Format("gptq", bits=4, group_size=16, act_order=True),
    "ct-w4a16-g32-asym": Format("compressed-tensors", bits=4, group_size=32),
    "fp8-block32": Format("fp8", bits=8, scales="block", block=(32, 32)),
}
CASES = [
    ("qwen3_moe-e8-top2-norm-step2", "awq-g32"),
    ("qwen3_moe-e16-top8-mlp_only", "gptq-4bit-g32-sym"),
    ("qwen2_moe-e6-top2-shared", "gptq-4bit-g16-act_order"),
    ("mixtral-e4-top2", "ct-w4a16-g32-asym"),
    ("qwen3_moe-e4-top1", "fp8-block32"),
]


@pytest.mark.parametrize(("model", "fmt_name"), CASES, ids=[f"{m}-{f}" for m, f in CASES])
def test_quantized_experts_match_transformers_on_dequantized_weights(
    model: str, fmt_name: str, tmp_path
) -> None:
    hf_model = save_quantized_moe(model, _routers_kept_dense(model, FORMATS[fmt_name]), tmp_path)
    engine = cpu_test_engine(tmp_path, num_kv_blocks=128)
    experts = [m for m in engine.core.runner.model.modules() if isinstance(m, FusedMoE)]
    assert experts and all(isinstance(m.moe_method, QuantizedFusedMoEMethod) for m in experts)
    assert not any(name.startswith(("w13_", "w2_")) for m in experts for name, _ in m.named_parameters())
    assert_greedy_matches_hf(engine, hf_model, num_prompts=4, new_tokens=NEW_TOKENS, logprobs=False)


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_dummy_quantized_experts_load_and_run(method: str, tmp_path) -> None:
    """`load_format="dummy"` on a quantized MoE config: random valid codes per expert, finite logits."""
    config = moe_config("qwen3_moe-e4-top1", plain=True).to_dict()
    quant = {"quant_method": method, "bits": 4, "group_size": 32, "modules_to_not_convert": ["mlp.gate"]}
    quant.update({"version": "gemm"} if method == "awq" else {"desc_act": False, "sym": True})
    config["quantization_config"] = quant
    tmp_path.joinpath("config.json").write_text(json.dumps(config))
    engine = LLMEngine(
        EngineConfig(
            model=ModelConfig(model=str(tmp_path), dtype="float32", load_format="dummy"),
            cache=CacheConfig(block_size=8, num_kv_blocks=32),
            scheduler=SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=2),
            device="cpu",
        )
    )
    experts = [m for m in engine.core.runner.model.modules() if isinstance(m, FusedMoE)]
    assert experts and all(isinstance(m.moe_method, QuantizedFusedMoEMethod) for m in experts)
    weights = experts[0].w13_experts
    assert weights.shape == (4, 64, 64) and weights.weights[0].codes.dtype == torch.uint8
    dense = weights[1]
    assert dense.abs().max() <= DUMMY_WEIGHT_RANGE and dense.std() > 0
    params = EngineSamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    out = engine.generate_token_ids([EngineCoreRequest("a", [5, 6, 7, 8], params, 0.0)])
    assert len(out["a"].new_token_ids) == 4
