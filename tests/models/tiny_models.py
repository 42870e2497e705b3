"""Test helper: tiny random Hugging Face checkpoints of each supported architecture.

Two families share one shape (`COMMON`): `tiny_config` / `save_tiny_model` switch on each architecture's
distinguishing feature and randomize every weight (the layer and loader tests); `PLAIN_CONFIGS` /
`save_plain_model` keep the features off and transformers' own initialization (the engine tests, which
compare whole generations with transformers). `MOE_CONFIGS` are the mixture-of-experts shapes, used
both ways (`moe_config`)."""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    PretrainedConfig,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3Config,
    Qwen3MoeConfig,
)

COMMON = dict(
    vocab_size=200,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
)
# The engine tests' shape: their prompts draw token ids below 320; token 2 ends a sequence; transformers'
# own initialization, widened to 0.3.
PLAIN_COMMON = {
    **COMMON,
    "vocab_size": 320,
    "intermediate_size": 128,
    "max_position_embeddings": 512,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "initializer_range": 0.3,
}
PLAIN_CONFIGS = {
    "llama": lambda: LlamaConfig(**PLAIN_COMMON, tie_word_embeddings=False),
    "mistral": lambda: MistralConfig(**PLAIN_COMMON, sliding_window=None, tie_word_embeddings=False),
    "qwen2": lambda: Qwen2Config(**PLAIN_COMMON, tie_word_embeddings=True),
    "qwen3": lambda: Qwen3Config(**PLAIN_COMMON, head_dim=16, tie_word_embeddings=True),
}


def tiny_config(arch: str, head_size: int | None = None) -> PretrainedConfig:
    """2 layers, hidden 64, GQA 4:2, with each architecture's distinguishing feature switched on.

    `head_size` scales the model to heads of that size (the CUDA kernels take 64, 128 or 256)."""
    common = dict(COMMON)
    if head_size is not None:
        common.update(hidden_size=4 * head_size, intermediate_size=6 * head_size, vocab_size=256)
    if arch == "LlamaForCausalLM":
        return LlamaConfig(
            **common,
            tie_word_embeddings=True,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        )
    if arch == "MistralForCausalLM":
        return MistralConfig(**common, sliding_window=8, tie_word_embeddings=False)
    if arch == "Qwen2ForCausalLM":
        return Qwen2Config(**common, tie_word_embeddings=False, rope_parameters={"rope_theta": 1e6})
    if arch == "Qwen3ForCausalLM":
        # An explicit head_dim (32, or 2x the scaled one) != hidden / heads: the explicit one must win.
        head_dim = 32 if head_size is None else head_size
        if head_size is not None:
            common["hidden_size"] = 2 * head_size
        return Qwen3Config(**common, head_dim=head_dim, tie_word_embeddings=True)
    raise ValueError(arch)


def randomize_(model: torch.nn.Module, seed: int) -> None:
    """Weights far from the defaults (norms != 1, biases != 0) so every switch shows in the logits."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            if "norm" in name:
                param.copy_(1.0 + 0.3 * noise)
            else:
                param.copy_(0.1 * noise)


def save_tiny_model(
    arch: str,
    out_dir: Path,
    seed: int = 0,
    head_size: int | None = None,
    rope_parameters: dict | None = None,
    **save_kwargs: object,
) -> PretrainedConfig:
    """Write a random checkpoint of `arch` to `out_dir` (safetensors) and return its config."""
    config = tiny_config(arch, head_size)
    if rope_parameters is not None:
        config.rope_parameters = rope_parameters
    config.architectures = [arch]
    model = _seeded_model(config, seed)
    randomize_(model, seed)
    model.save_pretrained(out_dir, **save_kwargs)
    return config


def save_plain_model(
    arch: str, out_dir: Path, seed: int = 0, **overrides: object
) -> tuple[Path, torch.nn.Module]:
    """Write a random `PLAIN_CONFIGS[arch]` checkpoint (with `overrides` of its config fields) to
    `out_dir`; returns it and the model (fp32, eval)."""
    config = PLAIN_CONFIGS[arch]()
    for key, value in overrides.items():
        setattr(config, key, value)
    model = _seeded_model(config, seed).eval()
    model.save_pretrained(out_dir)
    return out_dir, model


# A byte-fallback BPE tokenizer of 344 tokens (tests/fixtures/gen_tokenizer_fixtures.py).
TOKENIZER_FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "bytefallback"


def add_fixture_tokenizer(model_dir: Path) -> Path:
    """Copy the fixture tokenizer beside a checkpoint (what `LLM` and `voltllm serve` read); returns
    `model_dir`."""
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TOKENIZER_FIXTURE / name, model_dir / name)
    return model_dir


def _seeded_model(config: PretrainedConfig, seed: int) -> torch.nn.Module:
    """The fp32 transformers model of `config`, initialized from `seed`."""
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def load_hf_reference(model_dir: Path, device: str = "cpu") -> torch.nn.Module:
    """The checkpoint in transformers (eager attention, fp32): the oracle."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    return model.to(device)


