"""Starting a tensor-parallel engine: rank 0 here, one worker process per other rank.

The process that builds the EngineCore is rank 0. When the environment names a rendezvous
(`MASTER_ADDR`, `MASTER_PORT`, `RANK`, `WORLD_SIZE`, as torchrun sets them) the other ranks are
started elsewhere, by hand or by torchrun, as `python -m voltllm.engine.tp_worker` with their own
variables (on other hosts too); otherwise rank 0 starts them here, one subprocess each, on a free
local port. Either way every rank meets at rank 0's store (`distributed.rendezvous`), receives the
`EngineConfig` from rank 0 (so the workers need no flags), loads its shard and follows rank 0's
commands (`worker.tensor_parallel`).

Workers started here end with the engine: `EngineCore.shutdown` (or the driver's garbage collection,
or this process's exit) tells them to stop and waits for them, and a worker whose parent dies exits
on its own (`tp_worker` watches it; gloo also fails its next receive).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from voltllm.config import EngineConfig
from voltllm.distributed.rendezvous import (
    Rendezvous,
    free_local_port,
    init_distributed,
    init_model_group,
    shutdown_distributed,
)
from voltllm.engine.core import build_model_runner, load_engine_model, resolve_device
from voltllm.loader.loader import load_hf_config, resolve_model_source
from voltllm.worker.tensor_parallel import (
    DRIVER_RANK,
    TensorParallelDriver,
    TensorParallelWorkerError,
    broadcast_command,
)

logger = logging.getLogger(__name__)

# How long rank 0 waits for the other ranks to arrive: local workers import torch and voltllm first
# (seconds on a busy CPU); ranks on other hosts are started by hand, so they get torch's default.
LOCAL_RENDEZVOUS_TIMEOUT = timedelta(minutes=3)
REMOTE_RENDEZVOUS_TIMEOUT = timedelta(minutes=30)
WORKER_EXIT_TIMEOUT_S = 30.0
ABORT_EXIT_TIMEOUT_S = 5.0  # a worker stuck in a rendezvous that failed need not be waited for


def check_tensor_parallel_config(config: EngineConfig, hf_config: Any, device: torch.device) -> None:
    """Refuse, with the reason, a tensor-parallel size this model or host cannot run."""
    tp = config.tensor_parallel_size
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    if heads % tp:
        raise ValueError(
            f"tensor_parallel_size {tp} does not divide the model's {heads} attention heads: "
            "each rank must hold a whole number of heads"
        )
    if (kv_heads % tp) if tp <= kv_heads else (tp % kv_heads):
        raise ValueError(
            f"tensor_parallel_size {tp} and the model's {kv_heads} KV heads: the ranks must split the "
            "KV heads evenly, or (more ranks than KV heads) replicate each on the same number of ranks"
        )
    if device.type == "cuda" and Rendezvous.from_env() is None and tp > torch.cuda.device_count():
        raise ValueError(
            f"tensor_parallel_size {tp} needs {tp} GPUs (one per rank), but {torch.cuda.device_count()} "
            "are visible"
        )


def cpu_threads_per_rank(config: EngineConfig) -> int:
    """Torch threads for each rank on the CPU: the configured count, else the cores shared out."""
    if config.cpu_threads is not None:
        return config.cpu_threads
    return max(1, (os.cpu_count() or 1) // config.tensor_parallel_size)


class LocalWorkers:
    """The worker processes rank 0 started on this host; each one's output goes to a log file, kept
    when a worker fails (its end is quoted in the error), removed after a clean exit of all."""

    def __init__(self, rendezvous: Rendezvous) -> None:
        self.log_dir = Path(tempfile.mkdtemp(prefix="voltllm-tp-"))
        log_dir = self.log_dir
        self.processes: list[subprocess.Popen] = []
        self.logs: list[Path] = []
        for rank in range(1, rendezvous.world_size):
            log = log_dir / f"rank{rank}.log"
            env = {**os.environ, **_rank_env(rendezvous, rank)}
            with log.open("wb") as out:
                command = [sys.executable, "-m", "voltllm.engine.tp_worker", "--parent-pid", str(os.getpid())]
                self.processes.append(
                    subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)
                )
            self.logs.append(log)

    def describe(self) -> str:
        """Which workers have exited, with the end of their output."""
        lines = []
        for rank, (proc, log) in enumerate(zip(self.processes, self.logs, strict=True), start=1):
            if proc.poll() is not None:
                tail = log.read_text(errors="replace").strip().splitlines()[-8:]
                lines.append(f"rank {rank} exited with code {proc.returncode}:\n" + "\n".join(tail))
        return "\n".join(lines)

    def wait(self, timeout_s: float) -> None:
        """Wait for the workers to exit; kill those still running after `timeout_s`."""
        for proc in self.processes:
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                logger.warning("tensor-parallel worker %d did not exit: killing it", proc.pid)
                proc.kill()
                proc.wait()
        if all(proc.returncode == 0 for proc in self.processes):
            shutil.rmtree(self.log_dir, ignore_errors=True)


def _rank_env(rendezvous: Rendezvous, rank: int) -> dict[str, str]:
    peer = Rendezvous(rendezvous.master_addr, rendezvous.master_port, rank, rendezvous.world_size, rank)
    return peer.env()


def start_tensor_parallel_engine(engine_class: type, config: EngineConfig, engine_index: int) -> Any:
    """Rank 0: refuse what cannot run, start or meet the other ranks, load this rank's shard and build
    the engine with a `TensorParallelDriver` as its runner. Raises on failure with the others stopped."""
    device = resolve_device(config.device)
    # On CUDA every rank captures its decode graphs with the model's NCCL collectives inside (the
    # capture is one broadcast command, so all ranks capture the same buckets in the same order and
    # their all-reduces pair up); `enforce_eager` runs every step eagerly instead.
    check_tensor_parallel_config(config, load_hf_config(resolve_model_source(config.model)[0]), device)
    external = Rendezvous.from_env()
    rendezvous, timeout = _rank0_rendezvous(config.tensor_parallel_size, external)
    device = rendezvous.device(device.type)
    if device.type == "cpu":
        torch.set_num_threads(cpu_threads_per_rank(config))
    workers = None if external is not None else LocalWorkers(rendezvous)
    group = None
    try:
        group = init_distributed(rendezvous, timeout)
        broadcast_command(group, ("config", config))
        init_model_group(device)
        loaded = load_engine_model(config, device)
        driver = TensorParallelDriver(
            build_model_runner(config, loaded, device),
            group,
            describe_failure=workers.describe if workers is not None else None,
            on_shutdown=lambda: _leave(workers, WORKER_EXIT_TIMEOUT_S),
        )
    except BaseException as e:
        detail = workers.describe() if workers is not None else ""
        _abort_start(group, workers)
        if detail and isinstance(e, RuntimeError):
            raise TensorParallelWorkerError(f"tensor-parallel start-up failed: {e}\n{detail}") from e
        raise
    try:
        return engine_class(config, loaded, device, engine_index, runner=driver)
    except BaseException:
        driver.shutdown()
        raise


def _rank0_rendezvous(tp: int, external: Rendezvous | None) -> tuple[Rendezvous, timedelta]:
    """Rank 0's rendezvous and how long to wait at it: the environment's (other ranks started
    elsewhere), or a free local port (workers started here)."""
    if external is None:
        return Rendezvous("127.0.0.1", free_local_port(), DRIVER_RANK, tp, 0), LOCAL_RENDEZVOUS_TIMEOUT
    if external.world_size != tp or external.rank != DRIVER_RANK:
        raise ValueError(
            f"the environment places this process at RANK {external.rank} of WORLD_SIZE "
            f"{external.world_size}; the engine is rank 0 of tensor_parallel_size {tp} (start the "
            "other ranks with `python -m voltllm.engine.tp_worker`)"
        )
    return external, REMOTE_RENDEZVOUS_TIMEOUT


def _leave(workers: LocalWorkers | None, timeout_s: float) -> None:
    """After the other ranks were told to stop: wait for those started here, leave the world."""
    if workers is not None:
        workers.wait(timeout_s)
    shutdown_distributed()


def _abort_start(group: dist.ProcessGroup | None, workers: LocalWorkers | None) -> None:
    """Start-up failed on rank 0 before its driver existed: stop the ranks that joined, end ours."""
    if group is not None:
        with contextlib.suppress(RuntimeError):  # a rank already gone: its failure is being raised
            broadcast_command(group, ("shutdown",))
    _leave(workers, ABORT_EXIT_TIMEOUT_S)
