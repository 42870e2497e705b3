"""Tensor and data parallelism: TP=1 vs TP=2 batch-1 decode and offline throughput, how far TP=2's
greedy tokens agree with TP=1's, and DP=1 vs DP=2 serving throughput (the GPU measurements of issue
19; TP=2 and DP=2 need two GPUs).

Both engines load one random checkpoint (transformers' initialization, seeded, in the shape of
Qwen3-0.6B or, with `--tiny`, a 4-layer Qwen3 for the CPU), so their weights are the same; dummy
weights would not be, as each rank fills its own shard. One engine at a time in this process:
TP=1, then TP=2 (this process is rank 0, a worker process holds the other shard).

- batch-1 decode: ms per output token of one request, from two runs that differ only in the number
  of output tokens (the prefill cancels out);
- throughput: `--num-seqs` requests of `--prompt-len` tokens, `--output-len` each, ignore_eos, greedy;
- agreement: 8 prompts, 32 greedy tokens each: sequences identical, and the mean length of the
  common prefix (fp16 rounding differs between the two reductions, so a late divergence is expected).

Both run with CUDA graphs (a tensor-parallel engine captures its NCCL collectives in them,
`docs/parallel.md`); `--enforce-eager` runs both eagerly.

Data parallelism is a serving feature (one engine process per replica behind the Rust front end), so
its rows go through `voltllm serve --data-parallel-size N --load-format dummy` (the model folder and
load tester of benches/serving.py): `--num-seqs` requests sent at once, `--prompt-len` /
`--output-len` tokens each, ignore_eos, greedy; output tokens/s as the load tester measures them, and
how many requests each engine finished (the server's per-engine `vllm:request_success`). On the CPU
each of DP=2's engines gets half of DP=1's threads (`voltllm serve`'s default share).

    python benches/parallel.py                        # GPU: Qwen3-0.6B shape, TP and DP rows
    python benches/parallel.py --tiny --device cpu --num-seqs 8 --prompt-len 32 --output-len 16
    python benches/parallel.py --only dp --tiny --device cpu --num-seqs 16 --prompt-len 32 --output-len 16
"""

from __future__ import annotations

import argparse
import random
import signal
import tempfile
import time
from pathlib import Path

import torch
from model_shapes import QWEN3_0_6B, TINY
from serving import (
    SMOLLM2_TOKENIZER,
    check_saturation,
    free_port,
    length_flags,
    run_harness,
    start_server,
    stop_server,
    wait_healthy,
    write_model_dir,
)
from serving import _metric as metric_sum

from voltllm.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from voltllm.engine.args import add_engine_args
from voltllm.engine.core import resolve_device, resolve_dtype
from voltllm.engine.llm_engine import LLMEngine
from voltllm.protocol import EngineCoreRequest, EngineSamplingParams

AGREEMENT_PROMPTS = 8
AGREEMENT_TOKENS = 32


def write_checkpoint(shape: dict, out_dir: Path, dtype: torch.dtype, seed: int) -> Path:
    """A random checkpoint of `shape` (transformers' own initialization) in `out_dir`."""
    import transformers

    config = transformers.AutoConfig.for_model(**{k: v for k, v in shape.items() if k != "torch_dtype"})
    config.architectures = shape["architectures"]
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(out_dir)
    return out_dir


def greedy(max_tokens: int) -> EngineSamplingParams:
    return EngineSamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def timed(engine: LLMEngine, requests: list[EngineCoreRequest], device: torch.device) -> tuple[float, dict]:
    """(seconds, outputs) of running `requests` to completion."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    outputs = engine.generate_token_ids(requests)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start, outputs


def measure(engine: LLMEngine, args: argparse.Namespace, device: torch.device, vocab: int) -> dict:
    """Batch-1 ms per token, throughput in output tokens/s, and the agreement prompts' greedy tokens."""
    rng = random.Random(args.seed)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(n)]

    one = prompt(args.prompt_len)
    engine.generate_token_ids([EngineCoreRequest("warmup", one[:16], greedy(4), 0.0)])
    short, _ = timed(engine, [EngineCoreRequest("short", one, greedy(1), 0.0)], device)
    long, _ = timed(engine, [EngineCoreRequest("long", one, greedy(1 + args.decode_tokens), 0.0)], device)
    batch = [
        EngineCoreRequest(f"seq{i}", prompt(args.prompt_len), greedy(args.output_len), 0.0)
        for i in range(args.num_seqs)
    ]
    elapsed, _ = timed(engine, batch, device)
    agreement = [EngineCoreRequest(f"a{i}", prompt(48), greedy(AGREEMENT_TOKENS), 0.0) for i in range(8)]
    _, outputs = timed(engine, agreement, device)
    return {
        "ms_per_token": 1e3 * (long - short) / args.decode_tokens,
        "tokens_per_s": args.num_seqs * args.output_len / elapsed,
        "greedy": [outputs[r.request_id].new_token_ids for r in agreement],
    }


