"""`voltllm serve` heals its engine (issue 22): a killed engine (`kill -9`) and a hung one (SIGSTOP) are
replaced while the server keeps running; in-flight streams end at once with an error event; `/health`
is 503 while the engine restarts and 200 after; past `--max-engine-restarts` the server exits non-zero
with the reason. One server walks through all of it, in order, to pay the start-up once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from voltllm_cli import VOLTLLM, free_port

pytestmark = pytest.mark.slow

HANG_TIMEOUT_S = 5
# How soon the streams must end after the engine dies or hangs. Generous for a loaded 2-core machine,
# yet each fails the bug it is there for: an undetected death leaves the streams open (4,000 tokens,
# 120 s read timeout), and a hang check that ignored --engine-hang-timeout would use the 30 s default.
KILLED_STREAMS_END_S = 60
HUNG_STREAMS_END_S = HANG_TIMEOUT_S + 20


class Served:
    def __init__(self, proc: subprocess.Popen, base: str, log: Path) -> None:
        self.proc, self.base, self.log = proc, base, log

    def engine_pid(self) -> int:
        out = subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True, text=True).stdout
        pids = [int(p) for p in out.split()]
        assert len(pids) == 1, f"expected one engine process under voltllm serve, found {pids}"
        return pids[0]

    def health(self) -> int:
        try:
            return httpx.get(f"{self.base}/health", timeout=5).status_code
        except httpx.HTTPError:
            return 0

    def wait_healthy(self, timeout: float) -> float:
        start = time.monotonic()
        while self.health() != 200:
            assert self.proc.poll() is None, f"voltllm serve exited: {self.log.read_text()[-2000:]}"
            assert time.monotonic() - start < timeout, "the server did not become healthy again"
            time.sleep(0.5)
        return time.monotonic() - start


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    port = free_port()
    log = tmp_path_factory.mktemp("recovery") / "serve.log"
    with log.open("wb") as sink:
        proc = subprocess.Popen(
            [*VOLTLLM, "serve", "--port", str(port), "--num-kv-blocks", "256",
             "--max-engine-restarts", "2", "--engine-hang-timeout", str(HANG_TIMEOUT_S)],
            stdout=sink, stderr=subprocess.STDOUT,
        )  # fmt: skip
    s = Served(proc, f"http://127.0.0.1:{port}", log)
    try:
        s.wait_healthy(timeout=600)
        yield s
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def open_streams(base: str, n: int) -> tuple[list[list[str]], list[threading.Thread], threading.Barrier]:
    """`n` long streamed completions in threads; each thread collects its `data:` events. The barrier
    is passed once every stream has its first token."""
    events: list[list[str]] = [[] for _ in range(n)]
    started = threading.Barrier(n + 1)
    body = {"prompt": "Count forever: 1, 2, 3,", "max_tokens": 4000, "ignore_eos": True, "stream": True}

    def run(i: int) -> None:
        first = True
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=120) as resp:
            assert resp.status_code == 200
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    events[i].append(line.removeprefix("data: "))
                    if first:
                        first = False
                        started.wait(timeout=120)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    started.wait(timeout=120)
    return events, threads, started


def assert_ended_with_error(events: list[list[str]], threads: list[threading.Thread], within: float) -> None:
    deadline = time.monotonic() + within
    for t in threads:
        t.join(timeout=max(0.0, deadline - time.monotonic()))
        assert not t.is_alive(), f"a stream was still open {within} s after the engine failed"
    for ev in events:
        assert ev[-1] == "[DONE]", ev[-3:]
        error = json.loads(ev[-2])["error"]
        assert error["type"] == "ServiceUnavailableError" and "engine" in error["message"], error


def serves_a_request(base: str) -> None:
    resp = httpx.post(f"{base}/v1/completions", json={"prompt": "1, 2, 3,", "max_tokens": 4}, timeout=120)
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] == 4


def test_kill_9_mid_stream_errors_every_stream_and_heals(served: Served) -> None:
    old = served.engine_pid()
    events, threads, _ = open_streams(served.base, 3)
    os.kill(old, signal.SIGKILL)
    killed = time.monotonic()
    assert_ended_with_error(events, threads, within=KILLED_STREAMS_END_S)
    assert served.health() == 503 or served.engine_pid() != old  # restarting, or already back
    served.wait_healthy(timeout=180 - (time.monotonic() - killed))
    assert served.engine_pid() != old
    serves_a_request(served.base)
    assert served.proc.poll() is None


def test_sigstop_hung_engine_is_detected_and_replaced(served: Served) -> None:
    old = served.engine_pid()
    events, threads, _ = open_streams(served.base, 2)
    os.kill(old, signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        assert_ended_with_error(events, threads, within=HUNG_STREAMS_END_S)
        served.wait_healthy(timeout=180)
        assert served.engine_pid() != old
        assert not Path(f"/proc/{old}").exists() or Path(f"/proc/{old}/stat").read_text().split()[2] == "Z"
        serves_a_request(served.base)
        assert served.proc.poll() is None
        assert "hung" in served.log.read_text()
        assert time.monotonic() - stopped < 180
    finally:
        if Path(f"/proc/{old}").exists():
            os.kill(old, signal.SIGCONT)


def test_past_max_engine_restarts_the_server_exits_with_the_reason(served: Served) -> None:
    os.kill(served.engine_pid(), signal.SIGKILL)
    assert served.proc.wait(timeout=30) != 0
    log = served.log.read_text()
    assert "gave up after 2 restart(s)" in log, log[-2000:]
