"""PNG plots from the harness's JSON (schema in docs/bench.md).

A run gives two figures: ``*-latency-cdf.png`` (empirical CDFs of TTFT, TPOT, ITL and end-to-end
latency, with p50/p99 marked) and ``*-timeline.png`` (output-token throughput, completed requests
and requests in flight, per second of the run). A sweep gives ``*-sweep.png``: the
throughput–latency curve, one point per swept rate or concurrency.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only; never needs a display

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def load(path: Path) -> dict[str, Any]:
    """Reads a result or sweep document, with a clear error for anything else."""
    doc = json.loads(Path(path).read_text())
    if not isinstance(doc, dict) or not ("runs" in doc or "ttfts" in doc):
        raise ValueError("not a voltllm bench result (no 'ttfts' or 'runs' key)")
    return doc


def plot_file(path: Path, out_dir: Path) -> list[Path]:
    """Draws every plot for the document at `path` into `out_dir`; returns the files written."""
    doc = load(path)
    prefix = Path(path).stem
    if "runs" in doc:
        return [plot_sweep(doc, out_dir, prefix)]
    return plot_result(doc, out_dir, prefix)


def _ok(result: dict[str, Any]) -> list[int]:
    """Indices of successful requests (older files without `successes` have no failures listed)."""
    n = len(result["ttfts"])
    successes = result.get("successes") or [not e for e in result.get("errors", [""] * n)]
    return [i for i in range(n) if successes[i]]


def latency_samples(result: dict[str, Any]) -> dict[str, np.ndarray]:
    """Per-metric samples in ms over successful requests (ITL: every chunk gap)."""
    ok = _ok(result)
    out_lens = result["output_lens"]
    tpots = result.get("tpots")
    if tpots is None:  # vLLM files: derive from latency and TTFT like the harness does
        tpots = [
            (result["latencies"][i] - result["ttfts"][i]) / (out_lens[i] - 1) if out_lens[i] > 1 else 0.0
            for i in range(len(out_lens))
        ]
    return {
        "TTFT": np.array([result["ttfts"][i] for i in ok]) * 1000,
        "TPOT": np.array([tpots[i] for i in ok if out_lens[i] > 1]) * 1000,
        "ITL": np.array([g for i in ok for g in result["itls"][i]]) * 1000,
        "E2E latency": np.array([result["latencies"][i] for i in ok]) * 1000,
    }


def timeline(result: dict[str, Any], bucket_s: float = 1.0) -> dict[str, np.ndarray]:
    """Per-bucket series over the run: output tokens/s, completed requests/s, requests in flight.

    A chunk may carry several tokens; each request's output tokens are spread evenly over its chunks.
    Concurrency is the time-average of requests in flight within each bucket.
    """
    ok = _ok(result)
    starts = np.array(result["start_times"], dtype=float)
    lat = np.array(result["latencies"], dtype=float)
    end = float(max((starts[i] + lat[i] for i in ok), default=0.0))
    nb = max(1, int(np.ceil(end / bucket_s)))
    edges = np.arange(nb + 1) * bucket_s
    tokens = np.zeros(nb)
    done = np.zeros(nb)
    for i in ok:
        times = starts[i] + result["ttfts"][i] + np.concatenate([[0.0], np.cumsum(result["itls"][i])])
        per_chunk = result["output_lens"][i] / len(times)
        idx = np.minimum((times / bucket_s).astype(int), nb - 1)
        np.add.at(tokens, idx, per_chunk)
        done[min(int((starts[i] + lat[i]) / bucket_s), nb - 1)] += 1
    inflight = np.zeros(nb)
    for i in ok:  # overlap of [start, end) with each bucket, as a fraction of the bucket
        lo, hi = starts[i], starts[i] + lat[i]
        inflight += np.clip(np.minimum(hi, edges[1:]) - np.maximum(lo, edges[:-1]), 0, None) / bucket_s
    return {
        "edges": edges,
        "output_tokens_per_s": tokens / bucket_s,
        "requests_per_s": done / bucket_s,
        "concurrency": inflight,
    }


def _title(result: dict[str, Any]) -> str:
    rate = result.get("request_rate")
    conc = result.get("max_concurrency")
    return (
        f"{result.get('model_id', '?')} · {result.get('dataset_name', '?')} · rate {rate} · "
        f"max concurrency {conc if conc is not None else '∞'}"
    )


def plot_result(result: dict[str, Any], out_dir: Path, prefix: str) -> list[Path]:
    """Latency CDFs and the throughput/concurrency timeline of one run."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    samples = latency_samples(result)
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    for ax, (name, v) in zip(axes.flat, samples.items(), strict=True):
        ax.set_title(name)
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of samples ≤ x")
        ax.grid(alpha=0.3)
        if v.size == 0:
            ax.text(0.5, 0.5, "no samples", ha="center", va="center", transform=ax.transAxes)
            continue
        xs = np.sort(v)
        # ECDF: 0 just before the smallest sample, k/n from the k-th sample on.
        ax.step(np.r_[xs[0], xs], np.r_[0.0, np.arange(1, xs.size + 1) / xs.size], where="post")
        for p, style in ((50, "--"), (99, ":")):
            q = float(np.percentile(v, p))
            ax.axvline(q, color="gray", linestyle=style, label=f"p{p} = {q:.1f} ms")
        ax.set_ylim(0, 1.02)
        ax.legend(loc="lower right", fontsize=8)
    fig.suptitle(f"Latency CDFs — {_title(result)}", fontsize=10)
    fig.tight_layout()
    cdf_path = out_dir / f"{prefix}-latency-cdf.png"
    fig.savefig(cdf_path, dpi=110)
    plt.close(fig)

    tl = timeline(result)
    fig, axes = plt.subplots(3, 1, figsize=(10, 8), sharex=True)
    series = (
        ("output_tokens_per_s", "output tokens/s", f"mean {result.get('output_throughput', 0):.1f} tok/s"),
        ("requests_per_s", "completed requests/s", f"mean {result.get('request_throughput', 0):.2f} req/s"),
        ("concurrency", "requests in flight", f"peak {result.get('max_concurrent_requests', '?')}"),
    )
    for ax, (key, label, note) in zip(axes, series, strict=True):
        ax.stairs(tl[key], tl["edges"], label=note)
        ax.set_ylabel(label)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(loc="upper right", fontsize=8)
    axes[-1].set_xlabel("seconds since the run started")
    fig.suptitle(f"Throughput and concurrency over time — {_title(result)}", fontsize=10)
    fig.tight_layout()
    tl_path = out_dir / f"{prefix}-timeline.png"
    fig.savefig(tl_path, dpi=110)
    plt.close(fig)
    return [cdf_path, tl_path]


