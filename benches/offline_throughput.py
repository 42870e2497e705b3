"""Offline generation throughput: voltllm's engine vs transformers' continuous batching, same process.

Workload (nano-vllm's): N sequences with random prompts, input and output lengths uniform in
[min_len, max_len], ignore_eos, greedy (or `--temperature` / `--top-p`, as nano-vllm's own benchmark
samples at 0.6). Weights are random (dummy) in the shape of the chosen config:
Qwen3-0.6B by default, a tiny Qwen3 with `--tiny` (for the CPU). Both engines get the same prompts;
voltllm generates each sequence's own output length, while `generate_batch` takes one
`max_new_tokens` for the whole batch, so it generates the mean output length for every sequence (the
same total number of output tokens). Prints output tokens/s of each and their ratio.

`--default-model` runs voltllm's embedded default model (SmolLM2-135M-Instruct, its real weights) in
both engines instead of a dummy-weight config; with `--num-seqs 1` that is the single-chat case.
`--threads N` sets torch's intra-op threads for both engines (default: torch's own choice).
`--api llm` drives voltllm through `LLM.generate` (the path users take: detokenization and outputs
included; a dummy byte-level tokenizer of the model's vocabulary size stands in for the real one)
instead of `LLMEngine.generate_token_ids`. `--async-scheduling both` times the same engine with
asynchronous scheduling off and on, alternating for `--rounds` rounds, and prints the ratio of the
medians (on / off); `on` / `off` force one, the default is the engine's own choice.

    python benches/offline_throughput.py                     # GPU, Qwen3-0.6B shape, 256 seqs, 100-1024
    python benches/offline_throughput.py --tiny --num-seqs 16 --min-len 32 --max-len 256   # CPU
    python benches/offline_throughput.py --default-model --num-seqs 16 --min-len 32 --max-len 64
    python benches/offline_throughput.py --api llm --temperature 0.6  # what users see
    python benches/offline_throughput.py --api llm --temperature 0.6 --async-scheduling both --skip-baseline
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch
from model_shapes import QWEN3_0_6B, TINY, write_dummy_tokenizer

from voltllm import LLM, SamplingParams
from voltllm.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from voltllm.engine.core import resolve_device, resolve_dtype
from voltllm.engine.llm_engine import LLMEngine
from voltllm.loader.default_model import DEFAULT_MODEL_NAME, default_model_dir
from voltllm.protocol import EngineCoreRequest, EngineSamplingParams


def make_workload(args: argparse.Namespace, vocab: int) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(args.seed)
    prompts = [
        [rng.randrange(vocab) for _ in range(rng.randint(args.min_len, args.max_len))]
        for _ in range(args.num_seqs)
    ]
    output_lens = [rng.randint(args.min_len, args.max_len) for _ in range(args.num_seqs)]
    return prompts, output_lens


ASYNC_MODES = {"auto": None, "on": True, "off": False, "both": None}


def run_voltllm(model_dir: Path, args, prompts, output_lens) -> tuple[float, int]:
    """(seconds, output tokens) of voltllm on the workload; with `--async-scheduling both`, the
    median of the asynchronous runs, after printing both modes and their ratio."""
    config = EngineConfig(
        model=ModelConfig(
            model=str(model_dir),
            load_format="auto" if args.default_model else "dummy",
            dtype=args.dtype,
            max_model_len=args.max_model_len,
        ),
        cache=CacheConfig(num_kv_blocks=args.num_kv_blocks),
        scheduler=SchedulerConfig(
            max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.num_seqs
        ),
        device=args.device,
        enforce_eager=args.enforce_eager,
        async_scheduling=ASYNC_MODES[args.async_scheduling],
    )
    if args.api == "llm":
        if not args.default_model:
            vocab_size = json.loads((model_dir / "config.json").read_text())["vocab_size"]
            write_dummy_tokenizer(model_dir, vocab_size)
        llm = LLM.from_engine_config(config)
        core = llm.engine.core

        def once() -> tuple[float, int]:
            return time_llm_run(llm, prompts, output_lens, args.device, args.temperature, args.top_p)
    else:
        engine = LLMEngine(config)
        core = engine.core

        def once() -> tuple[float, int]:
            return time_offline_run(engine, prompts, output_lens, args.device, args.temperature, args.top_p)

    if args.async_scheduling != "both":
        return once()
    return compare_async(core, once, args.rounds)


def compare_async(core, once, rounds: int) -> tuple[float, int]:
    """Time `once` with asynchronous scheduling off and on, alternating; print each run (with the
    share of its steps' wall time the host spent waiting for the device: near 100% is device-bound,
    the rest is host work the device may have waited for), the medians and their ratio. Returns the
    asynchronous median run."""
    runs: dict[bool, list[float]] = {False: [], True: []}
    num_tokens = 0
    step = core.step
    waited = [0.0, 0.0]  # seconds waiting for the device, seconds in steps

    def timed_step():
        out = step()
        waited[0] += core.last_step_timings.sync_s
        waited[1] += core.last_step_timings.total_s
        return out

    core.step = timed_step
    for _ in range(rounds):
        for enabled in (False, True):
            core.set_async_scheduling(enabled)
            waited[:] = [0.0, 0.0]
            elapsed, num_tokens = once()
            runs[enabled].append(elapsed)
            share = waited[0] / max(waited[1], 1e-9)
            print(
                f"  async scheduling {'on ' if enabled else 'off'}: {num_tokens / elapsed:9.1f} tok/s, "
                f"{share:.0%} of step time waiting for the device"
            )
    core.step = step
    off, on = statistics.median(runs[False]), statistics.median(runs[True])
    print(
        f"async scheduling: off {num_tokens / off:9.1f} tok/s, on {num_tokens / on:9.1f} tok/s "
        f"(median of {rounds}); on / off = {off / on:.3f}x"
    )
    return on, num_tokens


def time_offline_run(
    engine: LLMEngine,
    prompts: list[list[int]],
    output_lens: list[int],
    device: str,
    temperature: float = 0.0,
    top_p: float = 1.0,
) -> tuple[float, int]:
    """(seconds, output tokens) of one `engine.generate_token_ids` call over `prompts`, ignore_eos,
    each generating its `output_lens` entry, after one short warm-up request.

    The offline figure of this bench and of serving.py. Raises `RuntimeError` when a sequence did
    not generate exactly its length (the throughput would not be of the intended workload)."""

    def params(n: int) -> EngineSamplingParams:
        return EngineSamplingParams(temperature=temperature, top_p=top_p, max_tokens=n, ignore_eos=True)

    engine.generate_token_ids([EngineCoreRequest("warmup", prompts[0][:16], params(4), 0.0)])
    requests = [
        EngineCoreRequest(str(i), p, params(n), 0.0)
        for i, (p, n) in enumerate(zip(prompts, output_lens, strict=True))
    ]
    _sync(device)
    start = time.perf_counter()
    outputs = engine.generate_token_ids(requests)
    _sync(device)
    elapsed = time.perf_counter() - start
    num_tokens = sum(len(o.new_token_ids) for o in outputs.values())
    if num_tokens != sum(output_lens):
        raise RuntimeError(f"offline generated {num_tokens} tokens, expected {sum(output_lens)}")
    return elapsed, num_tokens


def time_llm_run(
    llm: LLM, prompts: list[list[int]], output_lens: list[int], device: str, temperature: float, top_p: float
) -> tuple[float, int]:
    """`time_offline_run` through `LLM.generate`: token-id prompts, one `SamplingParams` each."""

    def params(n: int) -> SamplingParams:
        return SamplingParams(temperature=temperature, top_p=top_p, max_tokens=n, ignore_eos=True)

    llm.generate([{"prompt_token_ids": prompts[0][:16]}], params(4), use_tqdm=False)
    _sync(device)
    start = time.perf_counter()
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], [params(n) for n in output_lens], use_tqdm=False
    )
    _sync(device)
    elapsed = time.perf_counter() - start
    num_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    if num_tokens != sum(output_lens):
        raise RuntimeError(f"offline generated {num_tokens} tokens, expected {sum(output_lens)}")
    return elapsed, num_tokens


def run_transformers(model_dir: Path, args, prompts, output_lens) -> tuple[float, int]:
    import transformers

    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    if args.default_model:
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    else:
        hf_config = transformers.AutoConfig.from_pretrained(model_dir)
        model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=dtype).to(device).eval()
    mean_len = round(sum(output_lens) / len(output_lens))
    sampling = {"do_sample": True, "temperature": args.temperature, "top_p": args.top_p, "top_k": 0}
    gen_config = transformers.GenerationConfig(
        max_new_tokens=mean_len,
        eos_token_id=None,
        pad_token_id=0,
        use_cuda_graph=False,
        **(sampling if args.temperature > 0 else {"do_sample": False}),
    )
    model.generate_batch([prompts[0][:16]], generation_config=gen_config, max_new_tokens=4)  # warm-up
    _sync(args.device)
    start = time.perf_counter()
    results = model.generate_batch(prompts, generation_config=gen_config)
    _sync(args.device)
    elapsed = time.perf_counter() - start
    num_tokens = sum(len(r.generated_tokens) for r in results.values())
    return elapsed, num_tokens


def _sync(device: str) -> None:
    if resolve_device(device).type == "cuda":
        torch.cuda.synchronize()


def hardware(device: str) -> str:
    if resolve_device(device).type == "cuda":
        return torch.cuda.get_device_name()
    return f"CPU {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true", help="a 4-layer Qwen3 instead of the Qwen3-0.6B shape")
    p.add_argument(
        "--default-model", action="store_true", help="the embedded default model with its real weights"
    )
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (both engines)")
    p.add_argument("--num-seqs", type=int, default=256)
    p.add_argument("--min-len", type=int, default=100)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-model-len", type=int, default=4096, help="as nano-vllm's benchmark")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--skip-baseline", action="store_true")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (both engines)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--api", choices=["engine", "llm"], default="engine", help="LLMEngine, or LLM.generate")
    p.add_argument(
        "--async-scheduling",
        choices=list(ASYNC_MODES),
        default="auto",
        help="auto: the engine's default; both: off and on compared on one engine",
    )
    p.add_argument("--rounds", type=int, default=2, help="rounds of each mode with --async-scheduling both")
    args = p.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.default_model:
        model_dir = default_model_dir()
        vocab_size = json.loads((model_dir / "config.json").read_text())["vocab_size"]
        run(model_dir, args, vocab_size, f"{DEFAULT_MODEL_NAME} (real weights)")
        return
    config = TINY if args.tiny else QWEN3_0_6B
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp)
        (model_dir / "config.json").write_text(json.dumps(config))
        name = "tiny Qwen3" if args.tiny else "Qwen3-0.6B shape"
        run(model_dir, args, config["vocab_size"], f"{name} (dummy weights)")


def run(model_dir: Path, args: argparse.Namespace, vocab_size: int, model_name: str) -> None:
    prompts, output_lens = make_workload(args, vocab_size)
    print(
        f"workload: {args.num_seqs} seqs, in/out lengths uniform in [{args.min_len}, {args.max_len}], "
        f"{sum(map(len, prompts))} prompt tokens, {sum(output_lens)} output tokens; "
        f"model: {model_name}; hardware: {hardware(args.device)}; "
        f"sampling: temperature {args.temperature}, top-p {args.top_p}; voltllm through {args.api}, "
        f"async scheduling {args.async_scheduling}"
    )
    t, n = run_voltllm(model_dir, args, prompts, output_lens)
    ours = n / t
    print(f"voltllm:      {n:7d} output tokens in {t:8.2f} s = {ours:9.1f} tok/s")
    if args.skip_baseline:
        return
    t, n = run_transformers(model_dir, args, prompts, output_lens)
    base = n / t
    print(f"transformers: {n:7d} output tokens in {t:8.2f} s = {base:9.1f} tok/s  (generate_batch)")
    print(f"ratio voltllm / transformers: {ours / base:.2f}x")


if __name__ == "__main__":
    main()
