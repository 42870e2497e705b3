"""Batch-1 decode with the attention fusions and the sampling methods on and off, side by side in one
process (issue 21).

For each model one engine (dummy weights, fp16, CUDA graphs) is built once; each round sets the attention
backend's switches for a variant, captures the decode graphs again and times batch-1 decode under each
sampling method (`--samplers`: the runner's `Sampler.method`, "select" or "race_first"; see
`voltllm.ops.sampling`), through `LLM.generate` by default (`decode_latency.api_step_time`) or engine
steps (`--api engine`). Variants:

* `unfused`: the prologue kernel (q/k norm + rotary + KV write) before the decode kernel, splits merged
  by the split-merge kernel (what main ran before the fusions);
* `fold`: the prologue inside the decode kernel, splits still merged by the split-merge kernel;
* `fold+ticket`: the prologue inside, and the splits merged by the decode kernel's last split block
  (the default, `decode_merge="auto"`);
* `fold+ticket/512`, `fold/512`: the same with splits of at least 512 tokens instead of 256 (so a context
  under 512 tokens is never split); `fold+ticket/64`: splits of 64 tokens (more blocks at batch 1, each
  warp one KV block; the default since call 3 of session 10: `DECODE_MIN_SPLIT`);
* `fold+ticket/64+lm32`: that, with the lm_head's GEMV storing the fp32 logits itself
  (`ParallelLMHead.fp32_gemv`), so the decode graph has no cast kernel after it (main);
* `fold+ticket/64+lm32+l2`: that, with the decode kernel asking L2 for the layer's next weights (o_proj
  and the dense MLP's weights, or the MoE router) through the TMA's bulk prefetch while it attends
  (`l2_prefetch_max_seqs` 8; SM90+), so the GEMVs after it read them from L2.

`--models qwen3-30b-a3b` times the MoE step too; its floor counts the experts a token is routed to
(`benches/moe.py`'s `touched_bytes`), `llama-3-8b-awq` (dummy AWQ weights, issue 16) the packed weights
and one embedding row, the dense models' every weight.

(Session 14 measured the decode kernel merging every split count itself at batch 1, with 64- and
128-token splits: 1.016x and 1.039x the step of `fold+ticket/64+lm32`, so "auto" keeps the merge
kernel past `TICKET_MERGE_MAX_SPLITS`; those variants were removed.)

(Session 16 measured the decode kernel asking L2 for the layer's next weights while it attends with a
`prefetch.global.L2` per line, and a MoE block's add + RMSNorm folded into its router's GEMV: both
slower, both removed; RESULTS "Session 16". `+l2` is the first of them again, asked in 32 KB bulk
requests.)

(Session 10's GEMV switches, whole-row L2 prefetch and a first-chunk register preload, measured no gain
and were removed.)

Prints, per sampling setting, the median step over the rounds (rounds alternate the variants and
samplers), tokens/s, the ratio of each (variant, sampler)'s step to the first one's measured in the same
run, the weight-bandwidth floor over the step, the device time of one replay of the batch-1 decode graph
(CUDA events; the GPU's part of a step, which asynchronous scheduling leaves as the step time), and
whether the step meets `--target` tokens/s (issue 21 item 2: 1,250 for Qwen3-0.6B).

    python benches/batch1_ab.py --models qwen3-0.6b llama-3-8b --rounds 3
    python benches/batch1_ab.py --sampling greedy 0.6/0.95 --variants unfused fold+ticket
    python benches/batch1_ab.py --variants fold+ticket/64 --samplers select race_first \
        --sampling greedy 0.6/0.95
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_latency import (  # noqa: E402
    SHAPES,
    api_step_time,
    copy_bandwidth,
    decode_steps,
    dummy_model_config,
    weight_bytes,
)
from moe import touched_bytes  # noqa: E402
from quantization import bytes_per_token  # noqa: E402

from voltllm import LLM  # noqa: E402
from voltllm.layers.fused_moe import FusedMoE  # noqa: E402
from voltllm.ops.sampling import METHOD_CHOICES  # noqa: E402

# name -> the SM70AttentionBackend switches (fold_prologue, decode_merge, decode_min_split,
# l2_prefetch_max_seqs) and ParallelLMHead.fp32_gemv
VARIANTS = {
    "unfused": (False, "kernel", 256, 0, False),
    "fold": (True, "kernel", 256, 0, False),
    "fold+ticket": (True, "auto", 256, 0, False),
    "fold/512": (True, "kernel", 512, 0, False),
    "fold+ticket/512": (True, "auto", 512, 0, False),
    "fold+ticket/64": (True, "auto", 64, 0, False),
    "fold+ticket/64+lm32": (True, "auto", 64, 0, True),
    "fold+ticket/64+lm32+l2": (True, "auto", 64, 8, True),
}


def build_llm(name: str, async_scheduling: bool | None) -> LLM:
    """An in-process LLM of the model's shape with dummy weights, fp16, CUDA graphs."""
    with tempfile.TemporaryDirectory() as tmp:
        config = dummy_model_config(tmp, name, eager=False, tokenizer=True, async_scheduling=async_scheduling)
        return LLM.from_engine_config(config)