def hf_logits(hf_model: torch.nn.Module, token_ids: list[int]) -> torch.Tensor:
    """Reference logits `[len, vocab]` for one unpadded sequence."""
    device = next(hf_model.parameters()).device
    with torch.no_grad():
        return hf_model(torch.tensor([token_ids], device=device)).logits[0].float()


# Mixture-of-experts shapes: name -> (config class, overrides of COMMON / PLAIN_COMMON). Between them:
# 4 to 16 experts, top-k 1, 2 and 8, norm_topk_prob both ways, a shared expert, dense layers among
# sparse ones (decoder_sparse_step, mlp_only_layers), a sliding window.
_MOE_CLASSES = {"qwen3_moe": Qwen3MoeConfig, "qwen2_moe": Qwen2MoeConfig, "mixtral": MixtralConfig}
MOE_CONFIGS: dict[str, tuple[str, dict]] = {
    # layer 0 dense (decoder_sparse_step 2), layer 1 sparse
    "qwen3_moe-e8-top2-norm-step2": (
        "qwen3_moe",
        dict(num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=2),
    ),
    # layer 0 sparse, layer 1 dense (mlp_only_layers)
    "qwen3_moe-e16-top8-mlp_only": (
        "qwen3_moe",
        dict(num_experts=16, num_experts_per_tok=8, norm_topk_prob=False, mlp_only_layers=[1]),
    ),
    "qwen3_moe-e4-top1": ("qwen3_moe", dict(num_experts=4, num_experts_per_tok=1, norm_topk_prob=False)),
    "qwen2_moe-e6-top2-shared": (
        "qwen2_moe",
        dict(num_experts=6, num_experts_per_tok=2, norm_topk_prob=False, shared_expert_intermediate_size=48),
    ),
    "qwen2_moe-e4-top1-norm-shared": (
        "qwen2_moe",
        dict(num_experts=4, num_experts_per_tok=1, norm_topk_prob=True, shared_expert_intermediate_size=80),
    ),
    "mixtral-e4-top2": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2)),
    "mixtral-e8-top1-window": ("mixtral", dict(num_local_experts=8, num_experts_per_tok=1, sliding_window=8)),
}
_MOE_ARCHS = {
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
}


def moe_config(name: str, plain: bool = False) -> PretrainedConfig:
    """`MOE_CONFIGS[name]` on the shape of `COMMON` (random weights) or `PLAIN_COMMON` (the engine
    tests); experts of 32 features (Qwen's moe_intermediate_size; Mixtral's experts are
    intermediate_size wide, so it is set to 32 there)."""
    family, overrides = MOE_CONFIGS[name]
    common = dict(PLAIN_COMMON if plain else COMMON)
    if family == "mixtral":
        common["intermediate_size"] = 32
    else:
        common["moe_intermediate_size"] = 32
    if family == "qwen3_moe":
        common["head_dim"] = 16
    if plain and family == "mixtral":
        common.setdefault("sliding_window", None)
    config = _MOE_CLASSES[family](**{**common, **overrides}, tie_word_embeddings=family == "qwen3_moe")
    config.architectures = [_MOE_ARCHS[family]]
    return config


