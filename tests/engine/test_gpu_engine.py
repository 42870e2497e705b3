"""The engine on a CUDA GPU: the SM70 kernels, the torch backend, transformers and CUDA graphs agree.

Random Llama- and Qwen3-shaped models (head sizes 64 and 128, GQA) are built with transformers on the
GPU and saved; each engine variant greedily generates for the same prompts (chunked prefill, a shared
prefix, sequences finishing at different lengths so decode batches shrink through several CUDA-graph
buckets with padding). Skipped without CUDA.
"""

from __future__ import annotations

import random

import pytest
import torch
import transformers
from hf_tiny import COMMON

from voltllm.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from voltllm.engine.llm_engine import LLMEngine
from voltllm.engine.protocol import EngineCoreRequest, SamplingParams
from voltllm.worker.cuda_graphs import DecodeGraphs

pytestmark = pytest.mark.gpu

SHAPES = {
    # head size 64 (hidden / heads), GQA 2
    "llama": lambda: transformers.LlamaConfig(
        **{**COMMON, "hidden_size": 256, "intermediate_size": 512}, tie_word_embeddings=False
    ),
    # explicit head_dim 128, q/k norm, GQA 2
    "qwen3": lambda: transformers.Qwen3Config(
        **{**COMMON, "hidden_size": 256, "intermediate_size": 512}, head_dim=128, tie_word_embeddings=True
    ),
}
NUM_PROMPTS = 12


@pytest.fixture(scope="module", params=sorted(SHAPES))
def checkpoint(request, tmp_path_factory):
    """(model dir, transformers model in fp16 on the GPU) for one shape."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(SHAPES[request.param](), dtype=torch.float32)
    model_dir = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(model_dir)
    return model_dir, model.to("cuda", torch.float16).eval()


def prompts_and_lengths(vocab: int) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(1)
    prefix = [rng.randrange(3, vocab) for _ in range(40)]
    prompts = [
        (prefix if i % 3 == 0 else []) + [rng.randrange(3, vocab) for _ in range(rng.randrange(5, 90))]
        for i in range(NUM_PROMPTS)
    ]
    return prompts, [8 + 3 * i for i in range(NUM_PROMPTS)]


def generate(model_dir, backend: str, enforce_eager: bool, sampling: dict | None = None) -> dict[str, list[int]]:
    config = EngineConfig(
        model=ModelConfig(model=str(model_dir), dtype="float16"),
        cache=CacheConfig(num_kv_blocks=512),
        scheduler=SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=16),  # chunked prefill
        device="cuda",
        attention_backend=backend,
        enforce_eager=enforce_eager,
    )
    engine = LLMEngine(config)
    prompts, lengths = prompts_and_lengths(engine.vocab_size)
    requests = [
        EngineCoreRequest(
            str(i), p, SamplingParams(max_tokens=n, ignore_eos=True, **(sampling or {"temperature": 0.0})), 0.0
        )
        for i, (p, n) in enumerate(zip(prompts, lengths, strict=True))
    ]
    outputs = engine.generate_token_ids(requests)
    return {rid: out.new_token_ids for rid, out in outputs.items()}


def test_sm70_backend_matches_torch_backend_and_transformers(checkpoint):
    model_dir, hf_model = checkpoint
    sm70 = generate(model_dir, "sm70", enforce_eager=True)
    torch_backend = generate(model_dir, "torch", enforce_eager=True)
    prompts, lengths = prompts_and_lengths(hf_model.config.vocab_size)
    for i, (prompt, n) in enumerate(zip(prompts, lengths, strict=True)):
        with torch.inference_mode():
            ref = hf_model.generate(
                torch.tensor([prompt], device="cuda"),
                max_new_tokens=n,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )[0, len(prompt) :].tolist()
        assert sm70[str(i)] == ref, f"prompt {i}: sm70 backend differs from transformers"
        assert torch_backend[str(i)] == ref, f"prompt {i}: torch backend differs from transformers"


@pytest.mark.parametrize("sampling", [None, {"temperature": 0.8, "top_p": 0.9, "seed": 7}])
def test_cuda_graphs_match_eager(checkpoint, sampling, monkeypatch):
    model_dir, _ = checkpoint
    replayed: list[int] = []
    original = DecodeGraphs.replay

    def counting_replay(self, size):
        replayed.append(size)
        return original(self, size)

    monkeypatch.setattr(DecodeGraphs, "replay", counting_replay)
    graphs = generate(model_dir, "sm70", enforce_eager=False, sampling=sampling)
    assert len(set(replayed)) >= 3, f"decode steps should replay several buckets, got {sorted(set(replayed))}"
    eager = generate(model_dir, "sm70", enforce_eager=True, sampling=sampling)
    assert graphs == eager
