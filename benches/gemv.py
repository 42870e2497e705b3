"""Decode-shaped linear layers: the GEMV kernel against torch's GEMM (cuBLAS), as weight bandwidth.

For the linear layers of the Qwen3-0.6B and Llama-3-8B shapes at 1 and 2 input rows, prints the
time of each, the weight bytes read per second as a fraction of the device copy bandwidth measured in
the same run, and the speed-up of the kernel; "gate_up+act" is the gate/up projection with SiLU-and-mul
in the GEMV's epilogue, against torch's GEMM followed by the activation kernel. Calls are timed as
CUDA-graph replays (as the engine runs them: no launch overhead) and weights rotate over enough copies
to exceed the L2 cache, so every call reads from memory as in a real forward pass.

A second table times the pre-norm projections (qkv, gate/up+act) with the residual add + RMSNorm in
front: the fused_add_rms_norm kernel followed by the GEMV, against the GEMV with the add + norm as its
prologue (`add_rms_norm_gemv`), both as graph replays.

    python benches/gemv.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_latency import copy_bandwidth  # noqa: E402
from graph_timing import copies_for, graph_time_us  # noqa: E402

from voltllm.ops import fused_add_rms_norm, silu_and_mul  # noqa: E402
from voltllm.ops.linear import add_rms_norm_gemv, gemv  # noqa: E402

SHAPES = {  # name -> (n, k)
    "qwen3 qkv": (4096, 1024),
    "qwen3 o": (1024, 2048),
    "qwen3 gate_up": (6144, 1024),
    "qwen3 down": (1024, 3072),
    "qwen3 lm_head": (151936, 1024),
    "llama qkv": (6144, 4096),
    "llama o": (4096, 4096),
    "llama gate_up": (28672, 4096),
    "llama down": (4096, 14336),
}


def main() -> None:
    bandwidth = copy_bandwidth()
    print(f"GPU: {torch.cuda.get_device_name()}; copy bandwidth {bandwidth / 1e9:.0f} GB/s")
    print("| layer | rows | cuBLAS (us) | GEMV (us) | GEMV bw / copy bw | speed-up |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, (n, k) in SHAPES.items():
        nbytes = n * k * 2
        copies = copies_for(nbytes)
        weights = [torch.randn(n, k, device="cuda", dtype=torch.float16) * 0.02 for _ in range(copies)]
        swiglu_too = name.endswith("gate_up")
        for rows, swiglu in [(r, s) for r in (1, 2) for s in ((False, True) if swiglu_too else (False,))]:
            x = torch.randn(rows, k, device="cuda", dtype=torch.float16)
            out = torch.empty(rows, n // 2 if swiglu else n, device="cuda", dtype=torch.float16)
            if swiglu:
                torch_us = graph_time_us(lambda i: silu_and_mul(F.linear(x, weights[i])), copies)  # noqa: B023
            else:
                torch_us = graph_time_us(lambda i: F.linear(x, weights[i]), copies)  # noqa: B023
            gemv_us = graph_time_us(lambda i: gemv(x, weights[i], out=out, swiglu=swiglu), copies)  # noqa: B023
            fraction = nbytes / (gemv_us * 1e-6) / bandwidth
            label = name + ("+act" if swiglu else "")
            print(
                f"| {label} | {rows} | {torch_us:.1f} | {gemv_us:.1f} | {fraction:.2f} | "
                f"{torch_us / gemv_us:.2f}x |",
                flush=True,
            )
        weights.clear()
    norm_gemv_table()


def norm_gemv_table() -> None:
    """The residual add + RMSNorm before a projection: its own kernel, or the GEMV's prologue."""
    print("\n| layer | rows | add+norm kernel + GEMV (us) | GEMV with add+norm (us) | saved (us) |")
    print("| --- | --- | --- | --- | --- |")
    for name in ("qwen3 qkv", "qwen3 gate_up", "llama qkv", "llama gate_up"):
        n, k = SHAPES[name]
        nbytes = n * k * 2
        copies = copies_for(nbytes)
        weights = [torch.randn(n, k, device="cuda", dtype=torch.float16) * 0.02 for _ in range(copies)]
        norm_weight = torch.ones(k, device="cuda", dtype=torch.float16)
        swiglu = name.endswith("gate_up")
        for rows in (1, 2):
            hidden = torch.randn(rows, k, device="cuda", dtype=torch.float16)
            residual = torch.randn(rows, k, device="cuda", dtype=torch.float16)
            out = torch.empty(rows, n // 2 if swiglu else n, device="cuda", dtype=torch.float16)

            def unfused(i: int) -> None:
                normed, _ = fused_add_rms_norm(hidden, residual, norm_weight, 1e-6)  # noqa: B023
                gemv(normed, weights[i], out=out, swiglu=swiglu)  # noqa: B023

            def fused(i: int) -> None:
                add_rms_norm_gemv(hidden, residual, norm_weight, 1e-6, weights[i], swiglu=swiglu)  # noqa: B023

            unfused_us, fused_us = graph_time_us(unfused, copies), graph_time_us(fused, copies)
            label = name + ("+act" if swiglu else "")
            print(
                f"| {label} | {rows} | {unfused_us:.1f} | {fused_us:.1f} | {unfused_us - fused_us:.1f} |",
                flush=True,
            )
        weights.clear()


if __name__ == "__main__":
    main()
