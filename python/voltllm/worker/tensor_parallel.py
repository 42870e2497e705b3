"""Tensor-parallel model execution: rank 0 drives, the other ranks follow its commands.

Every rank holds a `ModelRunner` over its shard of the model. Rank 0 (where the EngineCore schedules)
holds a `TensorParallelDriver` in place of its runner: each call broadcasts a command to the other
ranks over the gloo control group, then runs the same call on rank 0's own runner, so all ranks run
the same forward (joining the model's all-reduces and gathers) in lockstep. The others sit in
`follow_driver`. The commands:

- `determine_num_blocks`: each rank sizes its KV cache for its share of the heads; all take the
  minimum (all-reduce MIN), since the scheduler hands out one set of block ids for every rank.
- `initialize_kv_cache` (the block count and the final max_model_len), `capture_cuda_graphs`.
- `execute_model`: the step's plan (`SchedulerOutput`) and the ids rank 0 sampled in the step before
  (`StepCommand`). Only rank 0 samples; the others compute the logits (the LM head's gather is a
  collective) and append the previous step's ids to their request arrays before they stage the next
  step's inputs, so one broadcast per step carries all they need.
- `shutdown`: leave the loop.

A command is one `broadcast_object_list` of a small tuple (torch.distributed, no transport of our
own; gloo moves the bytes host to host, never through a GPU). The step's plan inside it is msgpack
bytes (`StepCommand`, msgspec): pickling the plan's objects cost about 6x more than msgspec's encoding
(a 256-request decode plan on the dev CPU: ~360 us to pickle, ~60 us to encode; ~350 vs ~190 us to
read back), and both ends of the step wait for it.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from types import MappingProxyType
from typing import Any

import msgspec
import numpy as np
import torch
import torch.distributed as dist

from voltllm.config import CacheConfig
from voltllm.core.sched_output import ModelRunnerOutput, SchedulerOutput
from voltllm.structured_output import Grammar
from voltllm.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

DRIVER_RANK = 0


class TensorParallelWorkerError(RuntimeError):
    """Another rank stopped answering (it exited or lost its connection): the engine cannot go on."""


class StepCommand(msgspec.Struct, array_like=True, frozen=True):
    """One step for the other ranks: the plan, and the ids rank 0 sampled in the step before."""

    plan: SchedulerOutput
    sampled_before: list[int] | None


def _encode_hook(obj: Any) -> Any:
    if isinstance(obj, MappingProxyType):  # the plan's read-only view of its batch
        return dict(obj)
    if isinstance(obj, Grammar):  # a matcher stays with the driver: the other ranks sample nothing
        return None
    raise NotImplementedError(f"cannot encode {type(obj).__name__} in a step command")


_STEP_ENCODER = msgspec.msgpack.Encoder(enc_hook=_encode_hook)
_STEP_DECODER = msgspec.msgpack.Decoder(StepCommand)


def encode_step(plan: SchedulerOutput, sampled_before: np.ndarray | None) -> bytes:
    """The msgpack bytes of a `StepCommand`."""
    ids = None if sampled_before is None else sampled_before.tolist()
    return _STEP_ENCODER.encode(StepCommand(plan, ids))


def broadcast_command(group: dist.ProcessGroup, command: tuple | None = None) -> tuple:
    """Rank 0 sends `command` to every rank of `group`; the others receive it (pass None)."""
    box = [command]
    dist.broadcast_object_list(box, src=DRIVER_RANK, group=group)
    return box[0]


def agree_on_num_blocks(runner: ModelRunner, cache: CacheConfig, group: dist.ProcessGroup) -> int:
    """The KV blocks every rank can hold: the fewest any rank's memory allows."""
    count = torch.tensor([runner.determine_num_blocks(cache)], dtype=torch.int64)
    dist.all_reduce(count, op=dist.ReduceOp.MIN, group=group)
    return int(count.item())


