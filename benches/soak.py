"""Soak (issue 22): the Rust server in its own process in front of the mock engine, held at 1,000
concurrent streams for several minutes by the project's load tester (`voltllm-bench serve
--max-concurrency 1000 --duration S`), with the server's resident memory sampled every second.

Printed: streams, duration, completed and failed requests (with the failure reasons), streamed
tokens/s, and the server's resident memory after the warm-up, midway through the rest, its slope over
the second half (MiB per minute: ~0 when flat), at its peak, at the end of the load and after it went
idle. The short version in the test suite is `rust/server/tests/soak.rs`.

Usage: python benches/soak.py [--duration 300] [--streams 1000] [--output-len 200] [--no-build]
Needs: cargo (builds the release binaries into $CARGO_TARGET_DIR, default ./target).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import socket
import subprocess
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGET = Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target"))
MODEL = ROOT / "tests" / "fixtures" / "smollm2"


def build() -> None:
    cargo = ["cargo", "build", "--release", "--quiet"]
    subprocess.run([*cargo, "-p", "voltllm-server", "--bin", "voltllm-server"], check=True, cwd=ROOT)
    subprocess.run([*cargo, "-p", "voltllm-bench", "--bin", "voltllm-bench"], check=True, cwd=ROOT)
    subprocess.run(
        [*cargo, "-p", "voltllm-engine-client", "--features", "mock", "--example", "mock_engine"],
        check=True,
        cwd=ROOT,
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def resident_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def wait_healthy(url: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=1):
                return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"{url} did not become healthy within {timeout} s")


class MemorySampler(threading.Thread):
    """Samples a process's resident memory once a second: (seconds since start, MiB)."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid, self.samples, self.stop = pid, [], threading.Event()
        self.start_time = time.monotonic()

    def run(self) -> None:
        while not self.stop.wait(1.0):
            self.samples.append((time.monotonic() - self.start_time, resident_mib(self.pid)))


def slope_per_min(samples: list[tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, MiB) samples, in MiB per minute: ~0 once memory is flat."""
    n = len(samples)
    mean_t = sum(t for t, _ in samples) / n
    mean_m = sum(m for _, m in samples) / n
    var = sum((t - mean_t) ** 2 for t, _ in samples)
    return 60 * sum((t - mean_t) * (m - mean_m) for t, m in samples) / var


def soak(args: argparse.Namespace) -> dict:
    # 1,000 streams need ~1,000 sockets in each of the server and the load tester.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 4 * args.streams + 256)), hard))
    run_dir = Path(tempfile.mkdtemp(prefix="voltllm-soak-"))
    inp, out, port = f"ipc://{run_dir}/in", f"ipc://{run_dir}/out", free_port()
    release = TARGET / "release"
    server = subprocess.Popen(
        [
            str(release / "voltllm-server"), "--model", str(MODEL), "--port", str(port),
            "--served-model-name", "mock", "--engine-input-address", inp, "--engine-output-address", out,
            "--max-waiting-requests", str(args.streams),
        ],
        env={**os.environ, "RUST_LOG": "warn"},
    )  # fmt: skip
    engine = None
    try:
        time.sleep(0.5)  # the server binds first; the engine connects after
        engine = subprocess.Popen(
            [
                str(release / "examples" / "mock_engine"), "--input-address", inp, "--output-address", out,
                "--step-interval-us", str(args.step_interval_us), "--max-model-len", "4096",
            ]
        )  # fmt: skip
        base = f"http://127.0.0.1:{port}"
        wait_healthy(f"{base}/health")
        sampler = MemorySampler(server.pid)
        rss_before = resident_mib(server.pid)
        sampler.start()
        started = time.monotonic()
        load = subprocess.run(
            [
                str(release / "voltllm-bench"), "serve", "--base-url", base, "--model", "mock",
                "--tokenizer", str(MODEL), "--dataset-name", "random", "--random-input-len", "16",
                "--random-output-len", str(args.output_len), "--max-concurrency", str(args.streams),
                "--duration", str(args.duration), "--request-timeout", "60", "--disable-tqdm",
                "--save-result", "--result-dir", str(run_dir), "--result-filename", "soak.json",
            ],
            capture_output=True,
            text=True,
        )  # fmt: skip
        elapsed = time.monotonic() - started
        rss_loaded_end = resident_mib(server.pid)
        time.sleep(5)  # idle: what the server keeps once the streams are gone
        sampler.stop.set()
        sampler.join()
        rss_idle = resident_mib(server.pid)
        if load.returncode != 0:
            raise RuntimeError(f"voltllm-bench failed ({load.returncode}):\n{load.stdout}\n{load.stderr}")
        result = json.loads((run_dir / "soak.json").read_text())
        warm = [mib for t, mib in sampler.samples if t >= args.warmup]
        half = [(t, mib) for t, mib in sampler.samples if t >= args.warmup + (elapsed - args.warmup) / 2]
        return {
            "streams": args.streams,
            "duration_s": round(elapsed, 1),
            "completed": result["completed"],
            "failed": result["failed"],
            "failure_reasons": result.get("failure_reasons"),
            "max_concurrent_requests": result.get("max_concurrent_requests"),
            "output_tokens_per_s": round(result["output_throughput"]),
            "rss_mib_before_load": round(rss_before, 1),
            "rss_mib_after_warmup": round(warm[0], 1) if warm else None,
            "rss_mib_midway": round(half[0][1], 1) if half else None,
            "rss_mib_per_min_second_half": round(slope_per_min(half), 2) if len(half) > 1 else None,
            "rss_mib_peak": round(max(mib for _, mib in sampler.samples), 1),
            "rss_mib_end_of_load": round(rss_loaded_end, 1),
            "rss_mib_idle_after": round(rss_idle, 1),
            "server_exit": server.poll(),  # None: still serving
        }
    finally:
        for proc in (server, engine):  # server first, so it does not report the engine's exit as a death
            if proc is not None:
                proc.terminate()
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    proc.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--streams", type=int, default=1000)
    ap.add_argument("--duration", type=float, default=300.0, help="seconds of load")
    ap.add_argument("--warmup", type=float, default=20.0, help="seconds before the 'after warm-up' reading")
    ap.add_argument("--output-len", type=int, default=200, help="tokens per request")
    ap.add_argument("--step-interval-us", type=int, default=50_000, help="mock engine step (one token each)")
    ap.add_argument("--no-build", action="store_true")
    args = ap.parse_args()
    if not args.no_build:
        build()
    print(f"host: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, {platform.platform()}")
    report = soak(args)
    for key, value in report.items():
        print(f"{key:>26}: {value}")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
