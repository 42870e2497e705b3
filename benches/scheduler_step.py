"""Host time of the scheduler alone: `schedule()` + `update_from_output()` at steady decode.

`--num-seqs` requests (256) with prompts of staggered lengths (so some reach a KV block boundary every
step, as in real batches) are prefilled, then `--steps` decode steps are timed with a runner that
samples one fixed token per request. Prints the median microseconds per step of each call with the
steady-decode fast path on (the default) and off (the plain path, the baseline measured in the same
run), and their ratio.

    python benches/scheduler_step.py [--num-seqs 256] [--steps 1000]
"""

from __future__ import annotations

import argparse
import statistics
import time

from voltllm.config import SchedulerConfig
from voltllm.core.kv_cache_manager import KVCacheManager
from voltllm.core.request import Request
from voltllm.core.sched_output import ModelRunnerOutput
from voltllm.core.scheduler import Scheduler
from voltllm.protocol import EngineSamplingParams


def time_steps(num_seqs: int, steps: int, steady_decode: bool) -> tuple[float, float]:
    """Median (schedule, update) microseconds per step."""
    kv = KVCacheManager(num_blocks=num_seqs * (steps + 400) // 16 + 64, block_size=16)
    scheduler = Scheduler(SchedulerConfig(), kv, max_model_len=100 + num_seqs + steps + 16)
    scheduler.enable_steady_decode = steady_decode
    params = EngineSamplingParams(max_tokens=1 << 20, ignore_eos=True, temperature=0.0)
    for i in range(num_seqs):
        scheduler.add_request(Request(f"r{i}", [1 + j % 100 for j in range(100 + i)], params))
    schedule_s, update_s = [], []
    while True:
        t0 = time.perf_counter()
        plan = scheduler.schedule()
        t1 = time.perf_counter()
        runner_output = ModelRunnerOutput(sampled_token_ids=[7] * len(plan.num_scheduled_tokens))
        t2 = time.perf_counter()
        scheduler.update_from_output(plan, runner_output)
        t3 = time.perf_counter()
        if scheduler.waiting or any(n != 1 for n in plan.num_scheduled_tokens.values()):
            continue  # still prefilling
        schedule_s.append(t1 - t0)
        update_s.append(t3 - t2)
        if len(schedule_s) == steps:
            return statistics.median(schedule_s) * 1e6, statistics.median(update_s) * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--num-seqs", type=int, default=256)
    p.add_argument("--steps", type=int, default=1000)
    args = p.parse_args()
    fast = time_steps(args.num_seqs, args.steps, steady_decode=True)
    plain = time_steps(args.num_seqs, args.steps, steady_decode=False)
    print(f"{args.num_seqs} steady decodes, median of {args.steps} steps, microseconds")
    print("path         schedule   update    total")
    for name, (s, u) in (("fast", fast), ("plain", plain)):
        print(f"{name:<10} {s:9.1f} {u:8.1f} {s + u:8.1f}")
    print(f"fast / plain: {sum(fast) / sum(plain):.2f}")


if __name__ == "__main__":
    main()
