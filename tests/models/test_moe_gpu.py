"""Mixture-of-experts on a CUDA GPU (skipped without one): the sync-free expert forms capture into a
CUDA graph and replay fresh routings correctly, and the engine's MoE decode step runs the same under
CUDA graphs as eagerly. Fresh random inputs every run.

The engine configs' experts are few next to their pairs (4 * tokens * top_k > experts), so eager and
padded graph steps both take the dense form: the same arithmetic, token-identical outputs.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from test_moe import random_moe, reference_moe
from tiny_models import moe_config

from voltllm.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from voltllm.engine.llm_engine import LLMEngine
from voltllm.layers.fused_moe import FusedMoE, experts_grouped, select_experts
from voltllm.protocol import EngineCoreRequest, EngineSamplingParams

pytestmark = pytest.mark.gpu


def _fp16_moe(num_tokens: int, num_experts: int, seed: int) -> tuple[FusedMoE, torch.Tensor, torch.Tensor]:
    x, w13, w2, logits = random_moe(num_tokens, num_experts, seed, hidden=128, inter=64)
    layer = FusedMoE(num_experts, 8, 128, 64, renormalize=True).to("cuda", torch.float16)
    layer.w13_weight.weight_loader(layer.w13_weight, w13.half())
    layer.w2_weight.weight_loader(layer.w2_weight, w2.half())
    return layer, x.half().cuda(), logits.half().cuda()


@pytest.mark.parametrize("num_tokens", [1, 4, 64, 256, 512])
def test_moe_decode_step_captures_in_a_cuda_graph(num_tokens: int) -> None:
    seed = int(torch.randint(0, 2**31, ()))
    layer, x, logits = _fp16_moe(num_tokens, 128, seed)  # 1, 4 tokens: gathered; more: dense
    with torch.inference_mode():
        static_x, static_logits = x.clone(), logits.clone()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            layer(static_x, static_logits)  # warm-up outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):  # a host sync inside would raise here
            static_out = layer(static_x, static_logits)
        _, fresh_x, fresh_logits = _fp16_moe(num_tokens, 128, seed + 1)
        static_x.copy_(fresh_x)
        static_logits.copy_(fresh_logits)
        graph.replay()
        weights, ids = select_experts(fresh_logits, 8, True)
        expected = experts_grouped(
            fresh_x.float(), layer.w13_weight.float(), layer.w2_weight.float(), weights, ids
        )
    torch.testing.assert_close(static_out.float(), expected, atol=2e-2, rtol=2e-2)


def test_gpu_forms_match_the_definition() -> None:
    x, w13, w2, logits = random_moe(40, 16, int(torch.randint(0, 2**31, ())), hidden=128, inter=64)
    expected = reference_moe(x, w13, w2, logits, 2, False)
    layer = FusedMoE(16, 2, 128, 64, renormalize=False).cuda()
    layer.w13_weight.weight_loader(layer.w13_weight, w13)
    layer.w2_weight.weight_loader(layer.w2_weight, w2)
    for rows in (1, 3, 40):  # gathered, dense
        with torch.inference_mode():
            got = layer(x[:rows].cuda(), logits[:rows].cuda())
        torch.testing.assert_close(got.double().cpu(), expected[:rows], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "name", ["qwen3_moe-e16-top8-mlp_only", "qwen2_moe-e6-top2-shared", "mixtral-e4-top2"]
)
def test_cuda_graphs_match_eager(name: str, tmp_path) -> None:
    config = moe_config(name, plain=True)
    config.hidden_size, config.head_dim = 256, 64  # the kernels take head sizes 64 / 128 / 256
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(tmp_path)
    outputs = []
    for eager in (True, False):
        engine = LLMEngine(
            EngineConfig(
                model=ModelConfig(model=str(tmp_path), dtype="float16"),
                cache=CacheConfig(num_kv_blocks=512),
                scheduler=SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=16),
                device="cuda",
                enforce_eager=eager,
            )
        )
        gen = torch.Generator().manual_seed(2)
        requests = [
            EngineCoreRequest(
                str(i),
                torch.randint(
                    3, 320, (int(torch.randint(5, 90, (), generator=gen)),), generator=gen
                ).tolist(),
                EngineSamplingParams(temperature=0.0, max_tokens=8 + 3 * i, ignore_eos=True),
                0.0,
            )
            for i in range(12)
        ]
        out = engine.generate_token_ids(requests)
        outputs.append({rid: o.new_token_ids for rid, o in out.items()})
        del engine
    assert outputs[0] == outputs[1]