class TensorParallelDriver:
    """Rank 0's runner: what `EngineCore` calls on a `ModelRunner`, run on every rank.

    `describe_failure` (optional) says what became of the other ranks when a collective fails (for a
    launcher that owns their processes: exit codes, their last output); `on_shutdown` runs after the
    other ranks were told to stop (waiting for them, leaving the process group). Shutdown happens
    once: on `shutdown()`, when a rank is found gone, or when the driver is garbage-collected."""

    def __init__(
        self,
        runner: ModelRunner,
        group: dist.ProcessGroup,
        describe_failure: Callable[[], str] | None = None,
        on_shutdown: Callable[[], None] | None = None,
    ) -> None:
        self.runner = runner
        self.group = group
        self.describe_failure = describe_failure
        # Holds no reference to the driver, so dropping the engine is enough to stop the ranks.
        self._finalizer = weakref.finalize(self, _shutdown_ranks, group, on_shutdown)

    # The attributes EngineCore reads or sets on its runner.
    @property
    def max_model_len(self) -> int:
        return self.runner.max_model_len

    @max_model_len.setter
    def max_model_len(self, value: int) -> None:
        self.runner.max_model_len = value

    @property
    def last_timings(self) -> Any:
        return self.runner.last_timings

    def determine_num_blocks(self, cache: CacheConfig) -> int:
        self._send("determine_num_blocks", cache)
        return self._collective(agree_on_num_blocks, self.runner, cache, self.group)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self._send("initialize_kv_cache", num_blocks, self.runner.max_model_len)
        self.runner.initialize_kv_cache(num_blocks)

    def capture_cuda_graphs(self) -> None:
        self._send("capture_cuda_graphs")
        self._collective(self.runner.capture_cuda_graphs)

    def execute_model(self, plan: SchedulerOutput) -> ModelRunnerOutput:
        self._send("execute_model", encode_step(plan, self.runner.last_sampled))
        return self._collective(self.runner.execute_model, plan)

    @property
    def is_shut_down(self) -> bool:
        return not self._finalizer.alive

    def shutdown(self) -> None:
        """Tell the other ranks to leave their loop, then run `on_shutdown` (once)."""
        self._finalizer()

    def _send(self, name: str, *args: Any) -> None:
        if self.is_shut_down:
            raise TensorParallelWorkerError("the tensor-parallel engine was shut down")
        self._collective(broadcast_command, self.group, (name, *args))

    def _collective(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run `fn` (which joins collectives); a failed collective means a rank is gone."""
        try:
            return fn(*args)
        except RuntimeError as e:
            if isinstance(e, TensorParallelWorkerError) or not _is_peer_failure(e):
                raise
            detail = self.describe_failure() if self.describe_failure is not None else ""
            self.shutdown()
            raise TensorParallelWorkerError(
                f"a tensor-parallel rank stopped answering: {e}{chr(10) + detail if detail else ''}"
            ) from e


def _shutdown_ranks(group: dist.ProcessGroup, on_shutdown: Callable[[], None] | None) -> None:
    try:
        broadcast_command(group, ("shutdown",))
    except RuntimeError as e:
        logger.warning("tensor-parallel shutdown: a rank was already gone (%s)", e)
    if on_shutdown is not None:
        on_shutdown()


def _is_peer_failure(error: RuntimeError) -> bool:
    """torch.distributed's errors (gloo, NCCL, the store), as opposed to a bug in this rank's step."""
    # gloo reports a dead peer as a plain RuntimeError ("Connection closed by peer ...").
    return isinstance(error, dist.DistError) or any(word in str(error) for word in _PEER_FAILURE_WORDS)


_PEER_FAILURE_WORDS = ("Connection closed by peer", "Connection reset", "NCCL", "Timed out", "timed out")


def follow_driver(runner: ModelRunner, group: dist.ProcessGroup) -> None:
    """A rank other than 0: run rank 0's commands on this rank's runner until it says shutdown."""
    while True:
        name, *args = broadcast_command(group)
        if name == "shutdown":
            return
        if name == "determine_num_blocks":
            agree_on_num_blocks(runner, args[0], group)
        elif name == "initialize_kv_cache":
            num_blocks, runner.max_model_len = args
            runner.initialize_kv_cache(num_blocks)
        elif name == "capture_cuda_graphs":
            runner.capture_cuda_graphs()
        elif name == "execute_model":
            step = _STEP_DECODER.decode(args[0])
            sampled = step.sampled_before
            runner.apply_sampled(None if sampled is None else np.array(sampled, dtype=np.int64))
            runner.execute_model(step.plan)
        else:
            raise RuntimeError(f"unknown tensor-parallel command {name!r} from rank 0")
