"""Time of one step's token draw on the GPU: the radix sampling kernel against the sort-based torch
reference of the same draw and against a plain argmax (what greedy costs), at Qwen3's vocabulary size.

Each row of the table is a batch size and a setting (temperature only; temperature + top-p 0.95;
temperature + top-k 50 + top-p 0.95), timed with CUDA events over 50 calls after warm-up (median).

    python benches/sampling.py
    python benches/sampling.py --flat   # nearly equal logits, as dummy weights give
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernels import time_ms  # noqa: E402

from voltllm.ops.sampling import random_seeds, sample_tokens, sample_tokens_ref  # noqa: E402

VOCAB = 151_936
SETTINGS = {  # name -> (temperature, top_k, top_p)
    "T=0.6": (0.6, 0, 1.0),
    "T=0.6 top-p 0.95": (0.6, 0, 0.95),
    "T=0.6 top-k 50 top-p 0.95": (0.6, 50, 0.95),
}


def median_ms(fn, reps: int = 50) -> float:
    """Median time of single calls of `fn` (kernels.time_ms, one call per CUDA-event sample)."""
    return time_ms(lambda i: fn(), iters=1, repeats=reps, warmup=5)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--flat", action="store_true", help="logits of std 0.01 (dummy weights) instead of 4")
    scale = 0.01 if p.parse_args().flat else 4.0
    print(f"GPU: {torch.cuda.get_device_name()}; vocab {VOCAB}; fp32 logits of std {scale}")
    print("| batch | sampling | kernel (ms) | torch sort reference (ms) | argmax (ms) | reference / kernel |")
    print("| --- | --- | --- | --- | --- | --- |")
    for rows in (1, 64, 256):
        logits = torch.randn(rows, VOCAB, device="cuda") * scale
        seeds = random_seeds(rows, torch.device("cuda"))
        for name, (t, k, p) in SETTINGS.items():
            args = (  # a filter no row uses is None, as the sampler passes it
                logits,
                torch.full((rows,), t, device="cuda"),
                torch.full((rows,), k, dtype=torch.int32, device="cuda") if k else None,
                torch.full((rows,), p, device="cuda") if p < 1 else None,
                None,
                seeds,
            )
            kernel = median_ms(lambda args=args: sample_tokens(*args))
            reference = median_ms(lambda args=args: sample_tokens_ref(*args), reps=10)
            argmax = median_ms(lambda logits=logits: logits.argmax(dim=-1))
            ratio = reference / kernel
            print(f"| {rows} | {name} | {kernel:.3f} | {reference:.3f} | {argmax:.3f} | {ratio:.1f}x |")


if __name__ == "__main__":
    main()
