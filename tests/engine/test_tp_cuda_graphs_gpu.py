"""A tensor-parallel engine on CUDA captures its decode graphs with the NCCL collectives inside (issue
18), checked on one GPU: the engine is built through the tensor-parallel path (rank 0 of a world of
one, its model group on NCCL, the `TensorParallelDriver` as its runner), every row-parallel layer
all-reduces and the LM head all-gathers its logits over that NCCL group although one rank needs
neither (a one-rank NCCL collective still launches its kernel, so the capture and the replays run
real NCCL work). Greedy tokens must equal those of the engine without tensor parallelism, with
graphs and eagerly. Two ranks need two GPUs (issue 19's `benches/parallel.py`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import transformers
from tiny_models import PLAIN_COMMON, engine_prompts

from voltllm.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from voltllm.distributed import get_tp_group
from voltllm.engine.core import EngineCore
from voltllm.engine.llm_engine import LLMEngine
from voltllm.engine.tensor_parallel import start_tensor_parallel_engine
from voltllm.layers.embedding import ParallelLMHead
from voltllm.layers.linear import RowParallelLinear
from voltllm.layers.linear_method import linear
from voltllm.protocol import EngineCoreRequest, EngineSamplingParams
from voltllm.worker.cuda_graphs import DecodeGraphs

pytestmark = pytest.mark.gpu

NEW_TOKENS = 24


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        **{**PLAIN_COMMON, "hidden_size": 256, "intermediate_size": 512}, tie_word_embeddings=False
    )
    path = tmp_path_factory.mktemp("llama")
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    return path


def engine_config(model_dir: Path, enforce_eager: bool) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(model=str(model_dir), dtype="float16"),
        cache=CacheConfig(num_kv_blocks=256),
        scheduler=SchedulerConfig(max_num_seqs=16),
        device="cuda",
        enforce_eager=enforce_eager,
    )


def greedy(engine: LLMEngine) -> list[list[int]]:
    # Sequences of different lengths, so decode batches shrink through several graph buckets.
    prompts = engine_prompts(320, 12, seed=3)
    requests = [
        EngineCoreRequest(
            f"r{i}", p, EngineSamplingParams(temperature=0.0, max_tokens=NEW_TOKENS - i, ignore_eos=True), 0.0
        )
        for i, p in enumerate(prompts)
    ]
    outputs = engine.generate_token_ids(requests)
    return [outputs[r.request_id].new_token_ids for r in requests]


class NcclCounts:
    """All-reduces run while a graph was being captured or eagerly, LM-head gathers captured, and
    graph replays."""

    captured = 0
    eager = 0
    gathers_captured = 0
    replays = 0


@pytest.fixture
def row_parallel_over_nccl(monkeypatch: pytest.MonkeyPatch) -> type[NcclCounts]:
    """Every row-parallel layer all-reduces, and the LM head all-gathers, over the model group whatever
    its size; replays counted."""
    NcclCounts.captured = NcclCounts.eager = NcclCounts.gathers_captured = NcclCounts.replays = 0
    plain_forward = RowParallelLinear.forward
    plain_head = ParallelLMHead.forward

    def forward(self: RowParallelLinear, x: torch.Tensor) -> torch.Tensor:
        group = get_tp_group().group
        if group is None:  # the engine without tensor parallelism: no group to reduce over
            return plain_forward(self, x)
        assert dist.get_backend(group) == "nccl"
        out = self.linear_method.apply(self, x, self.bias)
        dist.all_reduce(out, group=group)
        if torch.cuda.is_current_stream_capturing():
            NcclCounts.captured += 1
        else:
            NcclCounts.eager += 1
        return out

    def head(self: ParallelLMHead, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        group = get_tp_group().group
        if group is None:
            return plain_head(self, hidden, out)
        logits = linear(hidden, self.weight)  # the head's own GEMM, so the logits match the plain engine's
        parts = [torch.empty_like(logits)]
        dist.all_gather(parts, logits, group=group)
        logits = torch.cat(parts, dim=-1)[:, : self.vocab_size]
        if torch.cuda.is_current_stream_capturing():
            NcclCounts.gathers_captured += 1
        return logits.float() if out is None else out.copy_(logits)

    replay = DecodeGraphs.replay

    def counted_replay(self: DecodeGraphs, size: int) -> torch.Tensor:
        NcclCounts.replays += 1
        return replay(self, size)

    monkeypatch.setattr(RowParallelLinear, "forward", forward)
    monkeypatch.setattr(ParallelLMHead, "forward", head)
    monkeypatch.setattr(DecodeGraphs, "replay", counted_replay)
    return NcclCounts


def tensor_parallel_engine(model_dir: Path, enforce_eager: bool) -> LLMEngine:
    config = engine_config(model_dir, enforce_eager)
    return LLMEngine(config, core=start_tensor_parallel_engine(EngineCore, config, engine_index=0))


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
def test_nccl_all_reduce_inside_decode_graphs_matches_the_plain_engine(
    model_dir: Path, enforce_eager: bool, row_parallel_over_nccl: type[NcclCounts]
) -> None:
    plain = LLMEngine(engine_config(model_dir, enforce_eager))
    expected = greedy(plain)
    assert (plain.core.runner.graphs is None) == enforce_eager, (
        "the plain engine's graphs do not follow enforce_eager: an attention backend that cannot be "
        "captured (did the CUDA kernels build?)"
    )
    del plain
    torch.cuda.empty_cache()

    engine = tensor_parallel_engine(model_dir, enforce_eager)
    try:
        runner = engine.core.runner.runner  # the driver's own ModelRunner
        assert (runner.graphs is None) == enforce_eager
        got = greedy(engine)
    finally:
        engine.shutdown()
    assert not dist.is_initialized(), "the engine left its process group"
    assert got == expected
    counts = row_parallel_over_nccl
    assert counts.eager > 0, "the eager steps ran no NCCL all-reduce"
    if enforce_eager:
        assert counts.captured == counts.gathers_captured == counts.replays == 0
    else:
        # Two row-parallel layers per decoder layer, in every captured bucket.
        assert counts.captured >= 2 * PLAIN_COMMON["num_hidden_layers"] * len(runner.graphs.sizes)
        assert counts.gathers_captured >= len(runner.graphs.sizes)
        assert counts.replays > NEW_TOKENS // 2, "decode steps did not replay the graphs"
