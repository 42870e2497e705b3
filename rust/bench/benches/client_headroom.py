"""Client headroom: the highest request rate the harness sustains, so it is never the bottleneck.

Starts the zero-delay mock OpenAI server (example `mock_server`), drives it closed-loop with the
Rust harness, and with a Python asyncio + aiohttp streaming client doing the same work (the
baseline: the client `vllm bench serve` uses), and prints both rates and their ratio. With
``--server-url`` it also measures the highest rate a real server (e.g. voltllm's front end over the
mock engine) serves under the same harness settings, and the harness-on-mock / server ratio that must
stay ≥ 2.

    cargo build --release -p voltllm-bench --bins --examples
    python rust/bench/benches/client_headroom.py [--num-prompts 20000] [--concurrency 64]
        [--server-url http://127.0.0.1:8000 --server-model NAME]

The mock runs on the same machine and takes CPU from the harness, so the harness rate printed is a
lower bound of what it can drive against a server elsewhere.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import httpx

REPO = Path(__file__).resolve().parents[3]
TOKENIZER = REPO / "tests/fixtures/smollm2/tokenizer.json"


def target_dir() -> Path:
    return Path(os.environ.get("CARGO_TARGET_DIR", REPO / "target")) / "release"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/v1/models", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.1)
    raise RuntimeError(f"{url} did not come up")


def harness_rate(url: str, args: argparse.Namespace, model: str | None) -> dict:
    """Runs the Rust harness closed-loop and returns its result JSON."""
    with tempfile.TemporaryDirectory() as d:
        cmd = [
            str(target_dir() / "voltllm-bench"), "serve", "--base-url", url, "--tokenizer", str(TOKENIZER),
            "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
            "--num-prompts", str(args.num_prompts), "--max-concurrency", str(args.concurrency),
            "--disable-tqdm", "--save-result", "--result-dir", d, "--result-filename", "r.json",
            "--percentile-metrics", "ttft,e2el",
        ]  # fmt: skip
        if model:
            cmd += ["--model", model]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        return json.loads((Path(d) / "r.json").read_text())


async def python_client_rate(url: str, args: argparse.Namespace) -> float:
    """Same closed loop with asyncio + aiohttp (the client `vllm bench serve` uses): `concurrency`
    workers, streaming, every SSE line parsed as JSON."""
    body = {
        "model": "mock-model",
        "prompt": "hello " * args.input_len,
        "max_tokens": args.output_len,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    remaining = args.num_prompts
    done = 0
    connector = aiohttp.TCPConnector(limit=args.concurrency)
    async with aiohttp.ClientSession(base_url=url, connector=connector) as session:

        async def worker() -> None:
            nonlocal remaining, done
            while remaining > 0:
                remaining -= 1
                async with session.post("/v1/completions", json=body) as r:
                    async for raw in r.content:
                        line = raw.decode().strip()
                        if line.startswith("data: ") and line != "data: [DONE]":
                            json.loads(line[6:])
                done += 1

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        return done / (time.perf_counter() - start)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-prompts", type=int, default=20000)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--mock-threads", type=int, default=1)
    p.add_argument("--baseline-prompts", type=int, default=3000, help="requests for the slower Python client")
    p.add_argument("--server-url", default=None, help="also measure this server's max rate")
    p.add_argument("--server-model", default=None)
    args = p.parse_args()

    mock_bin = target_dir() / "examples" / "mock_server"
    if not mock_bin.is_file() or not (target_dir() / "voltllm-bench").is_file():
        print("error: build first: cargo build --release -p voltllm-bench --bins --examples", file=sys.stderr)
        return 1
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    mock = subprocess.Popen(
        [str(mock_bin), "--port", str(port), "--threads", str(args.mock_threads)], stderr=subprocess.DEVNULL
    )
    try:
        wait_ready(url)
        rust = harness_rate(url, args, None)
        base_args = argparse.Namespace(**{**vars(args), "num_prompts": args.baseline_prompts})
        py_rate = asyncio.run(python_client_rate(url, base_args))
    finally:
        mock.terminate()
        mock.wait()

    rust_rate = rust["request_throughput"]
    cpus = os.cpu_count()
    print(f"machine: {cpus} CPUs shared by mock and client; {args.concurrency} streams in flight;")
    print(f"{args.input_len} input / {args.output_len} output tokens per request; zero server delay")
    row = "{:<44}{:>10.0f}{:>12.0f}"
    print(f"{'client':<44}{'req/s':>10}{'tok/s out':>12}")
    print(row.format("voltllm-bench (Rust) vs zero-delay mock", rust_rate, rust["output_throughput"]))
    print(row.format("baseline: Python asyncio+aiohttp, same mock", py_rate, py_rate * args.output_len))
    print(f"ratio harness / Python baseline: {rust_rate / py_rate:.2f}x")
    if rust["failed"]:
        print(f"warning: {rust['failed']} harness requests failed: {rust['failure_reasons']}")
    if args.server_url:
        srv = harness_rate(args.server_url, args, args.server_model)
        ratio = rust_rate / srv["request_throughput"]
        print(f"{'server under test (same harness settings)':<44}{srv['request_throughput']:>10.0f}")
        verdict = "OK" if ratio >= 2 else "TOO LOW"
        print(f"headroom: harness max rate / server max rate = {ratio:.2f}x (need >= 2: {verdict})")
        return 0 if ratio >= 2 else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
