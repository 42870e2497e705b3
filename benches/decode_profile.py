"""Where a decode step's GPU time goes: per-kernel device time of decode steps (torch profiler).

Runs requests of a dummy-weight model and profiles a few decode steps at the given batch size; prints
each kernel's calls and device time per step, largest first, and the total. Eager by default;
`--graphs` profiles CUDA-graph replays instead (the kernels as captured: the attention kernel's split
sized for max_model_len), which is what a served decode step runs.

With programmatic dependent launch (SM90+) a kernel starts before the one ahead of it ends and waits,
so its device time includes that wait and the times add up to more than the step. The "critical path"
column charges each kernel only for how much later it ends than the kernel before it (in start order):
what the step would lose without it, and a breakdown that adds up to the span of the step's kernels.

    python benches/decode_profile.py --model qwen3-0.6b --batch 1
    python benches/decode_profile.py --model qwen3-0.6b --batch 1 --context 256 --graphs
    python benches/decode_profile.py --model llama-3-8b-awq --graphs   # dummy AWQ weights
    python benches/decode_profile.py --model qwen3-30b-a3b --batch 1 --context 256 --graphs  # the MoE step
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_latency import SHAPES as MODELS  # noqa: E402  (the MoE step and AWQ Llama too: 17, 16)

from voltllm.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig  # noqa: E402
from voltllm.engine.llm_engine import LLMEngine  # noqa: E402
from voltllm.protocol import EngineCoreRequest, EngineSamplingParams  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="qwen3-0.6b", choices=list(MODELS))
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--graphs", action="store_true", help="profile CUDA-graph replays, not eager steps")
    args = p.parse_args()
    config = MODELS[args.model]
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(config))
        engine = LLMEngine(
            EngineConfig(
                model=ModelConfig(model=tmp, load_format="dummy", dtype="float16", max_model_len=4096),
                cache=CacheConfig(num_kv_blocks=4096),
                scheduler=SchedulerConfig(max_num_seqs=max(args.batch, 8), max_num_batched_tokens=8192),
                device="cuda",
                enforce_eager=not args.graphs,
            )
        )
    params = EngineSamplingParams(temperature=0.0, max_tokens=10 + args.steps, ignore_eos=True)
    for i in range(args.batch):
        engine.add_request(EngineCoreRequest(str(i), [5 + i] * args.context, params, 0.0))
    for _ in range(8):  # prefill and warm-up decodes
        engine.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            engine.step()
        torch.cuda.synchronize()
    # name -> [calls, device us, critical-path us]
    per_kernel: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
    events = sorted(
        (e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
        key=lambda e: e.time_range.start,
    )
    last_end = None
    for event in events:
        entry = per_kernel[event.name[:90]]
        entry[0] += 1
        entry[1] += event.device_time
        start, end = event.time_range.start, event.time_range.end
        # A kernel that starts after the previous ones ended (a host or graph gap) counts its own span.
        since = start if last_end is None or start >= last_end else last_end
        entry[2] += max(end - since, 0)
        last_end = end if last_end is None else max(last_end, end)
    rows = sorted(per_kernel.items(), key=lambda kv: -kv[1][2])
    total = sum(t for _, t, _ in per_kernel.values()) / args.steps
    path = sum(t for _, _, t in per_kernel.values()) / args.steps
    calls = sum(c for c, _, _ in per_kernel.values()) / args.steps
    mode = "graphs" if args.graphs else "eager"
    shape = f"{args.model} batch {args.batch} ctx {args.context} ({mode})"
    print(f"{shape}: {calls:.0f} kernels, {total:.1f} us device time, {path:.1f} us critical path per step")
    print(f"{'path us':>9} {'device us':>9} {'calls':>6}  kernel")
    for name, (count, us, critical) in rows[:25]:
        print(f"{critical / args.steps:9.1f} {us / args.steps:9.1f} {count / args.steps:6.0f}x  {name}")


if __name__ == "__main__":
    main()
