"""The engine at tensor_parallel_size=2 on the CPU (gloo, fp32): `LLM.generate` answers transformers'
greedy tokens, with rank 0 scheduling and sampling and a worker process holding the other shard.

The architectures of `PLAIN_CONFIGS`, between them: one KV head for two ranks (replicated), a
vocabulary of 321 rows (padded to 322, tied and untied heads), chunked prefill and prefix-cache hits;
Qwen3's ranks meet as two hosts would (torchrun's variables, the worker started by hand); a Qwen3-MoE
shards its experts. Also: the
workers end with the engine (shutdown, garbage collection, the parent killed), a worker killed
mid-run is a clear error, and impossible configurations are refused before any process starts.
"""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from tiny_models import add_fixture_tokenizer, engine_prompts, hf_greedy, save_moe_model, save_plain_model

from voltllm import LLM, SamplingParams
from voltllm.config import EngineConfig
from voltllm.distributed.rendezvous import Rendezvous, free_local_port
from voltllm.engine.tensor_parallel import check_tensor_parallel_config
from voltllm.worker.tensor_parallel import TensorParallelWorkerError

PYTHON_DIR = Path(__file__).resolve().parents[2] / "python"
NEW_TOKENS = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
WORKER = "voltllm.engine.tp_worker"


def save_model(arch: str, out_dir: Path, **overrides: object) -> tuple[Path, torch.nn.Module]:
    """A plain tiny checkpoint with a tokenizer beside it (what `LLM` needs)."""
    model_dir, hf_model = save_plain_model(arch, out_dir, **overrides)
    return add_fixture_tokenizer(model_dir), hf_model


def start_llm(model_dir: Path) -> LLM:
    return LLM(
        model=str(model_dir),
        tensor_parallel_size=2,
        dtype="float32",
        device="cpu",
        num_kv_blocks=64,
        max_num_batched_tokens=40,  # prompts of up to 70 tokens: chunked prefill
        max_num_seqs=8,
    )


def assert_greedy_matches(llm: LLM, hf_model: torch.nn.Module) -> None:
    prompts = engine_prompts(320, 6)  # every third shares a 24-token prefix
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    with torch.inference_mode():
        for i, (prompt, out) in enumerate(zip(prompts, outs, strict=True)):
            expected, _ = hf_greedy(hf_model, prompt, NEW_TOKENS)
            assert out.outputs[0].token_ids == expected, f"prompt {i} ({len(prompt)} tokens)"
    assert llm.engine.get_stats().prefix_cache_hits > 0


def worker_children() -> list[int]:
    """Pids of this process's live children running the tensor-parallel worker."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes()
        except OSError:
            continue  # exited while we looked
        if int(fields[1]) == os.getpid() and fields[0] != "Z" and WORKER.encode() in cmdline:
            pids.append(int(stat.parent.name))
    return pids


def wait_until(condition, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.2)
    return condition()


def pid_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.parametrize(
    ("arch", "overrides"),
    [
        ("llama", {"num_key_value_heads": 1, "vocab_size": 321}),  # KV head replicated; untied odd head
        ("qwen2", {"vocab_size": 321}),  # tied embedding, padded vocabulary
        ("mistral", {}),
    ],
)
def test_greedy_matches_transformers_and_workers_end(arch: str, overrides: dict, tmp_path: Path) -> None:
    model_dir, hf_model = save_model(arch, tmp_path / arch, **overrides)
    llm = start_llm(model_dir)
    [worker] = worker_children()
    runner = llm.engine.core.runner.runner  # rank 0's own runner, behind the driver
    kv_heads = overrides.get("num_key_value_heads", 2)
    assert runner.kv_caches[0].shape[3] == max(kv_heads // 2, 1)  # this rank's share of the KV heads
    assert_greedy_matches(llm, hf_model)
    if arch == "mistral":
        del llm, runner  # dropping the LLM stops its worker
        gc.collect()
    else:
        llm.shutdown()
    assert wait_until(lambda: not pid_alive(worker)), "the worker outlived its engine"
    assert worker_children() == []


def test_moe_experts_shard_through_the_engine(tmp_path: Path) -> None:
    """Qwen3-MoE (a dense layer, then 8 experts top-2) at tp=2: each rank holds its slice of every
    expert, the expert outputs are all-reduced."""
    model_dir = tmp_path / "qwen3_moe"
    hf_model = save_moe_model("qwen3_moe-e8-top2-norm-step2", model_dir, plain=True)
    add_fixture_tokenizer(model_dir)
    llm = start_llm(model_dir)
    try:
        assert_greedy_matches(llm, hf_model)
    finally:
        llm.shutdown()


def test_two_hosts_rendezvous_then_a_dead_worker_is_an_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 0 and a worker started by hand meet through torchrun's variables, as on two hosts."""
    model_dir, hf_model = save_model("qwen3", tmp_path / "qwen3")
    port = free_local_port()
    for key, value in Rendezvous("127.0.0.1", port, 0, 2).env().items():
        monkeypatch.setenv(key, value)
    worker_env = {**os.environ, **Rendezvous("127.0.0.1", port, 1, 2).env(), "PYTHONPATH": str(PYTHON_DIR)}
    worker = subprocess.Popen([sys.executable, "-m", WORKER], env=worker_env)
    try:
        llm = start_llm(model_dir)
        assert_greedy_matches(llm, hf_model)
        worker.kill()
        worker.wait()
        with pytest.raises(TensorParallelWorkerError, match="stopped answering"):
            llm.generate({"prompt_token_ids": [5, 6, 7]}, GREEDY, use_tqdm=False)
        with pytest.raises(TensorParallelWorkerError, match="shut down"):
            llm.generate({"prompt_token_ids": [5, 6, 7]}, GREEDY, use_tqdm=False)
    finally:
        if worker.poll() is None:
            worker.kill()
        worker.wait()


