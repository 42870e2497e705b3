"""How the entry-point tests run `voltllm`, a started-and-healthy `voltllm serve`, and a tiny random
model to serve when what is tested is the server, not the model."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

_SMOLLM2_FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "smollm2"

# The installed console script when there is one (the wheel's entry point), else the module.
_SCRIPT = Path(sys.executable).parent / "voltllm"
VOLTLLM = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "voltllm.entrypoints.cli"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(*args: str, timeout: float = 600) -> tuple[subprocess.Popen, str]:
    """`voltllm serve ARGS` on a free port, returned once `/health` answers 200 from it, with its base
    URL. `free_port` only finds a port that was free: another process (a server started by the other
    xdist worker) can take it before ours binds, and would then answer our health check. So the
    listener must be ours; on a clash the start is tried again on a fresh port, twice at most."""
    deadline = time.monotonic() + timeout
    for _ in range(3):
        port = free_port()
        proc = subprocess.Popen([*VOLTLLM, "serve", "--port", str(port), *args])
        base = f"http://127.0.0.1:{port}"
        if _wait_healthy(proc, base, port, deadline):
            return proc, base
        proc.kill()  # the port was someone else's: ours failed to bind, or is failing
        proc.wait()
    raise AssertionError("voltllm serve lost its port to another process three times")


def _wait_healthy(proc: subprocess.Popen, base: str, port: int, deadline: float) -> bool:
    """True once `proc` listens on `port` and `/health` answers 200; False when another process holds
    the port. Fails when `proc` exits otherwise or the deadline passes."""
    while True:
        listener = _listener_pid(port, proc.pid)
        if proc.poll() is not None:
            if listener is not None:
                return False
            raise AssertionError("voltllm serve exited during start-up")
        if listener is not None and listener != proc.pid:
            return False
        try:
            if listener == proc.pid and httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError("voltllm serve did not become healthy")
        time.sleep(1)


def _listener_pid(port: int, pid: int) -> int | None:
    """Who listens on 127.0.0.1:`port`: `pid` if one of its sockets does, -1 for anyone else, None
    when nobody does (from /proc/net/tcp's LISTEN rows and the process's open sockets)."""
    inodes = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local, state, inode = fields[1], fields[3], fields[9]
        if state == "0A" and int(local.split(":")[1], 16) == port:
            inodes.add(f"socket:[{inode}]")
    if not inodes:
        return None
    try:
        fds = list(Path(f"/proc/{pid}/fd").iterdir())
    except OSError:
        return -1
    for fd in fds:
        try:
            if os.readlink(fd) in inodes:
                return pid
        except OSError:
            continue
    return -1


@contextmanager
def serving(*args: str, stop_timeout: float = 30) -> Iterator[tuple[subprocess.Popen, str]]:
    """`start_server(*args)` for the `with` body, then SIGTERM; a server that has not exited after
    `stop_timeout` s is killed and the test fails (shutdown must not hang)."""
    proc, base = start_server(*args)
    try:
        yield proc, base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=stop_timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise


def descendants(pid: int) -> list[tuple[int, bytes]]:
    """(pid, command line) of every live process below `pid`."""
    children: dict[int, list[int]] = {}
    cmdlines: dict[int, bytes] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, ppid = stat.read_text().rsplit(")", 1)[1].split()[:2]
            cmdline = (stat.parent / "cmdline").read_bytes()
        except OSError:
            continue
        if state != "Z":
            child = int(stat.parent.name)
            children.setdefault(int(ppid), []).append(child)
            cmdlines[child] = cmdline
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append((child, cmdlines[child]))
            todo.append(child)
    return out


def tiny_llama(out: Path, max_len: int = 512) -> Path:
    """A 2-layer random Llama (hidden size 64) over the SmolLM2 tokenizer and chat template, written
    to `out`: a generated token costs milliseconds on the CPU."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_len,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=True,
    )
    config.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(_SMOLLM2_FIXTURE / name, out / name)
    return out
