"""Structured outputs under asynchronous scheduling on CUDA: the mask thread queues the apply and the
draw on the runner's stream while the main thread plans the next step (`ModelRunner._draw_later`).

A tiny Llama checkpoint (random weights, fp16) with a synthetic vocabulary for the grammar engine
(benches/structured_step.py's): constrained requests of several kinds beside unconstrained ones, greedy
and seeded, with CUDA graphs and eager. The tokens must equal the synchronous engine's, every
constrained output must be accepted by a fresh matcher (a late or wrong mask fails it), and steps
with grammars must really have run ahead.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import transformers
from tiny_models import PLAIN_COMMON

from voltllm.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from voltllm.engine.llm_engine import LLMEngine
from voltllm.protocol import EngineCoreRequest, EngineSamplingParams, StructuredOutput

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benches"))
from structured_step import synthetic_tokenizer  # noqa: E402

pytestmark = pytest.mark.gpu

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["id", "tags", "ok"],
    "additionalProperties": False,
}
CONSTRAINTS = [
    StructuredOutput(kind="json", spec=json.dumps(SCHEMA)),
    StructuredOutput(kind="regex", spec=r"[a-z]{3,8}-[0-9]{1,4}"),
    StructuredOutput(kind="choice", spec='["red", "green", "blue"]'),
    StructuredOutput(kind="json_object"),
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**PLAIN_COMMON, tie_word_embeddings=False)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    path = tmp_path_factory.mktemp("llama")
    model.save_pretrained(path)
    return path


def run(model_dir: Path, async_scheduling: bool, enforce_eager: bool, sampling: dict) -> tuple[dict, list]:
    """Every request's tokens, and per enqueued step (left running, a grammar in the batch)."""
    config = EngineConfig(
        model=ModelConfig(model=str(model_dir), dtype="float16"),
        cache=CacheConfig(num_kv_blocks=512),
        scheduler=SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=16),
        device="cuda",
        enforce_eager=enforce_eager,
        async_scheduling=async_scheduling,
    )
    engine = LLMEngine(config)
    core = engine.core
    core.structured_output._tokenizer = synthetic_tokenizer(core.vocab_size, core.eos_token_ids[0])
    runner, steps = core.runner, []
    enqueue = runner.enqueue

    def recording_enqueue(plan):
        handle = enqueue(plan)
        steps.append((handle.is_running, runner._num_constrained > 0))
        return handle

    runner.enqueue = recording_enqueue
    requests = []
    for i in range(12):
        prompt = [(37 * i + 11 * j) % 300 + 10 for j in range(5 + 3 * i)]
        constraint = CONSTRAINTS[i % len(CONSTRAINTS)] if i % 3 else None
        params = EngineSamplingParams(max_tokens=24, structured_output=constraint, **sampling)
        requests.append(EngineCoreRequest(str(i), prompt, params, 0.0))
    outputs = engine.generate_token_ids(requests)
    for request in requests:
        constraint = request.sampling_params.structured_output
        if constraint is not None:
            matcher = core.structured_output.compile(constraint).matcher
            tokens = outputs[request.request_id].new_token_ids
            ends_at_eos = bool(tokens) and tokens[-1] in core.eos_token_ids
            assert all(matcher.consume_token(t) for t in tokens[: len(tokens) - ends_at_eos])
    return {rid: out.new_token_ids for rid, out in outputs.items()}, steps


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {"temperature": 0.8, "top_p": 0.9, "seed": 5}])
def test_constrained_steps_run_ahead_on_cuda_with_the_synchronous_tokens(
    model_dir: Path, enforce_eager: bool, sampling: dict
) -> None:
    ahead, steps = run(model_dir, True, enforce_eager, sampling)
    assert sum(running and constrained for running, constrained in steps) > 10, "grammar steps ran ahead"
    synchronous, _ = run(model_dir, False, enforce_eager, sampling)
    assert ahead == synchronous
