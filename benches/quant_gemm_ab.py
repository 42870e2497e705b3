"""A/B of the W4A16 GEMMs at 16, 64 and 128 rows on the Llama-3-8B projections (issue 16 item 3: >= 1.5x
cuBLAS fp16 at 16 and 64 rows), one run: cuBLAS fp16, the weight-streaming GEMM (`quant_gemm_stream`,
dispatched today: dequantizes each chunk into shared memory) and the register-dequantizing GEMM
(`quant_gemm_frag`: codes repacked in the probed WMMA fragment order, dequantized straight into
matrix_b registers), each at 1 and 2 weight fragments per warp, and the register-dequantizing GEMM
with its deep ring (3/4 of the streaming GEMM's code bytes in flight per lane; one fragment per warp)
on the structured layouts; from 32 rows also 2 row fragments per block (2 weight fragments per warp).

Every kernel's output is first checked against the torch reference (dequantize, then an fp32 matmul) on
fresh inputs, the layout-free fragment form (layout 0) included; a variant that fails is reported and
left out of the table. Calls are CUDA-graph replays over enough weight copies to exceed L2
(`graph_timing.graph_time_us`: the median of 7 replays, CUDA events), so every call reads its weights
from memory. The last lines give, per row count, the geometric-mean speed-up over cuBLAS of the
streaming GEMM and of the best register-dequantizing variant, and which one to dispatch.

    python benches/quant_gemm_ab.py [--rows 16,64,128] [--layers qkv,o,gate_up,down]
"""

from __future__ import annotations

import dataclasses
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from graph_timing import copies_for, graph_time_us  # noqa: E402
from quantization import LLAMA_SHAPES, W4A16, fp16_copies, random_weight  # noqa: E402

from voltllm.layers.quantization.quantized_weight import QuantizedWeight, dequantize  # noqa: E402
from voltllm.ops import quantized_linear as ql  # noqa: E402

TARGET = 1.5  # issue 16: W4A16 at 16 and 64 rows, this much faster than cuBLAS fp16


def _option(name: str, default: str) -> list[str]:
    value = sys.argv[sys.argv.index(name) + 1] if name in sys.argv[:-1] else default
    return [v.strip() for v in value.split(",")]


def check(label: str, out: torch.Tensor, ref: torch.Tensor) -> bool:
    """Prints and returns whether `out` matches the fp32 reference (fp16 rounding of the output and the
    order of the fp32 sums)."""
    err = float((out.float() - ref).abs().max())
    bound = 4e-3 * float(ref.abs().max()) + 1e-3
    ok = err <= bound and bool(torch.isfinite(out).all())
    if not ok:
        print(f"CHECK FAILED {label}: max error {err:.3g} > {bound:.3g}", flush=True)
    return ok


def fastest(times: dict[str, float], kernel: str) -> float:
    """The shortest time among `kernel`'s variants that passed their check (NaN when none did)."""
    return min((t for v, t in times.items() if v.startswith(kernel) and not math.isnan(t)), default=math.nan)


def frag_copies(
    weight: QuantizedWeight, layout: ql.FragmentLayout, copies: int
) -> list[ql.FragmentPackedWeight]:
    first = ql.pack_fragments(weight, layout)
    return [first] + [
        dataclasses.replace(first, codes=first.codes.clone(), group_params=first.group_params.clone())
        for _ in range(copies - 1)
    ]


