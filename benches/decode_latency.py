"""Batch-1 decode speed against the weight-bandwidth floor, with and without CUDA graphs.

One request (128-token prompt, greedy unless `--temperature`, ignore_eos) runs through the engine step
by step; a decode step's time is its wall time on the host (each step ends by copying the sampled
token to the host, so it covers the GPU work too). `--api llm` goes through `LLM.generate` instead, the
path users take (detokenization included, with a dummy byte-level tokenizer of the model's vocabulary
size): the step time is then (t(N tokens) - t(1 token)) / (N - 1) over whole generate calls.
`--async-scheduling both` measures each engine with asynchronous scheduling off and then on (two rows);
`on` / `off` force one; the default is the engine's own choice.
The floor is the model's weight bytes over the device copy bandwidth
measured in the same run: a decode step at batch 1 must read every weight once. Dummy weights of the
real shapes; fp16. Prints a table: median step time, tokens/s, floor, floor / step, and the runner's
host-side split of a step.

    python benches/decode_latency.py                     # Qwen3-0.6B and Llama-3-8B shapes
    python benches/decode_latency.py --models qwen3-0.6b --tokens 64
    python benches/decode_latency.py --api llm --temperature 0.6 --top-p 0.95
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
from model_shapes import AWQ_CONFIG, LLAMA3_8B, QWEN3_0_6B, QWEN3_30B_A3B, write_dummy_tokenizer  # noqa: E402

from voltllm import LLM, SamplingParams  # noqa: E402
from voltllm.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig  # noqa: E402
from voltllm.engine.llm_engine import LLMEngine  # noqa: E402
from voltllm.protocol import EngineCoreRequest, EngineSamplingParams  # noqa: E402

MODELS = {"qwen3-0.6b": QWEN3_0_6B, "llama-3-8b": LLAMA3_8B}
# Every shape the batch-1 benches build engines of (`dummy_model_config`): these rows', the MoE step's and
# Llama-3-8B with dummy AWQ weights (issue 16's end-to-end shape).
SHAPES = {
    **MODELS,
    "qwen3-30b-a3b": QWEN3_30B_A3B,
    "llama-3-8b-awq": {**LLAMA3_8B, "quantization_config": AWQ_CONFIG},
}


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


def decode_steps(
    engine: LLMEngine, prompt_len: int, tokens: int, args: argparse.Namespace
) -> tuple[list[float], list]:
    """Per-step wall times and runner timings of the decode steps of one request."""
    params = EngineSamplingParams(
        temperature=args.temperature, top_p=args.top_p, max_tokens=tokens, ignore_eos=True
    )
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


def api_step_time(llm: LLM, prompt_len: int, tokens: int, args: argparse.Namespace) -> float:
    """Seconds per decode step through `LLM.generate`: whole calls of `tokens` and of 1 token, medians
    of three each, differenced (the prefill and the call's fixed costs cancel)."""
    prompt = [{"prompt_token_ids": list(range(10, 10 + prompt_len))}]

    def call(n: int) -> float:
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=n, ignore_eos=True)
        start = time.perf_counter()
        out = llm.generate(prompt, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        assert len(out[0].outputs[0].token_ids) == n
        return elapsed

    call(8)  # warm-up
    one = statistics.median(call(1) for _ in range(3))
    many = statistics.median(call(tokens) for _ in range(3))
    return (many - one) / (tokens - 1)


ASYNC_MODES = {"auto": [None], "on": [True], "off": [False], "both": [False, True]}


def dummy_model_config(
    tmp: str, name: str, eager: bool, tokenizer: bool, async_scheduling: bool | None = None
) -> EngineConfig:
    """The batch-1 benches' engine: model `name`'s shape written to `tmp` (with a dummy tokenizer for
    `LLM`), dummy fp16 weights on CUDA; `async_scheduling` None lets the engine choose."""
    (Path(tmp) / "config.json").write_text(json.dumps(SHAPES[name]))
    if tokenizer:
        write_dummy_tokenizer(tmp, SHAPES[name]["vocab_size"])
    return EngineConfig(
        model=ModelConfig(model=tmp, load_format="dummy", dtype="float16", max_model_len=4096),
        cache=CacheConfig(num_kv_blocks=2048),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=4096),
        device="cuda",
        enforce_eager=eager,
        async_scheduling=async_scheduling,
    )


def measure(name: str, eager: bool, args: argparse.Namespace, bandwidth: float) -> list[dict]:
    """One row per asynchronous-scheduling mode asked for, on one engine."""
    with tempfile.TemporaryDirectory() as tmp:
        config = dummy_model_config(tmp, name, eager, tokenizer=args.api == "llm")
        llm = LLM.from_engine_config(config) if args.api == "llm" else None
        engine = llm.engine if llm is not None else LLMEngine(config)
    rows = []
    for mode in ASYNC_MODES[args.async_scheduling]:
        if mode is not None:
            engine.core.set_async_scheduling(mode)
        rows.append(measure_mode(name, eager, args, bandwidth, llm, engine))
    del engine, llm
    torch.cuda.empty_cache()
    return rows


def measure_mode(
    name: str, eager: bool, args: argparse.Namespace, bandwidth: float, llm: LLM | None, engine: LLMEngine
) -> dict:
    if llm is not None:
        step = api_step_time(llm, args.prompt_len, args.tokens, args)
        timings = [engine.core.runner.last_timings]
    else:
        decode_steps(engine, args.prompt_len, 8, args)  # warm-up
        times, timings = decode_steps(engine, args.prompt_len, args.tokens, args)
        step = statistics.median(times)
    floor = weight_bytes(engine.core.runner.model) / bandwidth
    mode = "async" if engine.core.async_scheduling else "sync"
    return {
        "model": name,
        "mode": ("eager" if eager else "cuda graphs") + f", {sampling_label(args)}, {args.api}, {mode}",
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


def sampling_label(args: argparse.Namespace) -> str:
    if args.temperature == 0:
        return "greedy"
    return f"T={args.temperature}" + (f" top-p={args.top_p}" if args.top_p < 1 else "")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--tokens", type=int, default=256, help="tokens generated per measured request")
    p.add_argument("--no-eager", action="store_true", help="skip the eager comparison rows")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument(
        "--api", choices=["engine", "llm"], default="engine", help="LLMEngine steps, or LLM.generate calls"
    )
    p.add_argument(
        "--async-scheduling",
        choices=list(ASYNC_MODES),
        default="auto",
        help="auto: the engine's default; both: a row with it off and one with it on, same engine",
    )
    args = p.parse_args()
    bandwidth = copy_bandwidth()
    print(f"GPU: {torch.cuda.get_device_name()}; copy bandwidth {bandwidth / 1e9:.0f} GB/s (read + write)")
    rows = []
    for name in args.models:
        for eager in [False] if args.no_eager else [False, True]:
            for r in measure(name, eager, args, bandwidth):
                rows.append(r)
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
