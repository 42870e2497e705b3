"""Data parallelism: several EngineCore processes behind one front end (docs/parallel.md).

Each engine is a whole replica of the model (itself tensor-parallel or not); the Rust front end
routes every request to one of them. This module holds what keeps the replicas apart: the
configuration refused at start, which GPUs an engine process takes, and the CPU threads each gets.
Engine `i` of tensor-parallel size `T` takes devices `i*T .. i*T+T-1` of the ones its parent sees,
by narrowing `CUDA_VISIBLE_DEVICES` before anything in the process touches CUDA (its
tensor-parallel workers inherit the narrowed list and take its devices `0 .. T-1` as local ranks).
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

from voltllm.config import EngineConfig

VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"


def check_data_parallel_config(config: EngineConfig) -> None:
    """Refuse, with the reason, data-parallel engines this host cannot run: on CUDA every rank of
    every engine needs a GPU of its own."""
    import torch  # slow to import: only when there is something to check

    dp, tp = config.data_parallel_size, config.tensor_parallel_size
    if dp == 1:
        return
    uses_cuda = config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available())
    if not uses_cuda:
        return
    visible = torch.cuda.device_count()
    if dp * tp > visible:
        raise ValueError(
            f"data_parallel_size {dp} x tensor_parallel_size {tp} needs {dp * tp} GPUs (one per rank "
            f"of each engine), but {visible} {'is' if visible == 1 else 'are'} visible"
        )


def engine_devices(engine_index: int, config: EngineConfig, visible: str | None) -> str:
    """The `CUDA_VISIBLE_DEVICES` value for engine `engine_index`: its slice of `visible` (the
    parent's value; unset means devices 0, 1, ...). Raises ValueError when the slice is not there."""
    dp, tp = config.data_parallel_size, config.tensor_parallel_size
    if not 0 <= engine_index < dp:
        raise ValueError(f"engine index {engine_index} is out of range for data_parallel_size {dp}")
    first, last = engine_index * tp, (engine_index + 1) * tp
    if visible is None:
        return ",".join(str(d) for d in range(first, last))
    devices = [d.strip() for d in visible.split(",") if d.strip()]
    if last > len(devices):
        raise ValueError(
            f"data-parallel engine {engine_index} of {dp} needs devices {first}..{last - 1} of "
            f"{VISIBLE_DEVICES}={visible!r}, which lists {len(devices)}"
        )
    return ",".join(devices[first:last])


def claim_engine_devices(
    engine_index: int, config: EngineConfig, env: MutableMapping[str, str] | None = None
) -> None:
    """Narrow this process's visible GPUs to engine `engine_index`'s own (nothing to do for one
    engine). Must run before CUDA is initialized in the process; the CPU ignores the variable."""
    if config.data_parallel_size == 1:
        return
    env = os.environ if env is None else env
    env[VISIBLE_DEVICES] = engine_devices(engine_index, config, env.get(VISIBLE_DEVICES))


def default_cpu_threads(cores: int, config: EngineConfig) -> int:
    """Torch threads for each rank of each engine on the CPU when none were asked for: the cores
    but one (the front end's) shared out, at least one."""
    return max(1, (cores - 1) // (config.data_parallel_size * config.tensor_parallel_size))