def main() -> None:
    rows_list = [int(r) for r in _option("--rows", "16,64,128")]
    layers = _option("--layers", ",".join(LLAMA_SHAPES))
    print(f"GPU: {torch.cuda.get_device_name()}; torch {torch.__version__}")
    layout = ql.fragment_layout(torch.cuda.current_device())
    generic = ql.fragment_layout_from_probe(_probe(), max_layout=0)
    print(
        f"probed matrix_b layout: {layout.elements} elements per lane, layout {layout.layout} "
        f"(REP {layout.rep}, RUN {layout.run}), {layout.tuples.shape[0]} code tuples per fragment"
    )
    print(
        f"\n### {W4A16}: GEMM time (us; CUDA-graph replays, weights from memory), speed-up over cuBLAS fp16"
    )
    variants = ("stream nf1", "stream nf2", "frag nf1", "frag nf2", "frag nf1 deep", "frag nf2 mf2")
    print("| layer | rows | cuBLAS fp16 | " + " | ".join(variants) + " | stream x | best frag x |")
    print("| --- | --- | --- | " + " | ".join("---" for _ in variants) + " | --- | --- |")
    ratios: dict[int, dict[str, list[float]]] = {r: {"stream": [], "frag": []} for r in rows_list}
    for name in layers:
        n, k = LLAMA_SHAPES[name]
        weight = random_weight(W4A16, n, k)
        packed = ql.pack(weight)
        copies = copies_for(packed.nbytes)
        rows_packed = [packed] + [
            dataclasses.replace(
                packed, packed=packed.packed.clone(), group_params=packed.group_params.clone()
            )
            for _ in range(copies - 1)
        ]
        frags = frag_copies(weight, layout, copies)
        generic_packed = ql.pack_fragments(weight, generic)
        dense = fp16_copies(n, k)
        reference_weight = dequantize(weight, torch.float16).float()
        for rows in rows_list:
            x = torch.randn(rows, k, device="cuda").half()
            ref = F.linear(x.float(), reference_weight)
            runs = {
                "stream nf1": lambda i, nf=1: ql.quant_gemm_stream(rows_packed[i], x, n_frags=nf),  # noqa: B023
                "stream nf2": lambda i, nf=2: ql.quant_gemm_stream(rows_packed[i], x, n_frags=nf),  # noqa: B023
                "frag nf1": lambda i, nf=1: ql.quant_gemm_frag(frags[i], x, n_frags=nf),  # noqa: B023
                "frag nf2": lambda i, nf=2: ql.quant_gemm_frag(frags[i], x, n_frags=nf),  # noqa: B023
            }
            if rows >= 32:  # two row blocks of 32: half the x fragments per weight, the weights read twice
                runs["frag nf2 mf2"] = lambda i: ql.quant_gemm_frag(frags[i], x, m_frags=2, n_frags=2)  # noqa: B023
            if layout.layout > 0:
                runs["frag nf1 deep"] = lambda i: ql.quant_gemm_frag(frags[i], x, n_frags=1, deep=True)  # noqa: B023
            good = {label: check(f"{name} {rows} {label}", fn(0), ref) for label, fn in runs.items()}
            check(f"{name} {rows} frag layout 0", ql.quant_gemm_frag(generic_packed, x), ref)
            cublas = graph_time_us(lambda i: F.linear(x, dense[i]), len(dense))  # noqa: B023
            times = {v: math.nan for v in variants}
            times.update({label: graph_time_us(fn, copies) for label, fn in runs.items() if good[label]})
            stream, frag = fastest(times, "stream"), fastest(times, "frag")
            ratios[rows]["stream"].append(cublas / stream)
            ratios[rows]["frag"].append(cublas / frag)
            cells = " | ".join(f"{times[v]:.1f}" for v in variants)
            speedups = f"{cublas / stream:.2f}x | **{cublas / frag:.2f}x**"
            print(f"| {name} | {rows} | {cublas:.1f} | {cells} | {speedups} |", flush=True)
    print(f"\ngeometric mean speed-up over cuBLAS fp16 (target {TARGET}x at 16 and 64 rows):")
    for rows, by in ratios.items():
        stream, frag = (geomean(v) for v in (by["stream"], by["frag"]))
        winner = "frag" if frag > stream else "stream"  # NaN (a failed check) never wins
        met = "met" if min(by[winner]) >= TARGET else "NOT met"
        verdict = f"dispatch {winner} (target on every layer: {met})"
        print(f"rows {rows}: stream {stream:.2f}x, frag {frag:.2f}x -> {verdict}")


def geomean(values: list[float]) -> float:
    """Geometric mean (NaN when any value is: a kernel that failed its check on some layer)."""
    if not values or any(math.isnan(v) for v in values):
        return math.nan
    return math.exp(sum(map(math.log, values)) / len(values))


def _probe() -> torch.Tensor:
    probe = torch.empty(32, 16, dtype=torch.int32, device="cuda")
    ql.kernel_ops().quant_wmma_b_layout(probe)
    return probe


if __name__ == "__main__":
    main()