def set_variant(llm: LLM, variant: str) -> None:
    """The variant's switches on the attention backend and the lm_head; graphs captured again."""
    runner = llm.engine.core.runner
    backend = runner.model.attn_backend
    fold, merge, min_split, l2_seqs, lm32 = VARIANTS[variant]
    backend.fold_prologue, backend.decode_merge, backend.decode_min_split = fold, merge, min_split
    backend.l2_prefetch_max_seqs = l2_seqs
    runner.model.lm_head.fp32_gemv = lm32
    runner.capture_cuda_graphs()


def floor_bytes(model: torch.nn.Module) -> int:
    """The weight bytes of a batch-1 step: every weight; on a MoE model those a token touches; on a
    quantized one the packed weights and one embedding row (`benches/quantization.py`'s count)."""
    if any(isinstance(m, FusedMoE) for m in model.modules()):
        return touched_bytes(model)
    if any(hasattr(m, "quantized_matmul") for m in model.modules()):
        return bytes_per_token(model)[1]
    return weight_bytes(model)


def step_seconds(llm: LLM, args: argparse.Namespace) -> float:
    """Seconds per batch-1 decode step, through LLM.generate or engine steps (`args.api`)."""
    if args.api == "llm":
        return api_step_time(llm, args.prompt_len, args.tokens, args)
    decode_steps(llm.engine, args.prompt_len, 8, args)  # warm-up
    times, _ = decode_steps(llm.engine, args.prompt_len, args.tokens, args)
    return statistics.median(times)


def replay_seconds(llm: LLM, iters: int = 50) -> float:
    """Device seconds per replay of the batch-1 decode graph on the inputs the last step left (a context
    of about prompt + tokens), CUDA-event timed: the GPU's share of a step, without the host's."""
    graphs = llm.engine.core.runner.graphs
    torch.cuda.synchronize()
    samples = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            graphs.replay(1)
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e-3 / iters)
    return statistics.median(samples)


def sampling_namespace(args: argparse.Namespace, spec: str) -> argparse.Namespace:
    """`args` with the temperature and top-p of a sampling spec: "greedy" or "T/P" (e.g. "0.6/0.95")."""
    temperature, top_p = (0.0, 1.0) if spec == "greedy" else (float(x) for x in spec.split("/"))
    return argparse.Namespace(**{**vars(args), "temperature": temperature, "top_p": top_p})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=["qwen3-0.6b"], choices=list(SHAPES))
    p.add_argument(
        "--variants", nargs="+", default=["unfused", "fold", "fold+ticket"], choices=list(VARIANTS)
    )
    p.add_argument("--samplers", nargs="+", default=["auto"], choices=list(METHOD_CHOICES))
    p.add_argument("--target", type=float, default=1250.0, help="tokens/s the step should reach")
    p.add_argument(
        "--sampling",
        nargs="+",
        default=["greedy"],
        help='"greedy" or "T/P" (temperature / top-p), e.g. 0.6/0.95',
    )
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--tokens", type=int, default=64, help="tokens generated per measured request")
    p.add_argument("--api", choices=["engine", "llm"], default="llm")
    p.add_argument(
        "--async-scheduling",
        choices=["default", "on", "off"],
        default="default",
        help="the engine's by default",
    )
    args = p.parse_args()
    async_scheduling = {"default": None, "on": True, "off": False}[args.async_scheduling]
    bandwidth = copy_bandwidth()
    print(
        f"copy bandwidth {bandwidth / 1e9:.0f} GB/s; {args.api}; baseline {args.variants[0]} + "
        f"{args.samplers[0]}; prompt {args.prompt_len}; target {args.target:.0f} tok/s"
    )
    print(
        "| model | variant | sampler | sampling | step (ms) | tokens/s | step / baseline | floor / step | "
        "graph replay (ms) | target met | rounds (ms) |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    configs = [(v, m) for v in args.variants for m in args.samplers]
    for name in args.models:
        llm = build_llm(name, async_scheduling)
        print(f"{name}: async scheduling {llm.engine.core.async_scheduling}", flush=True)
        sampler = llm.engine.core.runner.sampler
        floor = floor_bytes(llm.engine.core.runner.model) / bandwidth
        times = {(c, s): [] for c in configs for s in args.sampling}
        replays: dict[str, list[float]] = {v: [] for v in args.variants}
        for _ in range(args.rounds):
            for variant in args.variants:
                set_variant(llm, variant)
                for method in args.samplers:
                    sampler.method = method
                    for spec in args.sampling:
                        seconds = step_seconds(llm, sampling_namespace(args, spec))
                        times[(variant, method), spec].append(seconds)
                replays[variant].append(replay_seconds(llm))
        sampler.method = "auto"
        for spec in args.sampling:
            base = statistics.median(times[configs[0], spec])
            for variant, method in configs:
                step = statistics.median(times[(variant, method), spec])
                replay = statistics.median(replays[variant])
                rounds = " ".join(f"{t * 1e3:.3f}" for t in times[(variant, method), spec])
                met = "yes" if 1 / step >= args.target else "no"
                print(
                    f"| {name} | {variant} | {method} | {spec} | {step * 1e3:.3f} | {1 / step:.0f} | "
                    f"{step / base:.3f} | {floor / step:.3f} | {replay * 1e3:.3f} | {met} | {rounds} |",
                    flush=True,
                )
        del llm


if __name__ == "__main__":
    main()
