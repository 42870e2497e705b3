"""Quantized linear kernels (issue 16) against fp16 on the Llama-3-8B projection shapes, one run.

Tables (every ratio from numbers measured in this run):
1. GEMV at 1 row for each packed format: bytes the kernel reads (packed codes + group parameters) per
   second as a fraction of the device copy bandwidth, next to session 9's GEMV shape, the fp16 GEMV and
   cuBLAS; 1b (`shapes`). every built one-row GEMV shape on each projection (AWQ int4), the best per
   layer and the one dispatched;
2. rows 1..8: the GEMV, the weight-streaming GEMM, the tiled WMMA GEMM and cuBLAS fp16 (where the
   dispatch should switch);
3. rows 16, 64 and 128: the W4A16 kernels (AWQ-style int4, group 128, zero points: the weight-streaming
   GEMM as dispatched and at each weight fragment count, the tiled WMMA GEMM, dequantize + cuBLAS)
   against cuBLAS fp16;
4. rows 2048 (prefill): the dequantize + cuBLAS path against cuBLAS fp16, as throughput
   (`mma`: the SM80 register-dequantizing GEMM at 16-128 rows and each row-fragment count, against
   the streaming GEMM and cuBLAS; `sweep`: the streaming GEMM's k split; `row_blocks`: 64 rows at 16,
   32 or 64 rows per block);
5. (`--engine`) end to end, dummy AWQ weights (4-bit, group 128, zero points): Llama-3-8B batch-1
   decode against the fp16 model and against its own floor (bytes a token reads / copy bandwidth), and a
   Qwen3-32B-shape model's weight memory and batch-1 decode.
Calls are timed as CUDA-graph replays over enough weight copies to exceed the L2 cache (as
`benches/gemv.py`), so every call reads its weight from memory.

    python benches/quantization.py [--only gemv,shapes,rows,gemm,mma,sweep,row_blocks,engine] [--formats F]
    # default: gemv, rows, gemm; --engine / --engine-only / --sweep as before add or pick tables;
    # --skip-32b: the engine table without the Qwen3-32B model
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_latency import SHAPES, copy_bandwidth  # noqa: E402
from graph_timing import copies_for, graph_time_us  # noqa: E402
from model_shapes import AWQ_CONFIG  # noqa: E402

from voltllm.layers.quantization.quantized_method import QuantizedLinearMethod  # noqa: E402
from voltllm.layers.quantization.quantized_weight import QuantizedWeight  # noqa: E402
from voltllm.ops import quantized_linear as ql  # noqa: E402
from voltllm.ops.activation import silu_and_mul  # noqa: E402
from voltllm.ops.linear import gemv  # noqa: E402

LLAMA_SHAPES = {  # name -> (out, in), Llama-3-8B (benches/model_shapes.py LLAMA3_8B)
    "qkv": (6144, 4096),
    "o": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
}
FORMATS = {  # name -> (kind, bits, group size or -1 per channel, zero points, act-order)
    "AWQ int4 g128": ("int", 4, 128, True, False),
    "GPTQ int4 g128 act-order": ("int", 4, 128, False, True),
    "int4 g32": ("int", 4, 32, True, False),
    "int8 channel": ("int", 8, -1, False, False),
    "fp8 block 128": ("fp8", 8, 128, False, False),
}
W4A16 = "AWQ int4 g128"


def random_weight(fmt: str, out_features: int, in_features: int) -> QuantizedWeight:
    kind, bits, group, zeros, act_order = FORMATS[fmt]
    group = in_features if group < 0 else group
    groups = in_features // group
    dev = "cuda"
    if kind == "fp8":
        codes = (
            (torch.randn(out_features, in_features, device=dev) * 100)
            .to(torch.float8_e4m3fn)
            .view(torch.uint8)
        )
        scales = torch.full((out_features, groups), 1e-4, device=dev)
    else:
        codes = torch.randint(0, 2**bits, (out_features, in_features), device=dev, dtype=torch.uint8)
        scales = torch.rand(out_features, groups, device=dev).half() * 0.01
    zero_points = torch.randint(0, 2**bits, scales.shape, device=dev, dtype=torch.uint8) if zeros else None
    g_idx = None
    if act_order:
        g_idx = (torch.arange(in_features, device=dev) // group)[
            torch.randperm(in_features, device=dev)
        ].int()
    return QuantizedWeight(codes, scales, zero_points, bits, group, kind, g_idx)


def packed_copies(fmt: str, out_features: int, in_features: int) -> list[ql.PackedQuantWeight]:
    first = ql.pack(random_weight(fmt, out_features, in_features))
    copies = copies_for(first.nbytes)
    return [first] + [
        dataclasses.replace(first, packed=first.packed.clone(), group_params=first.group_params.clone())
        for _ in range(copies - 1)
    ]


def fp16_copies(out_features: int, in_features: int) -> list[torch.Tensor]:
    copies = copies_for(out_features * in_features * 2)
    return [torch.randn(out_features, in_features, device="cuda").half() * 0.02 for _ in range(copies)]


def cublas(x: torch.Tensor, weight: torch.Tensor, swiglu: bool) -> torch.Tensor:
    out = F.linear(x, weight)
    return silu_and_mul(out) if swiglu else out


# The extension's one-row GEMV shape that is session 9's kernel (quant_gemv.cuh QuantGemvOneRowShape<0>,
# `shape` counts from 1): the same-run baseline of table 1.
SESSION9_SHAPE = 1


def gemv_table(bandwidth: float) -> None:
    print("\n### 1. GEMV, 1 row: packed bytes (codes + group parameters) per second / copy bandwidth")
    print(
        "| format | layer | MB read | quantized GEMV (us) | of copy bw | session 9 shape (us) | speed-up | "
        "fp16 GEMV (us) | cuBLAS (us) |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    fp16_us: dict[tuple[str, bool], tuple[float, float]] = {}  # the fp16 columns, timed once per layer
    for name, (n, k) in LLAMA_SHAPES.items():
        dense = fp16_copies(n, k)
        x = torch.randn(1, k, device="cuda").half()
        for swiglu in (False, True) if name == "gate_up" else (False,):
            h_us = graph_time_us(lambda i: gemv(x, dense[i], swiglu=swiglu), len(dense))  # noqa: B023
            c_us = graph_time_us(lambda i: cublas(x, dense[i], swiglu), len(dense))  # noqa: B023
            fp16_us[name, swiglu] = h_us, c_us
    for fmt in selected_formats():
        total_bytes, total_us, total_base = 0, 0.0, 0.0
        for name, (n, k) in LLAMA_SHAPES.items():
            weights = packed_copies(fmt, n, k)
            x = torch.randn(1, k, device="cuda").half()
            variants = [(name, False)] + ([(name + "+act", True)] if name == "gate_up" else [])
            for label, swiglu in variants:
                q_us = graph_time_us(lambda i: ql.quant_gemv(weights[i], x, swiglu=swiglu), len(weights))  # noqa: B023
                b_us = graph_time_us(
                    lambda i: ql.quant_gemv(weights[i], x, swiglu=swiglu, shape=SESSION9_SHAPE),  # noqa: B023
                    len(weights),
                )
                h_us, c_us = fp16_us[name, swiglu]
                nbytes = weights[0].nbytes
                if not swiglu:
                    total_bytes += nbytes
                    total_us, total_base = total_us + q_us, total_base + b_us
                fraction = nbytes / (q_us * 1e-6) / bandwidth
                print(
                    f"| {fmt} | {label} | {nbytes / 1e6:.1f} | {q_us:.1f} | {fraction:.2f} | {b_us:.1f} | "
                    f"{b_us / q_us:.2f}x | {h_us:.1f} | {c_us:.1f} |",
                    flush=True,
                )
        print(f"| {fmt} | **all four** | {total_bytes / 1e6:.1f} | {total_us:.1f} | "
              f"**{total_bytes / (total_us * 1e-6) / bandwidth:.2f}** | {total_base:.1f} | "
              f"{total_base / total_us:.2f}x | | |", flush=True)  # fmt: skip


def _one_row_times(layer: str) -> tuple[int, list[float], float]:
    """(packed bytes, us of each built one-row shape, us of the dispatched one) on one projection."""
    n, k = LLAMA_SHAPES[layer.removesuffix("+act")]
    swiglu = layer.endswith("+act")
    weights = packed_copies(W4A16, n, k)
    x = torch.randn(1, k, device="cuda").half()

    def timed(shape: int) -> float:
        return graph_time_us(lambda i: ql.quant_gemv(weights[i], x, swiglu=swiglu, shape=shape), len(weights))

    return weights[0].nbytes, [timed(s) for s in range(1, ql.GEMV_ONE_ROW_SHAPES + 1)], timed(0)


def gemv_shapes_table(bandwidth: float) -> None:
    """Every built one-row GEMV shape (quant_gemv.cuh QuantGemvOneRowShape<i - 1>) on each projection,
    the best of them per layer, and the one the glue dispatches."""
    print(f"\n### 1b. {W4A16}, 1 row, every built GEMV shape: us per call (fraction of copy bandwidth)")
    layers = [*LLAMA_SHAPES, "gate_up+act"]
    print("| shape | " + " | ".join(layers) + " | all four |")
    print("|" + " --- |" * (len(layers) + 2))
    nbytes, times, dispatched = {}, {}, {}
    for layer in layers:
        nbytes[layer], times[layer], dispatched[layer] = _one_row_times(layer)
        torch.cuda.empty_cache()
    four_bytes = sum(nbytes[layer] for layer in LLAMA_SHAPES)

    def row(label: str, us: dict[str, float]) -> None:
        cells = [f"{us[x]:.1f} ({nbytes[x] / (us[x] * 1e-6) / bandwidth:.2f})" for x in layers]
        total = sum(us[x] for x in LLAMA_SHAPES)
        fraction = four_bytes / (total * 1e-6) / bandwidth
        print(f"| {label} | " + " | ".join(cells) + f" | {total:.1f} (**{fraction:.2f}**) |", flush=True)

    for s in range(ql.GEMV_ONE_ROW_SHAPES):
        row(str(s + 1), {layer: times[layer][s] for layer in layers})
    row("best per layer", {layer: min(times[layer]) for layer in layers})
    row("dispatched", dispatched)


def few_rows_table() -> None:
    print(
        f"\n### 2. {W4A16}, 1-8 rows: GEMV vs streaming GEMM vs tiled WMMA GEMM (block_m 16) vs cuBLAS (us)"
    )
    print("| layer | rows | GEMV | streaming GEMM | tiled WMMA GEMM | cuBLAS fp16 |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name in ("o", "gate_up"):
        n, k = LLAMA_SHAPES[name]
        weights, dense = packed_copies(W4A16, n, k), fp16_copies(n, k)
        for rows in (1, 2, 3, 4, 6, 8):
            x = torch.randn(rows, k, device="cuda").half()
            g_us = graph_time_us(lambda i: ql.quant_gemv(weights[i], x), len(weights))  # noqa: B023
            s_us = graph_time_us(lambda i: ql.quant_gemm_stream(weights[i], x), len(weights))  # noqa: B023
            m_us = graph_time_us(lambda i: ql.quant_gemm(weights[i], x, block_m=16), len(weights))  # noqa: B023
            c_us = graph_time_us(lambda i: F.linear(x, dense[i]), len(dense))  # noqa: B023
            print(f"| {name} | {rows} | {g_us:.1f} | {s_us:.1f} | {m_us:.1f} | {c_us:.1f} |", flush=True)


def gemm_table() -> None:
    print(f"\n### 3-4. {W4A16} GEMM vs cuBLAS fp16 (us; speed-up = cuBLAS time / what the dispatch runs)")
    print("| layer | rows | cuBLAS fp16 | streaming (auto) | streaming n_frags 1 | streaming n_frags 2 | "
          "tiled WMMA | dequant + cuBLAS | dispatch | speed-up |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    nan = float("nan")
    for name, (n, k) in LLAMA_SHAPES.items():
        weights, dense = packed_copies(W4A16, n, k), fp16_copies(n, k)
        for rows in (16, 64, 128, 2048):
            x = torch.randn(rows, k, device="cuda").half()

            def timed(fn, copies: int = len(weights), iters: int = 10 if rows > 128 else 40) -> float:  # noqa: B008
                return graph_time_us(fn, copies, iters)

            streaming = rows <= ql.STREAM_MAX_ROWS
            auto = timed(lambda i: ql.quant_gemm_stream(weights[i], x)) if streaming else nan  # noqa: B023
            by_frags = [
                timed(lambda i: ql.quant_gemm_stream(weights[i], x, n_frags=nf)) if streaming else nan  # noqa: B023
                for nf in (1, 2)
            ]  # fmt: skip
            tiled = timed(lambda i: ql.quant_gemm(weights[i], x)) if rows < ql.DENSE_MIN_ROWS else nan  # noqa: B023
            dense_us = timed(lambda i: ql.quant_dense(weights[i], x))  # noqa: B023
            c_us = timed(lambda i: F.linear(x, dense[i]), len(dense))  # noqa: B023
            # What CudaQuantizedMatmul runs at this many rows.
            chosen, label = (auto, "streaming") if rows < ql.DENSE_MIN_ROWS else (dense_us, "dense")
            times = " | ".join(f"{t:.1f}" for t in (c_us, auto, *by_frags, tiled, dense_us))
            print(f"| {name} | {rows} | {times} | {label} | **{c_us / chosen:.2f}x** |", flush=True)


def mma_table() -> None:
    """The SM80 register-dequantizing GEMM (`quant_gemm_mma`) against the streaming WMMA GEMM and cuBLAS
    fp16 at 16-128 rows, at each row-fragment count per block (k split chosen by the glue)."""
    print(f"\n### 3b. {W4A16}: register-dequantizing mma.sync GEMM, streaming WMMA GEMM, cuBLAS fp16 (us)")
    print("(mma (auto) and its m_frags columns: x through registers; mma (auto) speed-up is that form's)")
    print("| layer | rows | cuBLAS fp16 | streaming (auto) | mma (auto) | mma m_frags 1 | 2 | 3 | 4 | "
          "mma, x by cp.async | mma staged | streaming speed-up | mma speed-up |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    # form -> rows -> the projections' speed-ups over cuBLAS fp16
    ratios: dict[str, dict[int, list[float]]] = {form: {} for form in ql.MMA_FORMS}
    for name, (n, k) in LLAMA_SHAPES.items():
        weights, dense = packed_copies(W4A16, n, k), fp16_copies(n, k)
        for rows in (16, 32, 64, 128):
            x = torch.randn(rows, k, device="cuda").half()
            c_us = graph_time_us(lambda i: F.linear(x, dense[i]), len(dense))  # noqa: B023
            s_us = graph_time_us(lambda i: ql.quant_gemm_stream(weights[i], x), len(weights))  # noqa: B023

            def mma_us(form: str, m_frags: int = 0) -> float:
                call = lambda i: ql.quant_gemm_mma(weights[i], x, m_frags=m_frags, form=form)  # noqa: B023, E731
                return graph_time_us(call, len(weights))  # noqa: B023

            m_us = mma_us("registers")
            by_frags = [mma_us("registers", mf) for mf in (1, 2, 3, 4)]
            a_us, w_us = mma_us("async_x"), mma_us("staged")
            for form, us in (("registers", m_us), ("async_x", a_us), ("staged", w_us)):
                ratios[form].setdefault(rows, []).append(c_us / us)
            times = " | ".join(f"{t:.1f}" for t in (c_us, s_us, m_us, *by_frags, a_us, w_us))
            print(f"| {name} | {rows} | {times} | {c_us / s_us:.2f}x | **{c_us / m_us:.2f}x** |", flush=True)
    for rows, registers in ratios["registers"].items():
        print(f"mma (auto) over cuBLAS fp16 at {rows} rows, geometric mean of the four projections: "
              f"**{statistics.geometric_mean(registers):.2f}x**; x by cp.async "
              f"{statistics.geometric_mean(ratios['async_x'][rows]):.2f}x; staged "
              f"{statistics.geometric_mean(ratios['staged'][rows]):.2f}x", flush=True)  # fmt: skip


def row_fragment_table() -> None:
    """64 rows as 4 row blocks of 16, 2 of 32 or 1 of 64 per block (the weights re-read through L2 by
    the extra row blocks, against fewer k-chunks in flight per warp at more accumulators)."""
    print(f"\n### {W4A16} streaming GEMM, 64 rows by rows per block (us, split chosen by the glue)")
    print("| layer | m_frags 1 | m_frags 2 | m_frags 4 |")
    print("| --- | --- | --- | --- |")
    for name, (n, k) in LLAMA_SHAPES.items():
        weights = packed_copies(W4A16, n, k)
        x = torch.randn(64, k, device="cuda").half()
        times = [
            graph_time_us(lambda i: ql.quant_gemm_stream(weights[i], x, m_frags=mf), len(weights))  # noqa: B023
            for mf in (1, 2, 4)
        ]
        print(f"| {name} | " + " | ".join(f"{t:.1f}" for t in times) + " |", flush=True)


def split_sweep() -> None:
    """The streaming GEMM's k split at 16 and 64 rows against the glue's choice (`auto`)."""
    print(f"\n### Split-k sweep, {W4A16} streaming GEMM (us)")
    splits = (1, 2, 3, 4, 6, 8, 12, 16)
    print("| layer | rows | m_frags / n_frags | auto | " + " | ".join(f"s{s}" for s in splits) + " |")
    print("| --- | --- | --- | --- | " + " | ".join("---" for _ in splits) + " |")
    for name, (n, k) in LLAMA_SHAPES.items():
        weights = packed_copies(W4A16, n, k)
        for rows in (16, 64):
            x = torch.randn(rows, k, device="cuda").half()
            for mf, nf in ((0, 1), (0, 2)) if rows <= 16 else ((0, 1), (0, 2), (2, 1), (2, 2)):
                times = [
                    graph_time_us(
                        lambda i: ql.quant_gemm_stream(weights[i], x, m_frags=mf, n_frags=nf, splits=s),  # noqa: B023
                        len(weights),
                    )
                    for s in (0, *splits)
                ]
                shape = f"{mf or 'auto'} / {nf}"
                print(
                    f"| {name} | {rows} | {shape} | " + " | ".join(f"{t:.1f}" for t in times) + " |",
                    flush=True,
                )


def bytes_per_token(model: torch.nn.Module) -> tuple[int, int]:
    """(bytes the weights take, bytes a batch-1 decode step reads): parameters and buffers, the packed
    quantized weights, and of the input embedding only one row per token."""
    held = read = 0
    for name, p in [*model.named_parameters(), *model.named_buffers()]:
        nbytes = p.numel() * p.element_size()
        held += nbytes
        read += p[0].numel() * p.element_size() if "embed_tokens" in name else nbytes
    for module in model.modules():
        matmul = getattr(module, "quantized_matmul", None)
        packed = getattr(matmul, "weight", None)
        if isinstance(packed, ql.PackedQuantWeight):
            held, read = held + packed.nbytes, read + packed.nbytes
    return held, read


def decode_row(label: str, config: dict, bandwidth: float, device: str = "cuda") -> dict:
    from types import SimpleNamespace

    from decode_latency import decode_steps

    from voltllm.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    from voltllm.engine.llm_engine import LLMEngine

    torch.cuda.empty_cache()
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(config))
        start = time.perf_counter()
        engine = LLMEngine(
            EngineConfig(
                model=ModelConfig(model=tmp, load_format="dummy", dtype="float16", max_model_len=4096),
                cache=CacheConfig(num_kv_blocks=512),
                scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=4096),
                device=device,
            )
        )
        load_s = time.perf_counter() - start
    args = SimpleNamespace(temperature=0.0, top_p=1.0)
    decode_steps(engine, 128, 8, args)  # warm-up
    times, _ = decode_steps(engine, 128, 64, args)
    step = statistics.median(times)
    held, read = bytes_per_token(engine.core.runner.model)
    floor = read / bandwidth
    print(
        f"| {label} | {held / 1e9:.2f} | {load_s:.0f} | {step * 1e3:.2f} | {1 / step:.0f} | "
        f"{floor * 1e3:.2f} | {floor / step:.2f} |",
        flush=True,
    )
    del engine
    torch.cuda.empty_cache()
    return {"tok_s": 1 / step}


def engine_table(bandwidth: float) -> None:
    from model_shapes import LLAMA3_8B, QWEN3_32B

    print("\n### 5. End to end, batch-1 decode (dummy weights, CUDA graphs, 128-token prompt)")
    print("| model | weights (GB) | load (s) | step (ms) | tok/s | floor (ms) | floor / step |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    fp16 = decode_row("Llama-3-8B fp16", LLAMA3_8B, bandwidth)
    # The add + RMSNorm in the GEMVs of o/down, then as kernels of their own (as before session 18).
    default = QuantizedLinearMethod.fold_norm_after
    try:
        QuantizedLinearMethod.fold_norm_after = True
        awq = decode_row("Llama-3-8B AWQ", SHAPES["llama-3-8b-awq"], bandwidth)
        QuantizedLinearMethod.fold_norm_after = False
        apart = decode_row("Llama-3-8B AWQ, norms apart", SHAPES["llama-3-8b-awq"], bandwidth)
    finally:
        QuantizedLinearMethod.fold_norm_after = default
    print(f"AWQ / fp16 tokens/s: **{awq['tok_s'] / fp16['tok_s']:.2f}x**", flush=True)
    print(f"norms folded / apart: {awq['tok_s'] / apart['tok_s']:.3f}x", flush=True)
    if "--skip-32b" not in sys.argv:
        decode_row("Qwen3-32B AWQ", {**QWEN3_32B, "quantization_config": AWQ_CONFIG}, bandwidth)


def _option(name: str) -> str | None:
    """The value after `name` on the command line, or None."""
    return sys.argv[sys.argv.index(name) + 1] if name in sys.argv[:-1] else None


def selected_formats() -> list[str]:
    """FORMATS, or the comma-separated subset `--formats` names."""
    chosen = _option("--formats")
    if chosen is None:
        return list(FORMATS)
    names = [f.strip() for f in chosen.split(",")]
    unknown = [f for f in names if f not in FORMATS]
    if unknown:
        raise SystemExit(f"unknown formats {unknown}; known: {list(FORMATS)}")
    return names


def main() -> None:
    bandwidth = copy_bandwidth()
    gpu = torch.cuda.get_device_name()
    print(f"GPU: {gpu}; torch {torch.__version__}; copy bandwidth {bandwidth / 1e9:.0f} GB/s")
    by_name = {
        "gemv": lambda: gemv_table(bandwidth),
        "shapes": lambda: gemv_shapes_table(bandwidth),
        "rows": few_rows_table,
        "gemm": gemm_table,
        "mma": mma_table,
        "sweep": split_sweep,
        "row_blocks": row_fragment_table,
        "engine": lambda: engine_table(bandwidth),
    }
    names = ["gemv", "rows", "gemm"]
    if "--sweep" in sys.argv:
        names.append("sweep")
    if "--engine" in sys.argv:
        names.append("engine")
    if "--engine-only" in sys.argv:
        names = ["engine"]
    if (only := _option("--only")) is not None:
        names = only.split(",")
        unknown = [n for n in names if n not in by_name]
        if unknown:
            raise SystemExit(f"unknown tables {unknown}; known: {list(by_name)}")
    tables = [by_name[n] for n in names]
    failed = False
    for table in tables:
        try:  # one table's failure is reported, and the others still run
            table()
        except Exception:  # noqa: BLE001
            traceback.print_exc()
            failed = True
    if failed:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
