"""Joining the tensor-parallel world: torchrun-style environment variables to process groups.

Every rank, on one host or several, rendezvouses the same way: `MASTER_ADDR` / `MASTER_PORT` name the
store rank 0 hosts, `RANK` / `WORLD_SIZE` place the process, `LOCAL_RANK` (when torchrun sets it)
picks its GPU. The world is gloo; over the same ranks a process gets the model's group (NCCL on CUDA,
the gloo world on the CPU: the layers' all-reduce and all-gather) and a gloo control group for the
engine's messages (each step's plan is a pickled Python object: on gloo it crosses as host bytes,
never through a GPU).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from voltllm.distributed.parallel_state import destroy_tensor_parallel, init_tensor_parallel

ENV_KEYS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")
# The control group waits for the next plan however long the engine idles; the model group's
# collectives are paired within a step, so torch's default timeout bounds a stuck peer there.
CONTROL_TIMEOUT = timedelta(days=365)


@dataclass(frozen=True)
class Rendezvous:
    """Where the ranks meet and this process's place among them."""

    master_addr: str
    master_port: int
    rank: int
    world_size: int
    local_rank: int | None = None  # the GPU index on this host; None: rank modulo the GPUs

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"WORLD_SIZE must be >= 1, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"RANK {self.rank} is out of range for WORLD_SIZE {self.world_size}")
        if not 0 < self.master_port < 65536:
            raise ValueError(f"MASTER_PORT {self.master_port} is not a TCP port")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Rendezvous | None:
        """The rendezvous the environment describes (as torchrun sets it), or None when it sets none
        of `ENV_KEYS`. Raises ValueError naming the variables missing from a partial set."""
        env = os.environ if env is None else env
        present = [k for k in ENV_KEYS if k in env]
        if not present:
            return None
        missing = [k for k in ENV_KEYS if k not in env]
        if missing:
            raise ValueError(
                f"tensor-parallel rendezvous: {', '.join(present)} set but not {', '.join(missing)}"
            )
        try:
            port, rank, world = int(env["MASTER_PORT"]), int(env["RANK"]), int(env["WORLD_SIZE"])
            local_rank = int(env["LOCAL_RANK"]) if "LOCAL_RANK" in env else None
        except ValueError as e:
            raise ValueError(f"tensor-parallel rendezvous: a variable is not an integer ({e})") from None
        return cls(env["MASTER_ADDR"], port, rank, world, local_rank)

    def env(self) -> dict[str, str]:
        """The variables that hand this rendezvous to a process."""
        out = {
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
            "RANK": str(self.rank),
            "WORLD_SIZE": str(self.world_size),
        }
        if self.local_rank is not None:
            out["LOCAL_RANK"] = str(self.local_rank)
        return out

    def device(self, device_type: str) -> torch.device:
        """This rank's device: `cuda:<local rank>` on CUDA, the CPU otherwise."""
        if device_type != "cuda":
            return torch.device("cpu")
        count = torch.cuda.device_count()
        index = self.local_rank if self.local_rank is not None else self.rank % max(count, 1)
        if index >= count:
            raise ValueError(f"tensor-parallel rank {self.rank} wants GPU {index}, but this host has {count}")
        return torch.device("cuda", index)


def free_local_port() -> int:
    """A TCP port free on this host now (for a rendezvous of processes started here)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(rendezvous: Rendezvous, timeout: timedelta) -> dist.ProcessGroup:
    """Join the world `rendezvous` describes (gloo; `timeout` bounds the wait for the other ranks)
    and return the control group, gloo too but patient: it idles as long as the engine does."""
    if dist.is_initialized():
        raise RuntimeError(
            "this process already belongs to a torch.distributed world: "
            "one tensor-parallel engine per process"
        )
    # tcp:// is env://'s store from the values given (this process's environment stays as it was).
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{rendezvous.master_addr}:{rendezvous.master_port}",
        rank=rendezvous.rank,
        world_size=rendezvous.world_size,
        timeout=timeout,
    )
    return dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)


def init_model_group(device: torch.device) -> None:
    """Shard the layers built from now on over every rank, their collectives on NCCL on CUDA (the
    gloo world on the CPU). Every rank calls it, in the same order as its other group calls."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
        init_tensor_parallel(dist.new_group(backend="nccl"))
    else:
        init_tensor_parallel()


def shutdown_distributed() -> None:
    """Leave the world: the layers' group back to this process alone, the process groups destroyed."""
    destroy_tensor_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