def plot_sweep(sweep: dict[str, Any], out_dir: Path, prefix: str) -> Path:
    """Throughput–latency curve: output throughput on x, TTFT and TPOT (mean and p99) on y."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    runs: Sequence[dict[str, Any]] = sweep["runs"]
    param = sweep.get("sweep_parameter", "")
    x = [r["output_throughput"] for r in runs]
    fig, axes = plt.subplots(1, 2, figsize=(12, 5))
    for ax, metric in zip(axes, ("ttft", "tpot"), strict=True):
        for stat, style in (("mean", "o-"), ("p99", "s--")):
            key = f"{stat}_{metric}_ms"
            if all(key in r for r in runs):
                ax.plot(x, [r[key] for r in runs], style, label=f"{stat} {metric.upper()}")
        for r, xv in zip(runs, x, strict=True):
            y = r.get(f"mean_{metric}_ms")
            if y is not None:
                ax.annotate(str(r.get(param)), (xv, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
        ax.set_xlabel("output throughput (tok/s)")
        ax.set_ylabel(f"{metric.upper()} (ms)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    model = runs[0].get("model_id", "?") if runs else "?"
    fig.suptitle(f"Throughput–latency ({model}; points labelled with {param})", fontsize=10)
    fig.tight_layout()
    path = out_dir / f"{prefix}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
