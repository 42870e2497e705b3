"""Every quantized format through the whole engine against transformers running the same model with
the dequantized weights (fp32, CPU): 32 greedy tokens of each prompt, token for token, with chunked
prefill (a 40-token step budget splits the long prompts), mixed prefill/decode steps and a prefix-cache
hit. The checkpoints are packed by `checkpoints.py` from each format's published layout (the
compressed-tensors library itself for that format); a module each checkpoint leaves in full precision
must stay dense."""

from __future__ import annotations

from pathlib import Path

import pytest
from checkpoints import Format, save_quantized_model
from tiny_models import assert_greedy_matches_hf, cpu_test_engine

from voltllm.layers.linear_method import UnquantizedLinearMethod
from voltllm.layers.quantization.quantized_method import QuantizedLinearMethod

NEW_TOKENS = 32
SKIPPED = ("model.layers.1.mlp.down_proj",)

FORMATS = {
    "awq-g32": Format("awq", group_size=32, skipped=SKIPPED),
    "awq-g64": Format("awq", group_size=64),
    "awq-g128": Format("awq", group_size=128),
    "gptq-4bit-g32-sym": Format("gptq", bits=4, group_size=32, symmetric=True),
    "gptq-4bit-g64-asym-act_order": Format("gptq", bits=4, group_size=64, act_order=True, skipped=SKIPPED),
    "gptq-8bit-g32-asym-act_order": Format("gptq", bits=8, group_size=32, act_order=True),
    "gptq-8bit-channel-sym": Format("gptq", bits=8, group_size=-1, symmetric=True),
    "gptq-4bit-channel-asym": Format("gptq", bits=4, group_size=-1),
    "gptq_v2-4bit-g32-asym": Format("gptq", bits=4, group_size=32, gptq_version=2),
    "ct-w4a16-g32-asym": Format("compressed-tensors", bits=4, group_size=32, skipped=SKIPPED),
    "ct-w4a16-g128-sym": Format("compressed-tensors", bits=4, group_size=128, symmetric=True),
    "ct-w4a16-channel-asym": Format("compressed-tensors", bits=4, scales="channel"),
    "ct-w8a16-g64-sym": Format("compressed-tensors", bits=8, group_size=64, symmetric=True),
    "ct-w8a16-channel-asym": Format("compressed-tensors", bits=8, scales="channel"),
    "ct-fp8-channel": Format("compressed-tensors", bits=8, scales="channel", skipped=SKIPPED),
    "ct-fp8-tensor": Format("compressed-tensors", bits=8, scales="tensor"),
    "ct-fp8-block32": Format("compressed-tensors", bits=8, scales="block", block=(32, 32)),
    "fp8-block32": Format("fp8", bits=8, scales="block", block=(32, 32), skipped=SKIPPED),
    "fp8-block64x32": Format("fp8", bits=8, scales="block", block=(64, 32)),
    "fp8-tensor": Format("fp8", bits=8, scales="tensor"),
}
# Every format on Llama; on Qwen3 (q/k norm, tied head) one of each method and the act-order case.
CASES = [("llama", name) for name in FORMATS] + [
    ("qwen3", name)
    for name in (
        "awq-g32",
        "gptq-4bit-g64-asym-act_order",
        "ct-w4a16-g32-asym",
        "ct-fp8-channel",
        "fp8-block32",
    )
]


@pytest.mark.parametrize(("arch", "name"), CASES, ids=[f"{arch}-{name}" for arch, name in CASES])
def test_greedy_matches_transformers_on_dequantized_weights(arch: str, name: str, tmp_path: Path) -> None:
    fmt = FORMATS[name]
    hf_model = save_quantized_model(arch, fmt, tmp_path)
    engine = cpu_test_engine(tmp_path, num_kv_blocks=128)
    for layer in engine.core.runner.model.model.layers:
        for proj in (
            layer.self_attn.qkv_proj,
            layer.self_attn.o_proj,
            layer.mlp.gate_up_proj,
            layer.mlp.down_proj,
        ):
            expected = UnquantizedLinearMethod if proj.prefix in fmt.skipped else QuantizedLinearMethod
            assert isinstance(proj.linear_method, expected), proj.prefix
    assert_greedy_matches_hf(engine, hf_model, num_prompts=4, new_tokens=NEW_TOKENS, logprobs=False)
