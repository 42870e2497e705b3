#!/usr/bin/env python3
"""Kernel benchmarks against the ceilings and baselines measured in the same run.

Prints one table:
  * paged decode attention: KV bytes read per second as a fraction of device copy bandwidth
    (head 128, 32 query heads, 4 kv heads, fp16); target >= 70%;
  * prefill attention: TFLOP/s against torch SDPA restricted to the EFFICIENT_ATTENTION backend
    (fp16, causal, 32 heads, head 128); target >= 1.0x;
  * fused ops against the unfused torch sequence they replace; target >= 2x each.

Decode has one kernel (`wmma`). Every prefill kernel this GPU runs gets its own rows in the one table
(the default is marked), with the baseline measured once in the same run; `vs 1st` is each variant's
relative difference from the output of the case's first variant (the default) on the same inputs (a
sanity check, not a timing).

`ok` compares the unrounded ratio with the target (three decimals are printed, so 0.696 does not
read as 0.70). Times are medians of CUDA-event timings after warm-up; inputs rotate over several
buffers where one input set would fit in L2. Usage: python benches/kernel_bench.py [--json results.json]
[--only attention|decode|prefill|fused] (decode / prefill: those rows alone, the quickest look at one
kernel).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "python"))

from voltllm import ops  # noqa: E402
from voltllm.ops.attention import prefill_variant, prefill_variants, runs_sm80_kernels  # noqa: E402
from voltllm.ops.build import load  # noqa: E402

DEVICE = "cuda"
DECODE_KERNEL = "wmma"  # the one decode kernel (paged_decode_wmma), as the table names it


def time_ms(fn: Callable[[int], object], iters: int = 20, repeats: int = 7, warmup: int = 3) -> float:
    """Median over `repeats` of the mean time of `iters` calls; fn gets the call index (to rotate inputs)."""
    for i in range(warmup):
        fn(i)
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(iters):
            fn(i)
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / iters)
    return statistics.median(samples)


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second."""
    n = 1 << 30  # 1 GiB, far past L2
    src = torch.empty(n, dtype=torch.uint8, device=DEVICE).random_()
    dst = torch.empty_like(src)
    ms = time_ms(lambda i: dst.copy_(src), iters=10)
    return 2 * n / (ms * 1e-3)


def _label(variant: str, default: str) -> str:
    return f"{variant} (default)" if variant == default else variant


def _diff(out: torch.Tensor, base: torch.Tensor) -> float:
    return float((out.double() - base.double()).norm() / base.double().norm())


def decode_case(batch: int, ctx: int, copy_bw: float) -> list[dict]:
    num_heads, num_kv_heads, head = 32, 4, 128
    blocks_per_seq = ctx // 16
    kv_bytes = 2 * batch * ctx * num_kv_heads * head * 2
    # Enough distinct block tables that the rotation reads at least ~1 GB of distinct KV (no L2 reuse).
    sets = max(1, min(8, math.ceil(1e9 / kv_bytes)))
    num_blocks = batch * blocks_per_seq * sets
    kv_cache = torch.randn(2, num_blocks, 16, num_kv_heads, head, device=DEVICE, dtype=torch.float16)
    perm = torch.randperm(num_blocks, device=DEVICE).int()
    tables = [
        perm[s * batch * blocks_per_seq : (s + 1) * batch * blocks_per_seq].view(batch, blocks_per_seq)
        for s in range(sets)
    ]
    query = torch.randn(batch, num_heads, head, device=DEVICE, dtype=torch.float16)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=DEVICE)
    seq_lens_cpu = [ctx] * batch
    out = torch.empty_like(query)
    scale = 1 / math.sqrt(head)

    def run(i: int) -> None:
        ops.paged_decode_attention(query, kv_cache, tables[i % sets], seq_lens, seq_lens_cpu, scale, out=out)

    eager_ms = time_ms(run, iters=8 * sets)
    # Decode steps run as CUDA graphs in the engine; replaying one measures the GPU, not Python.
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for s in range(sets):
            run(s)
    ms = time_ms(lambda i: graph.replay(), iters=8) / sets
    bw = kv_bytes / (ms * 1e-3)
    row = {
        "case": f"decode {batch}x{ctx}",
        "variant": DECODE_KERNEL,
        "ms": ms,
        "eager ms": eager_ms,
        "GB/s": bw / 1e9,
        "ratio": bw / copy_bw,
        "target": 0.70,
    }
    return [row]


