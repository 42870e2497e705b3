"""A tensor-parallel rank other than 0: `python -m voltllm.engine.tp_worker`.

It takes its place from torchrun-style variables (`MASTER_ADDR`, `MASTER_PORT`, `RANK`, `WORLD_SIZE`,
optionally `LOCAL_RANK`), receives the engine's `EngineConfig` from rank 0, loads its shard of the
model and runs rank 0's commands until told to stop (`worker.tensor_parallel.follow_driver`). The
model path in the config must name the same checkpoint on this host. `--parent-pid` (given when rank 0
started this process itself) makes it exit when that process is gone.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time

import torch

from voltllm.distributed.rendezvous import (
    Rendezvous,
    init_distributed,
    init_model_group,
    shutdown_distributed,
)
from voltllm.engine.core import build_model_runner, load_engine_model, resolve_device
from voltllm.engine.tensor_parallel import REMOTE_RENDEZVOUS_TIMEOUT, cpu_threads_per_rank
from voltllm.worker.tensor_parallel import broadcast_command, follow_driver

logger = logging.getLogger("voltllm.tp_worker")

PARENT_POLL_S = 1.0


def watch_parent(pid: int) -> None:
    """Exit this process once `pid` is no longer its parent (it died; we were re-parented)."""

    def poll() -> None:
        while os.getppid() == pid:
            time.sleep(PARENT_POLL_S)
        os._exit(1)  # the engine is gone: nothing to flush, nobody to answer

    threading.Thread(target=poll, name="watch-parent", daemon=True).start()


def run_worker(rendezvous: Rendezvous) -> None:
    """Join, load this rank's shard as rank 0's config says, and follow rank 0 until it stops."""
    group = init_distributed(rendezvous, REMOTE_RENDEZVOUS_TIMEOUT)
    try:
        name, *args = broadcast_command(group)
        if name == "shutdown":  # rank 0 failed to start
            return
        if name != "config":
            raise RuntimeError(f"rank 0 sent {name!r} before the engine config")
        [config] = args
        device = rendezvous.device(resolve_device(config.device).type)
        init_model_group(device)
        if device.type == "cpu":
            torch.set_num_threads(cpu_threads_per_rank(config))
        loaded = load_engine_model(config, device)
        follow_driver(build_model_runner(config, loaded, device, samples=False), group)
    finally:
        shutdown_distributed()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parent-pid", type=int, default=None, help="exit when this process is gone")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.parent_pid is not None:
        # Started by rank 0: a Ctrl-C at the terminal reaches the whole process group, and rank 0
        # stops this worker itself.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        watch_parent(args.parent_pid)
    rendezvous = Rendezvous.from_env()
    if rendezvous is None or rendezvous.rank == 0:
        parser.error("set MASTER_ADDR, MASTER_PORT, RANK (not 0: rank 0 is the engine) and WORLD_SIZE")
    run_worker(rendezvous)
    return 0


if __name__ == "__main__":
    sys.exit(main())