def test_workers_exit_when_the_engine_process_is_killed(tmp_path: Path) -> None:
    model_dir, _ = save_model("llama", tmp_path / "llama")
    script = textwrap.dedent(
        f"""
        from voltllm import LLM
        llm = LLM(model={str(model_dir)!r}, tensor_parallel_size=2, dtype="float32", device="cpu",
                  num_kv_blocks=16)
        print("ready", flush=True)
        import time
        time.sleep(600)
        """
    )
    # The child imports voltllm as this process does (the installed wheel in CI, PYTHONPATH in a dev
    # tree): forcing the source tree would miss the built voltllm._core.
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout.readline().strip() == "ready"
        workers = [
            int(p.parent.name)
            for p in Path("/proc").glob("[0-9]*/stat")
            if _ppid(p) == parent.pid and WORKER.encode() in _cmdline(p.parent)
        ]
        assert len(workers) == 1
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        assert wait_until(lambda: not pid_alive(workers[0])), "the worker outlived its killed parent"
    finally:
        if parent.poll() is None:
            parent.kill()
        parent.wait()


def _ppid(stat: Path) -> int:
    try:
        return int(stat.read_text().rsplit(")", 1)[1].split()[1])
    except OSError:
        return -1


def _cmdline(proc: Path) -> bytes:
    try:
        return (proc / "cmdline").read_bytes()
    except OSError:
        return b""


# ----- refusals: before any process starts -----------------------------------------------------


@pytest.mark.parametrize("size", [0, -2])
def test_fewer_than_one_rank_is_refused(size: int) -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size must be an integer >= 1"):
        LLM(model="/nonexistent", tensor_parallel_size=size)


def test_heads_not_divisible_are_refused(tmp_path: Path) -> None:
    model_dir, _ = save_model("llama", tmp_path / "llama")  # 4 attention heads, 2 KV heads
    with pytest.raises(ValueError, match="does not divide the model's 4 attention heads"):
        LLM(model=str(model_dir), tensor_parallel_size=3, device="cpu")
    assert worker_children() == []
    odd_kv = SimpleNamespace(num_attention_heads=6, num_key_value_heads=3)
    with pytest.raises(ValueError, match="3 KV heads"):
        check_tensor_parallel_config(EngineConfig(tensor_parallel_size=2), odd_kv, torch.device("cpu"))
    replicated = SimpleNamespace(num_attention_heads=8, num_key_value_heads=2)
    check_tensor_parallel_config(EngineConfig(tensor_parallel_size=4), replicated, torch.device("cpu"))


def test_more_ranks_than_gpus_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    config = SimpleNamespace(num_attention_heads=4, num_key_value_heads=2)
    with pytest.raises(ValueError, match="needs 2 GPUs .* but 1 are visible"):
        check_tensor_parallel_config(EngineConfig(tensor_parallel_size=2), config, torch.device("cuda"))


def test_rendezvous_variables_are_checked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="set but not MASTER_PORT, WORLD_SIZE"):
        Rendezvous.from_env({"MASTER_ADDR": "h0", "RANK": "0"})
    with pytest.raises(ValueError, match="RANK 2 is out of range for WORLD_SIZE 2"):
        Rendezvous.from_env({"MASTER_ADDR": "h0", "MASTER_PORT": "29500", "RANK": "2", "WORLD_SIZE": "2"})
    model_dir, _ = save_model("llama", tmp_path / "llama")
    for key, value in Rendezvous("127.0.0.1", 29500, 1, 2).env().items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ValueError, match="RANK 1 of WORLD_SIZE 2; the engine is rank 0"):
        LLM(model=str(model_dir), tensor_parallel_size=2, device="cpu")


def test_step_command_carries_the_plan_and_the_sampled_ids() -> None:
    from types import MappingProxyType

    import numpy as np

    from voltllm.core.sched_output import CachedRequestData, NewRequestData, SchedulerOutput
    from voltllm.protocol import EngineSamplingParams
    from voltllm.worker.tensor_parallel import _STEP_DECODER, encode_step

    params = EngineSamplingParams(temperature=0.7, top_k=5, seed=3, stop_token_ids=[9])
    plan = SchedulerOutput(
        scheduled_new_reqs=(NewRequestData("new", (1, 2, 3), 3, params, (4, 5), 2),),
        scheduled_cached_reqs=(CachedRequestData("old", (7,), 31),),
        num_scheduled_tokens=MappingProxyType({"old": 1, "new": 1}),
        total_num_scheduled_tokens=2,
        finished_req_ids=frozenset({"gone"}),
    )
    step = _STEP_DECODER.decode(encode_step(plan, np.array([11, 12])))
    assert step.sampled_before == [11, 12]
    assert step.plan.scheduled_new_reqs == plan.scheduled_new_reqs  # sampling params included
    assert step.plan.scheduled_cached_reqs == plan.scheduled_cached_reqs
    assert list(step.plan.num_scheduled_tokens.items()) == [("old", 1), ("new", 1)]  # batch order kept
    assert step.plan.finished_req_ids == plan.finished_req_ids
    assert _STEP_DECODER.decode(encode_step(plan, None)).sampled_before is None
