"""Batch-1 decode speed against the weight-bandwidth floor, with and without CUDA graphs.

One request (128-token prompt, greedy, ignore_eos) runs through the engine step by step; a decode
step's time is its wall time on the host (each step ends by copying the sampled token to the host,
so it covers the GPU work too). The floor is the model's weight bytes over the device copy bandwidth
measured in the same run: a decode step at batch 1 must read every weight once. Dummy weights of the
real shapes; fp16. Prints a table: median step time, tokens/s, floor, floor / step, and the runner's
host-side split of a step.

    python benches/decode_latency.py                     # Qwen3-0.6B and Llama-3-8B shapes
    python benches/decode_latency.py --models qwen3-0.6b --tokens 64
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from model_shapes import LLAMA3_8B, QWEN3_0_6B  # noqa: E402

from voltllm.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig  # noqa: E402
from voltllm.engine.llm_engine import LLMEngine  # noqa: E402
from voltllm.protocol import EngineCoreRequest, EngineSamplingParams  # noqa: E402

MODELS = {"qwen3-0.6b": QWEN3_0_6B, "llama-3-8b": LLAMA3_8B}


def copy_bandwidth() -> float:
    """Device-to-device copy of 1 GiB, bytes read + written per second (median of 10)."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    times = []
    for _ in range(12):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3)
    return 2 * src.numel() / statistics.median(times[2:])


def weight_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())  # tied weights count once


def decode_steps(engine: LLMEngine, prompt_len: int, tokens: int) -> tuple[list[float], list]:
    """Per-step wall times and runner timings of the decode steps of one request."""
    params = EngineSamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    engine.add_request(EngineCoreRequest("r", list(range(10, 10 + prompt_len)), params, 0.0))
    times, timings = [], []
    first = True
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        elapsed = time.perf_counter() - start
        if first:  # the prefill step
            first = False
            continue
        times.append(elapsed)
        timings.append(engine.core.runner.last_timings)
    return times, timings


def measure(name: str, eager: bool, args: argparse.Namespace, bandwidth: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(MODELS[name]))
        config = EngineConfig(
            model=ModelConfig(model=tmp, load_format="dummy", dtype="float16", max_model_len=4096),
            cache=CacheConfig(num_kv_blocks=2048),
            scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=4096),
            device="cuda",
            enforce_eager=eager,
        )
        engine = LLMEngine(config)
    decode_steps(engine, args.prompt_len, 8)  # warm-up
    times, timings = decode_steps(engine, args.prompt_len, args.tokens)
    floor = weight_bytes(engine.core.runner.model) / bandwidth
    step = statistics.median(times)
    row = {
        "model": name,
        "mode": "eager" if eager else "cuda graphs",
        "step_ms": step * 1e3,
        "tok_s": 1 / step,
        "floor_ms": floor * 1e3,
        "floor_over_step": floor / step,
        "prepare_us": statistics.median(t.prepare_s for t in timings) * 1e6,
        "forward_us": statistics.median(t.forward_s for t in timings) * 1e6,
        "post_us": statistics.median(t.post_s for t in timings) * 1e6,
        "graph_steps": sum(t.cuda_graph for t in timings),
        "steps": len(timings),
    }
    del engine
    torch.cuda.empty_cache()
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--tokens", type=int, default=256, help="tokens generated per measured request")
    p.add_argument("--no-eager", action="store_true", help="skip the eager comparison rows")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    bandwidth = copy_bandwidth()
    print(f"GPU: {torch.cuda.get_device_name()}; copy bandwidth {bandwidth / 1e9:.0f} GB/s (read + write)")
    rows = []
    for name in args.models:
        for eager in [False] if args.no_eager else [False, True]:
            rows.append(measure(name, eager, args, bandwidth))
            r = rows[-1]
            print(
                f"{r['model']:11s} {r['mode']:11s} step {r['step_ms']:7.3f} ms  {r['tok_s']:7.1f} tok/s  "
                f"floor {r['floor_ms']:6.3f} ms ({r['floor_over_step']:.2f})  host prepare "
                f"{r['prepare_us']:.0f} us forward {r['forward_us']:.0f} us post {r['post_us']:.0f} us  "
                f"graph steps {r['graph_steps']}/{r['steps']}",
                flush=True,
            )
    print("\n| model | mode | step (ms) | tokens/s | weight floor (ms) | floor / step |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(
            f"| {r['model']} | {r['mode']} | {r['step_ms']:.3f} | {r['tok_s']:.0f} | {r['floor_ms']:.3f} | "
            f"{r['floor_over_step']:.2f} |"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
