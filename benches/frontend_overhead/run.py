"""Front-end overhead: the Rust server vs a minimal Python asyncio front end, same mock engine.

Both front ends serve streaming `/v1/completions` in front of the same Rust mock engine
(`voltllm-engine-client` example `mock_engine`, which echoes prompt tokens at one token per request
per step), driven by the same closed-loop Rust load generator (`voltllm-server` example `loadgen`)
at each concurrency. Printed: streamed tokens/s and requests/s per front end, and the ratio.

Usage: python benches/frontend_overhead/run.py [--duration 10] [--concurrency 1 64 512]
Needs: cargo (builds the release binaries), aiohttp (pip install aiohttp), tokenizers, pyzmq, msgspec.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TARGET = Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target"))
MODEL = ROOT / "tests" / "fixtures" / "smollm2"
PROMPT = "The quick brown fox jumps over the lazy dog. " * 4


def build() -> None:
    cargo = ["cargo", "build", "--release", "--quiet"]
    subprocess.run(
        [*cargo, "-p", "voltllm-server", "--bin", "voltllm-server", "--example", "loadgen"], check=True
    )
    subprocess.run(
        [*cargo, "-p", "voltllm-engine-client", "--features", "mock", "--example", "mock_engine"], check=True
    )


def wait_http(url: str, timeout: float = 60.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=1):
                return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"{url} did not come up within {timeout}s")


def run_point(frontend: str, concurrency: int, args: argparse.Namespace, port: int) -> dict:
    run_dir = Path(tempfile.mkdtemp(prefix="voltllm-bench-"))
    inp, out = f"ipc://{run_dir}/in", f"ipc://{run_dir}/out"
    release = TARGET / "release"
    if frontend == "rust":
        fe_cmd = [
            str(release / "voltllm-server"), "--model", str(MODEL), "--port", str(port),
            "--served-model-name", "mock", "--engine-input-address", inp, "--engine-output-address", out,
            "--max-waiting-requests", "4096",
        ]  # fmt: skip
        env = {**os.environ, "RUST_LOG": "warn"}
    else:
        fe_cmd = [
            sys.executable, str(Path(__file__).with_name("py_frontend.py")), "--model", str(MODEL),
            "--port", str(port), "--engine-input-address", inp, "--engine-output-address", out,
        ]  # fmt: skip
        env = dict(os.environ)
    engine_cmd = [
        str(release / "examples" / "mock_engine"), "--input-address", inp, "--output-address", out,
        "--step-interval-us", str(args.step_interval_us), "--max-model-len", "4096",
    ]  # fmt: skip
    procs = [subprocess.Popen(fe_cmd, env=env)]
    try:
        time.sleep(0.5)  # the front end binds first; the engine connects (and retries) after
        procs.append(subprocess.Popen(engine_cmd))
        wait_http(f"http://127.0.0.1:{port}/health")
        load = [
            str(release / "examples" / "loadgen"), "--url", f"http://127.0.0.1:{port}",
            "--concurrency", str(concurrency), "--max-tokens", str(args.max_tokens), "--prompt", PROMPT,
        ]  # fmt: skip
        subprocess.run([*load, "--duration", str(args.warmup)], check=True, capture_output=True)
        result = subprocess.run(
            [*load, "--duration", str(args.duration)], check=True, capture_output=True, text=True
        )
        return json.loads(result.stdout.strip().splitlines()[-1])
    finally:
        for p in procs:  # front end first, so it does not report the engine's exit as a death
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 64, 512])
    ap.add_argument("--duration", type=float, default=10.0)
    ap.add_argument("--warmup", type=float, default=2.0)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--step-interval-us", type=int, default=1000)
    ap.add_argument("--no-build", action="store_true")
    args = ap.parse_args()
    if not args.no_build:
        build()
    cpu = platform.processor() or platform.machine()
    print(f"host: {cpu}, {os.cpu_count()} CPUs, Python {platform.python_version()}")
    step, tokens = args.step_interval_us, args.max_tokens
    print(f"mock engine step {step} us, {tokens} tokens/request, {args.duration}s per point\n")
    header = (
        f"{'streams':>7} | {'rust tok/s':>10} {'rust req/s':>10} | "
        f"{'py tok/s':>10} {'py req/s':>10} | {'ratio tok/s':>11}"
    )
    print(header)
    print("-" * len(header))
    port = 18400
    for c in args.concurrency:
        rust = run_point("rust", c, args, port)
        py = run_point("python", c, args, port + 1)
        port += 2
        ratio = rust["chunks_per_s"] / py["chunks_per_s"] if py["chunks_per_s"] else float("inf")
        print(
            f"{c:>7} | {rust['chunks_per_s']:>10.0f} {rust['requests_per_s']:>10.1f} | "
            f"{py['chunks_per_s']:>10.0f} {py['requests_per_s']:>10.1f} | {ratio:>10.2f}x"
            f"   (errors: rust {rust['errors']}, py {py['errors']})",
            flush=True,
        )


if __name__ == "__main__":
    main()