def save_moe_model(name: str, out_dir: Path, seed: int = 0, plain: bool = False, **save_kwargs: object):
    """Write a `MOE_CONFIGS[name]` checkpoint to `out_dir`: weights randomized (`randomize_`), or with
    `plain` transformers' own initialization on the engine tests' shape. Returns the model (fp32, eval)."""
    model = _seeded_model(moe_config(name, plain), seed).eval()
    if not plain:
        randomize_(model, seed)
    model.save_pretrained(out_dir, **save_kwargs)
    return model


def engine_prompts(vocab: int, num: int, seed: int = 0) -> list[list[int]]:
    """`num` prompts of 3..70 tokens; every third starts with the same 24-token prefix (prefix-cache hits)."""
    rng = random.Random(seed)
    prefix = [rng.randrange(3, vocab) for _ in range(24)]
    out = []
    for i in range(num):
        own = [rng.randrange(3, vocab) for _ in range(rng.randrange(3, 46))]
        out.append(prefix + own if i % 3 == 0 else own)
    return out


def hf_greedy(model: torch.nn.Module, prompt: list[int], new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy continuation of `prompt` and the log-probabilities of its last step."""
    out = model.generate(
        torch.tensor([prompt]),
        max_new_tokens=new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
    )
    return out.sequences[0, len(prompt) :].tolist(), out.logits[-1][0].float().log_softmax(-1)


def cpu_test_engine(model_dir: Path, num_kv_blocks: int):
    """An `LLMEngine` on the CPU in fp32 with 8-token blocks and a 40-token step budget, which splits
    the long prompts of `engine_prompts` (chunked prefill) and mixes prefill with decode steps."""
    from voltllm.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    from voltllm.engine.llm_engine import LLMEngine

    config = EngineConfig(
        model=ModelConfig(model=str(model_dir), dtype="float32"),
        cache=CacheConfig(block_size=8, num_kv_blocks=num_kv_blocks),
        scheduler=SchedulerConfig(max_num_batched_tokens=40, max_num_seqs=8),
        device="cpu",
    )
    return LLMEngine(config)


def assert_greedy_matches_hf(
    engine, hf_model: torch.nn.Module, num_prompts: int, new_tokens: int = 32, logprobs: bool = True
) -> None:
    """`engine` against transformers' greedy generation on the same weights: `new_tokens` of each of
    `engine_prompts`, token for token, the shared prefix read from the prefix cache, and (`logprobs`)
    the last step's top-20 logprobs within float tolerance."""
    import pytest

    from voltllm.protocol import EngineCoreRequest, EngineSamplingParams

    prompts = engine_prompts(engine.vocab_size, num_prompts)
    params = EngineSamplingParams(
        temperature=0.0, max_tokens=new_tokens, ignore_eos=True, logprobs=20 if logprobs else None
    )
    requests = [EngineCoreRequest(str(i), p, params, float(i)) for i, p in enumerate(prompts)]
    outputs = engine.generate_token_ids(requests)
    assert engine.get_stats().prefix_cache_hits > 0  # the shared prefix was reused
    with torch.inference_mode():
        for i, prompt in enumerate(prompts):
            ref_tokens, ref_last_logprobs = hf_greedy(hf_model, prompt, new_tokens)
            out = outputs[str(i)]
            assert out.new_token_ids == ref_tokens, f"prompt {i} ({len(prompt)} tokens)"
            if logprobs:
                last = out.new_logprobs[-1]
                ref = ref_last_logprobs[last.token_ids].tolist()
                assert last.logprobs == pytest.approx(ref, abs=2e-4), f"prompt {i}: last-step logprobs"
