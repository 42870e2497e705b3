"""Data-parallel configuration (issue 18): which GPUs each engine process takes, the CPU threads
each rank gets, and the configurations refused at start with their reason (`voltllm serve`, `LLM`,
the engine process itself)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from voltllm import LLM
from voltllm.config import EngineConfig
from voltllm.engine.args import to_argv
from voltllm.engine.data_parallel import (
    check_data_parallel_config,
    claim_engine_devices,
    default_cpu_threads,
    engine_devices,
)
from voltllm.entrypoints.cli import build_parser


def dp(size: int, tp: int = 1, device: str = "auto") -> EngineConfig:
    return EngineConfig(data_parallel_size=size, tensor_parallel_size=tp, device=device)


def test_each_engine_takes_its_own_slice_of_the_gpus() -> None:
    assert [engine_devices(i, dp(4), None) for i in range(4)] == ["0", "1", "2", "3"]
    assert [engine_devices(i, dp(2, tp=2), None) for i in range(2)] == ["0,1", "2,3"]
    # The parent's own list is sliced, whatever it names (indices or UUIDs).
    assert engine_devices(1, dp(2, tp=2), "4,5, 6,7") == "6,7"
    assert engine_devices(1, dp(2), "GPU-aa,GPU-bb") == "GPU-bb"


def test_a_slice_past_the_visible_gpus_or_a_bad_index_is_refused() -> None:
    needs = r"engine 1 of 2 needs devices 2\.\.3 of CUDA_VISIBLE_DEVICES='0,1,2'"
    with pytest.raises(ValueError, match=needs):
        engine_devices(1, dp(2, tp=2), "0,1,2")
    with pytest.raises(ValueError, match="engine index 2 is out of range for data_parallel_size 2"):
        engine_devices(2, dp(2), None)


def test_claiming_narrows_the_environment_only_for_several_engines() -> None:
    env = {"CUDA_VISIBLE_DEVICES": "3,2,1,0"}
    claim_engine_devices(1, dp(2, tp=2), env)
    assert env == {"CUDA_VISIBLE_DEVICES": "1,0"}
    env = {}
    claim_engine_devices(0, dp(1, tp=2), env)
    assert env == {}, "one engine keeps every device it was given"


@pytest.mark.parametrize("size", [0, -1, 1.5, True])
def test_sizes_below_one_or_not_integers_are_refused(size: object) -> None:
    with pytest.raises(ValueError, match="data_parallel_size must be an integer >= 1"):
        EngineConfig(data_parallel_size=size)  # type: ignore[arg-type]


def test_more_ranks_than_gpus_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    needs = r"data_parallel_size 2 x tensor_parallel_size 2 needs 4 GPUs .* 3 are visible"
    with pytest.raises(ValueError, match=needs):
        check_data_parallel_config(dp(2, tp=2))
    check_data_parallel_config(dp(3))  # fits
    # On the CPU there is no device to run out of: each engine gets threads instead.
    check_data_parallel_config(dp(8, device="cpu"))


def test_cpu_threads_are_shared_out_leaving_the_front_end_a_core() -> None:
    assert default_cpu_threads(9, dp(2)) == 4
    assert default_cpu_threads(9, dp(2, tp=2)) == 2
    assert default_cpu_threads(2, dp(2)) == 1


def test_llm_refuses_data_parallel_like_vllm() -> None:
    with pytest.raises(ValueError, match="voltllm serve --data-parallel-size 2"):
        LLM(model="/nonexistent", data_parallel_size=2)


def test_flags_are_spelled_as_vllm_spells_them_and_reach_the_engine() -> None:
    args = build_parser().parse_args(["serve", "-dp", "2", "-tp", "2"])
    assert (args.data_parallel_size, args.tensor_parallel_size) == (2, 2)
    args = build_parser().parse_args(["serve", "--data-parallel-size", "3"])
    argv = to_argv(args, "/m")
    assert argv[argv.index("--data-parallel-size") + 1] == "3"


def test_serve_refuses_a_bad_size_at_start_with_the_reason() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "voltllm.entrypoints.cli", "serve", "--data-parallel-size", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 1
    assert "data_parallel_size must be an integer >= 1, got 0" in out.stderr, out.stderr


def test_an_engine_process_outside_the_data_parallel_range_says_why(tmp_path: Path) -> None:
    # Nobody listens on these sockets: the engine logs the refusal, sends DEAD into the void and
    # exits non-zero before loading anything.
    out = subprocess.run(
        [sys.executable, "-m", "voltllm.engine.core_proc", "--device", "cpu",
         "--data-parallel-size", "2", "--engine-index", "2",
         "--input-address", f"ipc://{tmp_path}/in", "--output-address", f"ipc://{tmp_path}/out"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 1
    assert "engine index 2 is out of range for data_parallel_size 2" in out.stderr, out.stderr[-2000:]