def prefill_case(batch: int, seq: int) -> list[dict]:
    num_heads, head = 32, 128
    flops = 4 * batch * num_heads * seq * seq * head / 2  # QK^T and PV, causal half
    q = torch.randn(batch, num_heads, seq, head, device=DEVICE, dtype=torch.float16)
    k = torch.randn_like(q)
    v = torch.randn_like(q)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def sdpa(i: int) -> None:
        with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
            F.scaled_dot_product_attention(q, k, v, is_causal=True)

    base_ms = time_ms(sdpa, iters=5)

    # The same problem through the paged cache (MHA: 32 kv heads), blocks shuffled.
    blocks_per_seq = seq // 16
    num_blocks = batch * blocks_per_seq
    perm = torch.randperm(num_blocks, device=DEVICE).int().view(batch, blocks_per_seq)
    kv_cache = torch.empty(2, num_blocks, 16, num_heads, head, device=DEVICE, dtype=torch.float16)
    token_major = lambda x: x.transpose(1, 2).reshape(batch * seq, num_heads, head).contiguous()  # noqa: E731
    slots = (perm.long()[:, :, None] * 16 + torch.arange(16, device=DEVICE)).view(-1)
    ops.kv_cache_write(token_major(k), token_major(v), kv_cache, slots)
    query = token_major(q).contiguous()
    seq_lens = torch.full((batch,), seq, dtype=torch.int32, device=DEVICE)
    qsl = torch.arange(0, (batch + 1) * seq, seq, dtype=torch.int32, device=DEVICE)
    lens = [seq] * batch
    out = torch.empty_like(query)
    scale = 1 / math.sqrt(head)
    # Same function as SDPA (sanity check of the benchmark itself).
    ref = token_major(F.scaled_dot_product_attention(q, k, v, is_causal=True))
    rows = []
    base_out = None
    device = torch.device(DEVICE)
    for variant in prefill_variants(device):

        def ours(i: int, variant: str = variant) -> None:
            ops.paged_prefill_attention(
                query, kv_cache, perm, seq_lens, qsl, lens, lens, scale, out=out, variant=variant
            )

        ms = time_ms(ours, iters=5)
        result = out.clone()
        base_out = result if base_out is None else base_out
        rows.append(
            {
                "case": f"prefill {batch}x{seq}",
                "variant": _label(variant, prefill_variant(device)),
                "ms": ms,
                "TFLOP/s": flops / (ms * 1e-3) / 1e12,
                "base TFLOP/s": flops / (base_ms * 1e-3) / 1e12,
                "ratio": base_ms / ms,
                "target": 1.0,
                "rel_err": _diff(result, ref),
                "vs 1st": _diff(result, base_out),
            }
        )
    return rows


def _torch_rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


