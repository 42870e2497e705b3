"""Tensor parallelism: TP=1 vs TP=2 batch-1 decode and offline throughput, and how far TP=2's greedy
tokens agree with TP=1's (the GPU measurements of issue 19; it needs two GPUs for TP=2).

Both engines load one random checkpoint (transformers' initialization, seeded, in the shape of
Qwen3-0.6B or, with `--tiny`, a 4-layer Qwen3 for the CPU), so their weights are the same; dummy
weights would not be, as each rank fills its own shard. One engine at a time in this process:
TP=1, then TP=2 (this process is rank 0, a worker process holds the other shard).

- batch-1 decode: ms per output token of one request, from two runs that differ only in the number
  of output tokens (the prefill cancels out);
- throughput: `--num-seqs` requests of `--prompt-len` tokens, `--output-len` each, ignore_eos, greedy;
- agreement: 8 prompts, 32 greedy tokens each: sequences identical, and the mean length of the
  common prefix (fp16 rounding differs between the two reductions, so a late divergence is expected).

A tensor-parallel engine on CUDA runs without CUDA graphs for now (`docs/parallel.md`); `--enforce-eager`
runs TP=1 eagerly too, for a like-for-like comparison. Data parallelism (DP=1 vs DP=2) is not in the
engine yet: its rows print as such.

    python benches/parallel.py                        # GPU: Qwen3-0.6B shape
    python benches/parallel.py --tiny --device cpu --num-seqs 8 --prompt-len 32 --output-len 16
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

import torch
from model_shapes import QWEN3_0_6B, TINY

from voltllm.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
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
    print("| DP=1 vs DP=2 | not in the engine yet | not in the engine yet |")
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
    p.add_argument("--enforce-eager", action="store_true", help="TP=1 without CUDA graphs too")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    shape = TINY if args.tiny else QWEN3_0_6B
    device = resolve_device(args.device)
    with tempfile.TemporaryDirectory(prefix="voltllm-parallel-") as tmp:
        model_dir = write_checkpoint(shape, Path(tmp), resolve_dtype(args.dtype, device), args.seed)
        results = {tp: run_engine(model_dir, args, tp, shape["vocab_size"]) for tp in (1, 2)}
    hardware = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    print(f"{hardware}, {'tiny Qwen3' if args.tiny else 'Qwen3-0.6B shape'}, dtype {args.dtype}")
    report(results, args)


if __name__ == "__main__":
    main()