def run_engine(model_dir: Path, args: argparse.Namespace, tp: int, vocab: int) -> dict:
    device = resolve_device(args.device)
    config = EngineConfig(
        model=ModelConfig(model=str(model_dir), dtype=args.dtype),
        cache=CacheConfig(num_kv_blocks=args.num_kv_blocks),
        scheduler=SchedulerConfig(max_num_seqs=max(args.num_seqs, AGREEMENT_PROMPTS)),
        device=args.device,
        enforce_eager=args.enforce_eager,
        tensor_parallel_size=tp,
    )
    engine = LLMEngine(config)
    try:
        return measure(engine, args, device, vocab)
    finally:
        engine.shutdown()


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def serve_throughput(model_dir: Path, args: argparse.Namespace, dp: int, out: Path) -> dict:
    """Output tokens/s of `voltllm serve --data-parallel-size dp` on the saturation workload, and the
    requests each engine finished."""
    engine_parser = argparse.ArgumentParser()
    add_engine_args(engine_parser)
    flags = [str(model_dir), "--load-format", "dummy", "--device", args.device, "--dtype", args.dtype,
             "--data-parallel-size", str(dp), "--max-num-seqs", str(args.num_seqs)]  # fmt: skip
    if args.num_kv_blocks is not None:
        flags += ["--num-kv-blocks", str(args.num_kv_blocks)]
    if args.enforce_eager:
        flags.append("--enforce-eager")
    engine_args = engine_parser.parse_args(flags)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = out / f"server-dp{dp}.log"
    length, ratio = length_flags(args.prompt_len, args.prompt_len)
    server = start_server(model_dir, engine_args, port, log)
    try:
        print(f"DP={dp}: server healthy after {wait_healthy(server, url, 900, log):.1f} s", flush=True)
        result = run_harness(url, model_dir / "tokenizer.json", out / f"dp{dp}.json", [
            "--random-input-len", str(length), "--random-output-len", str(args.output_len),
            "--random-range-ratio", repr(ratio), "--num-prompts", str(args.num_seqs),
            "--max-concurrency", str(args.num_seqs), "--num-warmups", str(args.num_seqs),
            "--seed", str(args.seed),
        ])  # fmt: skip
    finally:
        stop_server(server)
    # The load tester draws output lengths with the same ratio as the inputs: 0, so exact.
    check_saturation(
        result, args.num_seqs, min(args.prompt_len, args.output_len), max(args.prompt_len, args.output_len)
    )
    before, after = result["server_metrics"]["before"], result["server_metrics"]["after"]
    delta = {k: v - before.get(k, 0.0) for k, v in after.items()}
    finished = [metric_sum(delta, "vllm:request_success", engine=str(i)) for i in range(dp)]
    return {"tokens_per_s": result["output_throughput"], "finished": finished}


def run_data_parallel(args: argparse.Namespace) -> dict[int, dict]:
    """DP=1 then DP=2 serving throughput on one dummy-weight folder of the shape asked for."""
    # SIGTERM must unwind through stop_server, so no server outlives this script.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    with tempfile.TemporaryDirectory(prefix="voltllm-dp-") as tmp:
        model_dir = Path(tmp) / "model"
        model_dir.mkdir()
        write_model_dir(model_dir, TINY if args.tiny else QWEN3_0_6B, SMOLLM2_TOKENIZER)
        return {dp: serve_throughput(model_dir, args, dp, Path(tmp)) for dp in (1, 2)}


def report_data_parallel(results: dict[int, dict], args: argparse.Namespace) -> None:
    print(f"| config | serving throughput tok/s ({args.num_seqs} seqs at once) | requests per engine |")
    print("| --- | --- | --- |")
    for dp, r in results.items():
        print(f"| DP={dp} | {r['tokens_per_s']:.1f} | {' / '.join(f'{n:g}' for n in r['finished'])} |")
    print(f"| DP=2 / DP=1 | {results[2]['tokens_per_s'] / results[1]['tokens_per_s']:.2f}x | |")


def report(results: dict[int, dict], args: argparse.Namespace) -> None:
    one, two = results[1], results[2]
    print(f"| config | batch-1 ms/token | throughput tok/s ({args.num_seqs} seqs) |")
    print("| --- | --- | --- |")
    for tp, r in results.items():
        print(f"| TP={tp} | {r['ms_per_token']:.2f} | {r['tokens_per_s']:.1f} |")
    print(
        f"| TP=2 / TP=1 | {two['ms_per_token'] / one['ms_per_token']:.2f}x | "
        f"{two['tokens_per_s'] / one['tokens_per_s']:.2f}x |"
    )
    same = sum(a == b for a, b in zip(one["greedy"], two["greedy"], strict=True))
    prefix = sum(common_prefix(a, b) for a, b in zip(one["greedy"], two["greedy"], strict=True))
    print(
        f"greedy agreement TP=2 vs TP=1: {same}/{AGREEMENT_PROMPTS} sequences identical, common prefix "
        f"{prefix / AGREEMENT_PROMPTS:.1f} of {AGREEMENT_TOKENS} tokens on average"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true", help="a 4-layer Qwen3 instead of the Qwen3-0.6B shape")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--num-seqs", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--decode-tokens", type=int, default=64, help="batch-1 output tokens timed")
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--enforce-eager", action="store_true", help="every engine without CUDA graphs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only", choices=["tp", "dp", "all"], default="all", help="which rows to measure")
    args = p.parse_args()
    shape = TINY if args.tiny else QWEN3_0_6B
    device = resolve_device(args.device)
    hardware = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    title = f"{hardware}, {'tiny Qwen3' if args.tiny else 'Qwen3-0.6B shape'}, dtype {args.dtype}"
    if args.only in ("tp", "all"):
        with tempfile.TemporaryDirectory(prefix="voltllm-parallel-") as tmp:
            model_dir = write_checkpoint(shape, Path(tmp), resolve_dtype(args.dtype, device), args.seed)
            results = {tp: run_engine(model_dir, args, tp, shape["vocab_size"]) for tp in (1, 2)}
        print(title)
        report(results, args)
    if args.only in ("dp", "all"):
        dp_results = run_data_parallel(args)
        print(title)
        report_data_parallel(dp_results, args)


if __name__ == "__main__":
    main()
