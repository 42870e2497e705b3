"""One step's token draw on the GPU, the sampling methods side by side in one process (issue 21): the
radix-select sampler ("select", the default; torch's argmax for greedy) against race-first ("race_first":
the race's best tokens checked against top-p, one launch for greedy and temperature-only batches), at
Qwen3's vocabulary size, fp32 logits as the decode graph leaves them.

Each row is (logits, batch, setting); every method's tokens are checked against the sort-based torch
reference on the timed inputs (they must all match it, up to rare last-bit exp/log near-ties). Times
are device time per call by default (the host queues 10 calls behind a sleep kernel, so the events see
the GPU alone: what a step pays with the draw queued behind the forward, as asynchronous scheduling
runs it); `--single-call` times single calls between events instead (the host's issue time included).

    python benches/sampling.py
    python benches/sampling.py --batches 1 256 --scales flat
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernel_bench import time_ms  # noqa: E402
from sampling_ab import device_ms  # noqa: E402

from voltllm.ops.sampling import (  # noqa: E402
    SAMPLING_METHODS,
    argmax_tokens,
    random_seeds,
    sample_tokens,
    sample_tokens_ref,
)

VOCAB = 151_936
SETTINGS = {  # name -> (temperature, top_k, top_p); temperature 0: greedy
    "greedy": (0.0, 0, 1.0),
    "T=0.6": (0.6, 0, 1.0),
    "T=0.6 top-p 0.95": (0.6, 0, 0.95),
    "T=0.6 top-p 0.5": (0.6, 0, 0.5),
    "T=0.6 top-k 50 top-p 0.95": (0.6, 50, 0.95),
}
SCALES = {"peaked": 4.0, "flat": 0.01}  # logits' std: a trained model's, and what dummy weights give


def draw(method: str, logits: torch.Tensor, setting: tuple[float, int, float], seeds: torch.Tensor):
    """The call the sampler makes for a batch of one setting (a filter no row uses is None)."""
    t, k, p = setting
    rows = logits.shape[0]
    if t == 0:
        return lambda: argmax_tokens(logits, method)
    temperature = torch.full((rows,), t, device="cuda")
    top_k = torch.full((rows,), k, dtype=torch.int32, device="cuda") if k else None
    top_p = torch.full((rows,), p, device="cuda") if p < 1 else None
    return lambda: sample_tokens(logits, temperature, top_k, top_p, None, seeds, method)


def reference(logits: torch.Tensor, setting: tuple[float, int, float], seeds: torch.Tensor) -> torch.Tensor:
    t, k, p = setting
    rows = logits.shape[0]
    return sample_tokens_ref(
        logits,
        torch.full((rows,), t, device="cuda"),
        torch.full((rows,), k, dtype=torch.int32, device="cuda"),
        torch.full((rows,), p, device="cuda"),
        None,
        seeds,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256])
    p.add_argument("--scales", nargs="+", default=list(SCALES), choices=list(SCALES))
    p.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--single-call", action="store_true", help="single calls, host time included")
    args = p.parse_args()
    methods = list(SAMPLING_METHODS)
    base = methods[0]
    kind = "single calls" if args.single_call else "device time per call"
    print(
        f"GPU: {torch.cuda.get_device_name()}; vocab {VOCAB}; fp32 logits; median of {args.reps} {kind} (us)"
    )
    ratios = " | ".join(f"{m} / {base}" for m in methods[1:])
    print(f"| logits | batch | sampling | {' | '.join(methods)} | {ratios} | mismatches vs reference |")
    print("| --- " * (4 + 2 * (len(methods) - 1) + 1) + "|")
    for label in args.scales:
        for rows in args.batches:
            torch.manual_seed(rows)
            logits = torch.randn(rows, VOCAB, device="cuda") * SCALES[label]
            seeds = random_seeds(rows, torch.device("cuda"))
            for name in args.settings:
                setting = SETTINGS[name]
                want = reference(logits, setting, seeds)
                times, wrong = {}, []
                for method in methods:
                    call: Callable[[], torch.Tensor] = draw(method, logits, setting, seeds)
                    wrong.append(f"{method} {int((call() != want).sum())}")
                    if args.single_call:
                        times[method] = time_ms(lambda i, call=call: call(), iters=1, repeats=args.reps)
                    else:
                        times[method] = device_ms(call, args.reps)
                cells = " | ".join(f"{times[m] * 1e3:.1f}" for m in methods)
                ratio_cells = " | ".join(f"{times[m] / times[base]:.2f}" for m in methods[1:])
                print(
                    f"| {label} | {rows} | {name} | {cells} | {ratio_cells} | {', '.join(wrong)} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
