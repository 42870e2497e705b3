"""Bounded memory per request (issue 22): eight concurrent 30 MB bodies (under the 32 MiB limit) leave the
server's resident memory within 1 GB of where it started, at their peak and after, and it keeps
serving. The bodies are prompts far past max_model_len, in each form a client can send them."""

from __future__ import annotations

import json
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from voltllm_cli import serving

pytestmark = pytest.mark.slow

BODY_BYTES = 30_000_000
GIB = 1 << 30


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def bodies() -> list[tuple[str, bytes]]:
    text = "word " * (BODY_BYTES // 5)
    ids = "[" + ",".join(["1"] * (BODY_BYTES // 2)) + "]"
    chat = {"messages": [{"role": "user", "content": text}], "max_tokens": 4}
    return [
        ("/v1/completions", json.dumps({"prompt": text, "max_tokens": 4}).encode()),
        ("/v1/completions", json.dumps({"prompt": [text[: BODY_BYTES // 2]] * 2, "max_tokens": 4}).encode()),
        ("/v1/completions", f'{{"prompt": {ids}, "max_tokens": 4}}'.encode()),
        ("/v1/chat/completions", json.dumps(chat).encode()),
    ] * 2


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[subprocess.Popen, str]]:
    with serving("--num-kv-blocks", "64", stop_timeout=60) as started:
        yield started


def test_eight_concurrent_30mb_bodies_stay_within_1gb(server: tuple[subprocess.Popen, str]) -> None:
    proc, base = server
    payloads = bodies()
    assert all(len(b) <= 32 << 20 and len(b) >= 29_000_000 for _, b in payloads)
    start = rss_bytes(proc.pid)
    statuses: list[int] = []
    peak = start
    done = threading.Event()

    def send(route: str, body: bytes) -> None:
        headers = {"content-type": "application/json"}
        statuses.append(httpx.post(f"{base}{route}", content=body, headers=headers, timeout=300).status_code)

    threads = [threading.Thread(target=send, args=p, daemon=True) for p in payloads]
    for t in threads:
        t.start()

    def watch() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, rss_bytes(proc.pid))
            time.sleep(0.02)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    for t in threads:
        t.join(timeout=300)
    # The trim after the last request runs on the blocking pool: wait for it (a fixed 1 s was a race on
    # the loaded machine); memory that is never given back still fails below.
    deadline = time.monotonic() + 30
    while (after := rss_bytes(proc.pid)) - start >= GIB / 4 and time.monotonic() < deadline:
        time.sleep(0.2)
    done.set()
    watcher.join()
    assert statuses == [400] * len(payloads), statuses
    assert peak - start < GIB, f"peak {peak / GIB:.2f} GiB from {start / GIB:.2f} GiB"
    assert after - start < GIB / 4, f"after {after / GIB:.2f} GiB from {start / GIB:.2f} GiB"
    resp = httpx.post(f"{base}/v1/completions", json={"prompt": "1, 2, 3,", "max_tokens": 4}, timeout=120)
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 4
