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
from tiny_models import PLAIN_COMMON

from voltllm.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from voltllm.engine.llm_engine import LLMEngine
from voltllm.protocol import EngineCoreRequest, EngineSamplingParams
from voltllm.worker.cuda_graphs import DecodeGraphs

pytestmark = pytest.mark.gpu

SHAPES = {
    # head size 64 (hidden / heads), GQA 2
    "llama": lambda: transformers.LlamaConfig(
        **{**PLAIN_COMMON, "hidden_size": 256, "intermediate_size": 512}, tie_word_embeddings=False
    ),
    # explicit head_dim 128, q/k norm, GQA 2
    "qwen3": lambda: transformers.Qwen3Config(
        **{**PLAIN_COMMON, "hidden_size": 256, "intermediate_size": 512},
        head_dim=128,
        tie_word_embeddings=True,
    ),
}
NUM_PROMPTS = 12
NEAR_TIE = 0.1  # fp32 logit difference below which fp16 rounding may pick either token


@pytest.fixture(scope="module", params=sorted(SHAPES))
def checkpoint(request, tmp_path_factory):
    """(model dir, transformers model in fp32 on the GPU) for one shape."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(SHAPES[request.param](), dtype=torch.float32)
    model_dir = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(model_dir)
    fp32 = model.to("cuda").eval()
    return model_dir, fp32


def fp32_margin(model, prompt: list[int], prefix: list[int], a: int, b: int) -> float:
    """|logit(a) - logit(b)| of the fp32 model after prompt + prefix: how close a divergence was."""
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + prefix], device="cuda")).logits[0, -1].float()
    return abs(float(logits[a] - logits[b]))


def first_divergence(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)


def prompts_and_lengths(vocab: int) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(1)
    prefix = [rng.randrange(3, vocab) for _ in range(40)]
    prompts = [
        (prefix if i % 3 == 0 else []) + [rng.randrange(3, vocab) for _ in range(rng.randrange(5, 90))]
        for i in range(NUM_PROMPTS)
    ]
    return prompts, [8 + 3 * i for i in range(NUM_PROMPTS)]


def generate(
    model_dir,
    backend: str,
    enforce_eager: bool,
    sampling: dict | None = None,
    async_scheduling: bool | None = None,
) -> dict[str, list[int]]:
    config = EngineConfig(
        model=ModelConfig(model=str(model_dir), dtype="float16"),
        cache=CacheConfig(num_kv_blocks=512),
        scheduler=SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=16),  # chunked prefill
        device="cuda",
        attention_backend=backend,
        enforce_eager=enforce_eager,
        async_scheduling=async_scheduling,
    )
    engine = LLMEngine(config)
    prompts, lengths = prompts_and_lengths(engine.vocab_size)
    sampling = sampling or {"temperature": 0.0}
    requests = [
        EngineCoreRequest(str(i), p, EngineSamplingParams(max_tokens=n, ignore_eos=True, **sampling), 0.0)
        for i, (p, n) in enumerate(zip(prompts, lengths, strict=True))
    ]
    outputs = engine.generate_token_ids(requests)
    return {rid: out.new_token_ids for rid, out in outputs.items()}


def test_sm70_backend_matches_torch_backend_and_transformers(checkpoint):
    """fp16 greedy decoding against transformers in fp32 (the exact oracle). Sequences must be identical,
    except that fp16 rounding may flip a genuine near-tie: then the two tokens' fp32 logits must be
    within NEAR_TIE of each other, and the sequence is compared only up to there (as vLLM's
    `check_logprobs_close`). Most sequences must match in full."""
    model_dir, hf_fp32 = checkpoint
    outputs = {
        "sm70": generate(model_dir, "sm70", enforce_eager=True),
        "torch": generate(model_dir, "torch", enforce_eager=True),
    }
    prompts, lengths = prompts_and_lengths(hf_fp32.config.vocab_size)
    full_matches, failures = 0, []
    for i, (prompt, n) in enumerate(zip(prompts, lengths, strict=True)):
        with torch.inference_mode():
            ref = hf_fp32.generate(
                torch.tensor([prompt], device="cuda"),
                max_new_tokens=n,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )[0, len(prompt) :].tolist()
        for name, tokens in outputs.items():
            ours = tokens[str(i)]
            at = first_divergence(ours, ref)
            if at is None:
                full_matches += 1
                continue
            margin = fp32_margin(hf_fp32, prompt, ref[:at], ref[at], ours[at])
            if margin >= NEAR_TIE:
                failures.append(f"prompt {i} {name} at token {at}: fp32 logit margin {margin:.4f}")
    assert not failures, "differs from transformers beyond a near-tie: " + "; ".join(failures)
    assert full_matches >= 0.75 * 2 * NUM_PROMPTS, f"only {full_matches} of {2 * NUM_PROMPTS} matched in full"


@pytest.mark.parametrize("sampling", [None, {"temperature": 0.8, "top_p": 0.9, "seed": 7}])
def test_cuda_graphs_match_eager(checkpoint, sampling, monkeypatch):
    model_dir = checkpoint[0]
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


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
@pytest.mark.parametrize("sampling", [None, {"temperature": 0.8, "top_p": 0.9, "seed": 7}])
def test_async_scheduling_gives_the_synchronous_tokens(checkpoint, sampling, enforce_eager, monkeypatch):
    """Step N+1 launched before step N's ids reach the host (its inputs read from the device) gives
    the same greedy and seeded tokens as the synchronous loop, with graphs (padded buckets) and eager;
    and the asynchronous path really ran (steps were left running)."""
    from voltllm.worker.model_runner import ModelRunner

    running: list[bool] = []
    original = ModelRunner.enqueue

    def recording_enqueue(self, plan):
        handle = original(self, plan)
        running.append(handle.is_running)
        return handle

    monkeypatch.setattr(ModelRunner, "enqueue", recording_enqueue)
    model_dir = checkpoint[0]
    on = generate(model_dir, "sm70", enforce_eager, sampling, async_scheduling=True)
    assert sum(running) > len(running) // 2, f"only {sum(running)} of {len(running)} steps ran ahead"
    assert on == generate(model_dir, "sm70", enforce_eager, sampling, async_scheduling=False)
