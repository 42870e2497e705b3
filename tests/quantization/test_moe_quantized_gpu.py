"""Quantized mixture-of-experts checkpoints on a CUDA GPU (skipped without one): the experts run on the
quantized expert kernels (`voltllm.ops.moe_quantized`: packed stacks, no torch form kept), and the engine's
greedy outputs are the same with the decode step captured in CUDA graphs as eagerly, token for token,
with chunked prefill and mixed steps. The tiny models are resized to shapes the kernels take (head size 64,
hidden size and expert width multiples of 64)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from checkpoints import Format
from test_moe_quantized import FORMATS, _routers_kept_dense, save_quantized_moe
from tiny_models import engine_prompts

from voltllm.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from voltllm.engine.llm_engine import LLMEngine
from voltllm.layers.fused_moe import FusedMoE
from voltllm.protocol import EngineCoreRequest, EngineSamplingParams

pytestmark = pytest.mark.gpu

SIZES = {
    "hidden_size": 256,
    "head_dim": 64,
    "moe_intermediate_size": 64,
    "intermediate_size": 128,
    "shared_expert_intermediate_size": 128,
}
GPU_FORMATS = {**FORMATS, "gptq-4bit-g32-act_order": Format("gptq", bits=4, group_size=32, act_order=True)}
CASES = [
    ("qwen3_moe-e8-top2-norm-step2", "awq-g32"),
    ("qwen2_moe-e6-top2-shared", "gptq-4bit-g32-act_order"),
    ("mixtral-e4-top2", "ct-w4a16-g32-asym"),
    ("qwen3_moe-e4-top1", "fp8-block32"),
]


def _engine(model_dir, eager: bool) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=ModelConfig(model=str(model_dir), dtype="float16"),
            cache=CacheConfig(num_kv_blocks=512),
            scheduler=SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=16),  # chunked prefill
            device="cuda",
            enforce_eager=eager,
        )
    )


def assert_graphs_match_eager(
    model_dir, check_engine: Callable[[LLMEngine], None] = lambda engine: None
) -> None:
    """The engine's greedy outputs on `engine_prompts` are the same eager and with CUDA graphs, token for
    token; `check_engine` looks at each engine before it runs."""
    outputs = []
    for eager in (True, False):
        engine = _engine(model_dir, eager)
        assert (engine.core.runner.graphs is None) == eager
        check_engine(engine)
        prompts = engine_prompts(engine.vocab_size, 12)
        requests = [
            EngineCoreRequest(
                str(i), p, EngineSamplingParams(temperature=0.0, max_tokens=8 + 2 * i, ignore_eos=True), 0.0
            )
            for i, p in enumerate(prompts)
        ]
        out = engine.generate_token_ids(requests)
        outputs.append({rid: o.new_token_ids for rid, o in out.items()})
        del engine
        torch.cuda.empty_cache()
    differing = {
        rid: (outputs[0][rid], outputs[1][rid]) for rid in outputs[0] if outputs[0][rid] != outputs[1][rid]
    }
    assert not differing, f"eager vs graphs differ: {differing}"


@pytest.mark.parametrize(("model", "fmt_name"), CASES, ids=[f"{m}-{f}" for m, f in CASES])
def test_quantized_experts_run_the_kernels_and_graphs_match_eager(
    model: str, fmt_name: str, tmp_path
) -> None:
    if GPU_FORMATS[fmt_name].method == "compressed-tensors":
        pytest.importorskip("compressed_tensors")  # the checkpoint writer packs with the reference library
    save_quantized_moe(model, _routers_kept_dense(model, GPU_FORMATS[fmt_name]), tmp_path, sizes=SIZES)

    def experts_on_the_kernels(engine: LLMEngine) -> None:
        experts = [m for m in engine.core.runner.model.modules() if isinstance(m, FusedMoE)]
        assert experts
        for layer in experts:
            assert layer.quantized_kernels_unsupported is None, layer.quantized_kernels_unsupported
            assert hasattr(layer, "w13_packed") and not hasattr(layer, "w13_experts")

    assert_graphs_match_eager(tmp_path, experts_on_the_kernels)