def fused_cases() -> list[dict]:
    tokens, hidden, inter = 4096, 4096, 11008
    h = torch.float16
    rows = []
    sets = 4  # rotate inputs: one set is ~32-180 MB, four sets defeat L2

    xs = [torch.randn(tokens, hidden, device=DEVICE, dtype=h) for _ in range(sets)]
    rs = [torch.randn(tokens, hidden, device=DEVICE, dtype=h) for _ in range(sets)]
    w = torch.randn(hidden, device=DEVICE, dtype=h)

    def unfused_add_norm(i: int) -> None:
        r = xs[i % sets] + rs[i % sets]
        _torch_rms(r, w, 1e-6)

    rows.append(
        _ratio(
            "fused_add_rms_norm",
            unfused_add_norm,
            lambda i: ops.fused_add_rms_norm(xs[i % sets], rs[i % sets], w, 1e-6),
        )
    )
    out = torch.empty_like(xs[0])
    rows.append(
        _ratio(
            "rms_norm",
            lambda i: _torch_rms(xs[i % sets], w, 1e-6),
            lambda i: ops.rms_norm(xs[i % sets], w, 1e-6, out=out),
        )
    )

    gu = [torch.randn(tokens, 2 * inter, device=DEVICE, dtype=h) for _ in range(sets)]
    act = torch.empty(tokens, inter, device=DEVICE, dtype=h)
    rows.append(
        _ratio(
            "silu_and_mul",
            lambda i: F.silu(gu[i % sets][:, :inter]) * gu[i % sets][:, inter:],
            lambda i: ops.silu_and_mul(gu[i % sets], out=act),
        )
    )

    heads, kv_heads, head = 32, 8, 128
    inv_freq = 1.0 / (5e5 ** (torch.arange(0, head, 2, device=DEVICE).float() / head))
    table = ops.cos_sin_cache(inv_freq, 32768, device=DEVICE)
    positions = torch.randint(0, 32768, (tokens,), device=DEVICE)
    qkvs = [torch.randn(tokens, (heads + 2 * kv_heads) * head, device=DEVICE, dtype=h) for _ in range(sets)]

    def unfused_rope(i: int) -> None:
        # The eager sequence a model would run: gather cos/sin, rotate halves of q and k.
        qkv = qkvs[i % sets]
        q = qkv[:, : heads * head].view(tokens, heads, head)
        k = qkv[:, heads * head : (heads + kv_heads) * head].view(tokens, kv_heads, head)
        cs = table[positions]
        cos, sin = cs[:, None, : head // 2], cs[:, None, head // 2 :]
        for x in (q, k):
            x1, x2 = x.float().chunk(2, dim=-1)
            x.copy_(torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1))

    def fused_rope(i: int) -> None:
        qkv = qkvs[i % sets]
        ops.rotary_embedding(
            positions, qkv[:, : heads * head], qkv[:, heads * head : (heads + kv_heads) * head], table, head
        )

    rows.append(_ratio("rotary_embedding", unfused_rope, fused_rope))
    return rows


def _ratio(name: str, baseline: Callable[[int], object], fused: Callable[[int], object]) -> dict:
    base_ms = time_ms(baseline)
    ms = time_ms(fused)
    return {"case": name, "variant": "", "ms": ms, "base ms": base_ms, "ratio": base_ms / ms, "target": 2.0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="also write the rows here")
    groups = ("attention", "decode", "prefill", "fused")
    parser.add_argument("--only", choices=groups, help="run one group of rows")
    args = parser.parse_args()
    load()
    name = torch.cuda.get_device_name()
    copy_bw = copy_bandwidth()
    rows: list[dict] = []
    if args.only in (None, "attention", "decode"):
        for b, c in ((1, 32768), (16, 8192), (64, 4096), (256, 1024)):
            rows += decode_case(b, c, copy_bw)
    if args.only in (None, "attention", "prefill"):
        rows += prefill_case(8, 2048) + prefill_case(1, 16384)
    if args.only in (None, "fused"):
        rows += fused_cases()
    kernels = "wmma = the Volta-legal WMMA kernels (what a V100 runs)"
    if runs_sm80_kernels(torch.device(DEVICE)):
        kernels += "; mma_sm80 = the SM80+ prefill path (mma.sync m16n8k16)"
    else:
        kernels += " (the SM80+ prefill kernel does not run on this GPU)"
    print(
        f"\nGPU: {name}; torch {torch.__version__}; "
        f"device copy bandwidth {copy_bw / 1e9:.0f} GB/s (read+write); {kernels}"
    )
    header = f"{'case':<20}{'variant':<20}{'ms':>9}  {'measure':<34}{'ratio':>8}{'target':>8}"
    print(f"{header}  ok  {'vs 1st':>8}")
    for r in rows:
        if "GB/s" in r:
            measure = f"{r['GB/s']:.0f} GB/s KV (eager {r['eager ms']:.3f} ms)"
        elif "TFLOP/s" in r:
            measure = f"{r['TFLOP/s']:.0f} vs SDPA-eff {r['base TFLOP/s']:.0f} TFLOP/s"
        else:
            measure = f"unfused torch {r['base ms']:.3f} ms"
        ok = "yes" if r["ratio"] >= r["target"] else "NO "
        diff = f"{r['vs 1st']:8.1e}" if "vs 1st" in r else ""
        print(
            f"{r['case']:<20}{r['variant']:<20}{r['ms']:>9.3f}  {measure:<34}{r['ratio']:>8.3f}"
            f"{r['target']:>8.2f}  {ok} {diff}"
        )
    if args.json:
        args.json.write_text(json.dumps({"gpu": name, "copy_GBps": copy_bw / 1e9, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
