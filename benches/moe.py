"""Mixture-of-experts speed on the Qwen3-30B-A3B shape (fp16, dummy weights): issue 17's three figures,
each ratio measured in this run.

1. Batch-1 decode against its byte floor: the bytes one token touches (every attention, norm and
   router weight, the top-k experts of each layer, one embedding row, the LM head) over the device copy
   bandwidth measured here. Steps are timed on the host as in `decode_latency.py` (CUDA graphs on).
2. A decode step at batch 64 against the same step whose experts run as a per-expert torch loop over
   the same weights (transformers' formulation: one GEMM pair per expert that got tokens), swapped in
   through the FusedMoE weight-method seam; the loop syncs with the host, so that engine runs eager.
3. Offline throughput on nano-vllm's workload (256 sequences, prompt and output lengths uniform in
   100-1024, greedy, ignore_eos) against transformers' `generate_batch` on the same shapes. With
   `--baseline-layers N` both engines also run the workload on the model cut to its first N layers and
   the ratio is taken there, like for like (transformers' expert loop takes many minutes at 48 layers);
   voltllm's full-depth throughput is printed beside it.
4. `kernels`: one MoE layer's experts (routing included) at 1 to 8,192 tokens by the pair path (up to
   16 tokens), the decode GEMV, the grouped GEMM and the torch grouped form, with the bandwidth of the
   expert bytes the tokens touch.
5. `quant`: one layer's experts quantized (4-bit, groups of 128 with zero points, as AWQ/GPTQ write
   them) at 1 to 1,024 tokens: the quantized pair path and the stacks dequantized for the fp16 kernels,
   against the fp16 pair path on the same shape, with the bandwidth of the packed bytes the tokens
   touch.
6. `decode-ab`: the pair path's token limit (8 or 16) at batch 16 in one engine, its CUDA graphs
   recaptured per variant, in alternating rounds.
7. `profile`: where a batch-1 decode step goes. Whether it replayed a CUDA graph, the host's share
   (the runner's step timings), the graph replay's device time by CUDA events, and the per-kernel
   device time of replays (torch profiler): the gap between the two is the device idling between
   kernels.
8. `pair-down`: the pair path's down-stage kernels side by side (`moe_pair_down_kernel`, chunks 0, and
   the staged kernel at 12 loads per lane in flight, the default up to 16 tokens), one layer from a CUDA
   graph, the down stage by difference, at 1 to 64 tokens.
9. `down-ab`: those two in the model, one engine, graphs recaptured per variant, alternating rounds, at
   batch 1 (against the floor) and 8.

    python benches/moe.py                         # H200: all of them (the baseline of 3 takes minutes)
    python benches/moe.py --only decode step      # skip the offline comparison
    python benches/moe.py --only offline --baseline-layers 2
    python benches/moe.py --only profile          # batch-1 step: graph?, host, kernels
    python benches/moe.py --only quant decode-ab  # quantized experts; the decode step's variants
    python benches/moe.py --only pair-down down-ab  # the down-stage kernels: one layer, then the model
    python benches/moe.py --tiny --device cpu --num-seqs 8 --min-len 16 --max-len 64   # smoke test

`--json PATH` writes the rows. The targets: >= 0.6 of the floor, >= 5x the loop, >= 10x transformers.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from model_shapes import AWQ_CONFIG, QWEN3_30B_A3B, TINY_QWEN3_MOE  # noqa: E402
from offline_throughput import make_workload, time_offline_run  # noqa: E402

from voltllm.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig  # noqa: E402
from voltllm.engine.core import resolve_device  # noqa: E402
from voltllm.engine.llm_engine import LLMEngine  # noqa: E402
from voltllm.layers.activation import silu_and_mul  # noqa: E402
from voltllm.layers.embedding import VocabParallelEmbedding  # noqa: E402
from voltllm.layers.fused_moe import FusedMoE, UnquantizedFusedMoEMethod, select_experts  # noqa: E402
from voltllm.layers.fused_moe.experts_torch import experts_grouped  # noqa: E402
from voltllm.layers.quantization.quantized_weight import QuantizedWeight  # noqa: E402
from voltllm.ops._dispatch import kernel_ops  # noqa: E402
from voltllm.ops.moe import (  # noqa: E402
    PAIR_DOWN_STAGED_CHUNKS,
    fused_moe,
    fused_moe_pairs,
    topk_softmax,
)
from voltllm.ops.moe_quantized import (  # noqa: E402
    PATHS,
    PackedQuantExperts,
    fused_moe_quantized,
    pack_experts,
    quantized_path,
)
from voltllm.ops.quantized_linear import PackedQuantWeight  # noqa: E402
from voltllm.protocol import EngineCoreRequest, EngineSamplingParams  # noqa: E402
from voltllm.worker.cuda_graphs import DecodeGraphs  # noqa: E402


class PerExpertLoopMethod(UnquantizedFusedMoEMethod):
    """The baseline of figure 2: transformers' expert loop over the same stacked weights."""

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        weights, ids = select_experts(router_logits, layer.top_k, layer.renormalize)
        out = torch.zeros_like(x)
        mask = F.one_hot(ids, layer.num_experts).permute(2, 1, 0)  # [E, k, T]
        for expert in torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero():
            slot, token = torch.where(mask[expert[0]])
            h = F.linear(
                silu_and_mul(F.linear(x[token], layer.w13_weight[expert[0]])), layer.w2_weight[expert[0]]
            )
            out.index_add_(0, token, (h * weights[token, slot, None]).to(x.dtype))
        return out


def sync(device: str) -> None:
    if resolve_device(device).type == "cuda":
        torch.cuda.synchronize()


def copy_bandwidth(device: str) -> float:
    """A 1 GiB device copy (256 MiB on the CPU): bytes read + written per second, median of 10."""
    src = torch.empty(1 << (30 if device == "cuda" else 28), dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    times = []
    for _ in range(12):
        sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        sync(device)
        times.append(time.perf_counter() - start)
    return 2 * src.numel() / statistics.median(times[2:])


def touched_bytes(model: torch.nn.Module) -> int:
    """Weight bytes one decode token reads: all of it except the experts it is not routed to (top_k of
    num_experts of each FusedMoE) and the embedding rows of other tokens (one row; a tied table is read
    whole by the LM head). Quantized weights count in their packed form (codes and group words)."""
    total, seen = 0, set()
    for module in model.modules():
        for param in module.parameters(recurse=False):
            if id(param) in seen:
                continue
            seen.add(id(param))
            size = param.numel() * param.element_size()
            if isinstance(module, FusedMoE):
                size = size * module.top_k // module.num_experts
            elif isinstance(module, VocabParallelEmbedding) and not getattr(
                model, "tie_word_embeddings", False
            ):
                size //= param.shape[0]
            total += size
        packed = getattr(getattr(module, "quantized_matmul", None), "weight", None)
        if isinstance(packed, PackedQuantWeight):
            total += packed.nbytes
        for stack in (getattr(module, "w13_packed", None), getattr(module, "w2_packed", None)):
            if stack is not None:
                total += stack.nbytes_per_expert * module.top_k
    return total


def build_engine(model_dir: Path, args: argparse.Namespace, max_num_seqs: int, eager: bool) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=ModelConfig(
                model=str(model_dir), load_format="dummy", dtype=args.dtype, max_model_len=4096
            ),
            cache=CacheConfig(num_kv_blocks=args.num_kv_blocks),
            scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=8192),
            device=args.device,
            enforce_eager=eager,
        )
    )


def decode_step_times(engine: LLMEngine, batch: int, prompt_len: int, tokens: int) -> list[float]:
    """Wall times of the steps in which all `batch` requests decode (prefill steps left out)."""
    params = EngineSamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    for i in range(batch):
        prompt = [(7 * i + j) % 1000 + 10 for j in range(prompt_len)]
        engine.add_request(EngineCoreRequest(f"r{i}", prompt, params, 0.0))
    times = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    # The prompts fit one step's budget (64 x 128 = 8192 tokens): one prefill step samples every
    # request's first token, the last `tokens - 1` steps decode all of them.
    return times[-(tokens - 1) :]


def release_gpu_memory() -> None:
    """Give the memory of engines the caller has dropped (`del engine` first) back to the device, so the
    next engine's KV-cache sizing sees it free."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def bench_decode(model_dir: Path, args: argparse.Namespace, bandwidth: float) -> dict:
    engine = build_engine(model_dir, args, max_num_seqs=8, eager=args.enforce_eager)
    decode_step_times(engine, 1, 128, 8)  # warm-up
    step = statistics.median(decode_step_times(engine, 1, 128, args.tokens))
    floor = touched_bytes(engine.core.runner.model) / bandwidth
    del engine
    release_gpu_memory()
    return {"figure": "batch-1 decode", "step_ms": step * 1e3, "floor_ms": floor * 1e3, "ratio": floor / step}


def bench_step(model_dir: Path, args: argparse.Namespace) -> dict:
    steps = {}
    for name, eager, loop in (("voltllm", args.enforce_eager, False), ("per-expert loop", True, True)):
        engine = build_engine(model_dir, args, max_num_seqs=64, eager=eager)
        if loop:
            for module in engine.core.runner.model.modules():
                if isinstance(module, FusedMoE):
                    module.moe_method = PerExpertLoopMethod()
        decode_step_times(engine, 64, 128, 4)  # warm-up
        steps[name] = statistics.median(decode_step_times(engine, 64, 128, args.tokens // 4 + 2))
        del engine
        release_gpu_memory()
    ours, loop = steps["voltllm"], steps["per-expert loop"]
    return {
        "figure": "batch-64 decode step",
        "step_ms": ours * 1e3,
        "loop_ms": loop * 1e3,
        "ratio": loop / ours,
    }


def replay_device_us(runner, size: int, replays: int = 20) -> float:
    """Median device time of one replay of the decode graph of bucket `size`, by CUDA events (the
    buffers hold the last step's inputs: a replay rewrites the same KV slots)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(replays):
        start.record()
        runner.graphs.replay(size)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def replay_kernel_table(runner, size: int, replays: int = 5) -> tuple[dict[str, list[float]], float]:
    """Per-kernel `[calls, device us]` of one replay (torch profiler), and the kernels' total per replay."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            runner.graphs.replay(size)
        torch.cuda.synchronize()
    table: dict[str, list[float]] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            entry = table.setdefault(event.name[:100], [0.0, 0.0])
            entry[0] += 1 / replays
            entry[1] += event.device_time / replays
    return table, sum(us for _, us in table.values())


def bench_profile(model_dir: Path, args: argparse.Namespace) -> dict:
    """Where a batch-1 decode step's time goes (see the module docstring, figure 5)."""
    engine = build_engine(model_dir, args, max_num_seqs=8, eager=args.enforce_eager)
    runner = engine.core.runner
    decode_step_times(engine, 1, 128, 8)  # warm-up
    params = EngineSamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    engine.add_request(EngineCoreRequest("p", list(range(10, 138)), params, 0.0))
    engine.step()  # the prefill
    walls, timings = [], []
    for _ in range(32):
        start = time.perf_counter()
        engine.step()
        walls.append(time.perf_counter() - start)
        timings.append(runner.last_timings)
    row = {
        "figure": "batch-1 profile",
        "graph_steps": sum(t.cuda_graph for t in timings),
        "steps": len(timings),
        "wall_us": statistics.median(walls) * 1e6,
    }
    for part in ("prepare_s", "forward_s", "sync_s", "post_s"):
        row[part.replace("_s", "_us")] = statistics.median(getattr(t, part) for t in timings) * 1e6
    if runner.graphs is not None and row["graph_steps"]:
        size = runner.graphs.bucket_for(1)
        row["replay_us"] = replay_device_us(runner, size)
        table, row["kernels_us"] = replay_kernel_table(runner, size)
        row["kernel_calls"] = sum(calls for calls, _ in table.values())
        row["kernels"] = sorted(table.items(), key=lambda kv: -kv[1][1])
    while engine.has_unfinished_requests():
        engine.step()
    del engine, runner
    release_gpu_memory()
    return row


def print_profile(r: dict) -> None:
    print(
        f"batch-1 profile: {r['graph_steps']}/{r['steps']} steps replayed a CUDA graph; step wall "
        f"{r['wall_us']:.0f} us = prepare {r['prepare_us']:.0f} + forward {r['forward_us']:.0f} + sync "
        f"{r['sync_us']:.0f} + post {r['post_us']:.0f} (medians)",
        flush=True,
    )
    if "replay_us" not in r:
        return
    gaps = r["replay_us"] - r["kernels_us"]
    print(
        f"graph replay {r['replay_us']:.0f} us on the device (events); its {r['kernel_calls']:.0f} kernels "
        f"{r['kernels_us']:.0f} us; idle between kernels {gaps:.0f} us",
        flush=True,
    )
    for name, (calls, us) in r["kernels"][:20]:
        print(f"{us:9.1f} us {calls:5.0f}x {us / calls:7.1f} us each  {name}", flush=True)


def offline_tok_s(model_dir: Path, args: argparse.Namespace, prompts, output_lens) -> tuple[float, int]:
    engine = build_engine(model_dir, args, max_num_seqs=args.num_seqs, eager=args.enforce_eager)
    t, n = time_offline_run(engine, prompts, output_lens, args.device)
    del engine
    release_gpu_memory()
    return n / t, n


def bench_offline(model_dir: Path, config: dict, args: argparse.Namespace) -> dict:
    prompts, output_lens = make_workload(args, config["vocab_size"])
    layers = args.baseline_layers or config["num_hidden_layers"]
    row: dict = {"figure": "offline throughput"}
    if not (args.cut_only and layers != config["num_hidden_layers"]):
        ours, n = offline_tok_s(model_dir, args, prompts, output_lens)
        row.update(voltllm_tok_s=ours, tokens=n)
    if args.skip_baseline:
        return row
    if layers != config["num_hidden_layers"]:  # like for like: both engines on the cut model
        model_dir = model_dir / f"layers{layers}"
        model_dir.mkdir()
        (model_dir / "config.json").write_text(json.dumps({**config, "num_hidden_layers": layers}))
        ours, n = offline_tok_s(model_dir, args, prompts, output_lens)
        row.update(voltllm_cut_tok_s=ours, tokens=n)
        print(f"offline: first {layers} layers: voltllm {ours:.1f} tok/s ({n} tokens)", flush=True)
    base = transformers_generate_batch(model_dir, args, prompts, output_lens)
    row.update(baseline_layers=layers, transformers_tok_s=base, ratio=ours / base)
    return row


PAIRS_TIMED_UP_TO = 16  # the pair-by-pair path reads a shared expert once per token: timed up to here


def graph_time(fn, iters: int = 20) -> float:
    """Seconds per call of `fn`, replayed from a CUDA graph of `iters` calls (no launch overhead)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(5):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / iters)
    return statistics.median(times)


def eager_time(fn, iters: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters


def kernel_row(
    x: torch.Tensor, logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int
) -> dict:
    """Times of one layer's experts on `x` by each path, with the expert bytes the tokens touch."""
    weights, ids = topk_softmax(logits, top_k, True)
    expert_bytes = (w13[0].numel() + w2[0].numel()) * w13.element_size()
    touched = int(torch.unique(ids).numel())
    row = {"figure": "kernels", "tokens": x.shape[0], "experts_touched": touched}
    for name, grouped in (("gemv", False), ("grouped_gemm", True)):
        if not grouped and x.shape[0] > 1024:
            continue  # tiles of 8: past this every expert is re-read many times

        def layer(grouped_gemm: bool = grouped) -> torch.Tensor:
            return fused_moe(x, w13, w2, *topk_softmax(logits, top_k, True), grouped_gemm)

        seconds = graph_time(layer, iters=20 if x.shape[0] <= 256 else 3)
        row[f"{name}_us"] = seconds * 1e6
        row[f"{name}_gb_s"] = touched * expert_bytes / seconds / 1e9
    if x.shape[0] <= PAIRS_TIMED_UP_TO:

        def layer_pairs() -> torch.Tensor:
            weights, ids = topk_softmax(logits, top_k, True)
            return fused_moe_pairs(x, w13, w2, weights, ids)

        seconds = graph_time(layer_pairs)
        row["pairs_us"] = seconds * 1e6
        row["pairs_gb_s"] = touched * expert_bytes / seconds / 1e9
        row.update(pair_stage_split(x, logits, w13, w2, top_k, touched))
    row["torch_grouped_us"] = 1e6 * eager_time(lambda: experts_grouped(x, w13, w2, weights, ids.long()))
    return row


def pair_stage_split(
    x, logits, w13, w2, top_k: int, touched: int, down_variants: tuple[int | None, ...] = (None,)
) -> dict:
    """Where the pair path's time goes: the routing alone, routing + gated stage, and by difference each
    stage, with the bandwidth of the expert bytes each stage reads (graph replays, as `kernel_row`). The
    down stage is timed for each of `down_variants` (`fused_moe_pairs`' down_chunks; None: the default),
    keyed `down_us` / `down_gb_s` for None, `down<chunks>_us` / `down<chunks>_gb_s` otherwise."""
    ops = kernel_ops()
    act = torch.empty(x.shape[0] * top_k, w13.shape[1] // 2, dtype=x.dtype, device=x.device)

    def routing() -> torch.Tensor:
        return topk_softmax(logits, top_k, True)[1]

    def routing_gated() -> torch.Tensor:
        weights, ids = topk_softmax(logits, top_k, True)
        ops.moe_pair_experts(act, x, w13, ids, weights, True)
        return act

    route_s, gated_s = graph_time(routing), graph_time(routing_gated)
    gated_bytes = touched * w13[0].numel() * w13.element_size()
    down_bytes = touched * w2[0].numel() * w2.element_size()
    row = {
        "routing_us": route_s * 1e6,
        "gated_us": (gated_s - route_s) * 1e6,
        "gated_gb_s": gated_bytes / (gated_s - route_s) / 1e9,
    }
    for chunks in down_variants:

        def layer(chunks: int | None = chunks) -> torch.Tensor:
            return fused_moe_pairs(x, w13, w2, *topk_softmax(logits, top_k, True), chunks)

        layer_s = graph_time(layer)
        key = "down" if chunks is None else f"down{chunks}"
        down_s = layer_s - gated_s
        row.update({f"{key}_us": down_s * 1e6, f"{key}_gb_s": down_bytes / down_s / 1e9})
        if chunks is not None:
            row[f"layer{chunks}_us"] = layer_s * 1e6
    return row


def random_expert_stacks(config: dict, seed: int) -> tuple[torch.Generator, torch.Tensor, torch.Tensor]:
    """A CUDA generator seeded with `seed` and one layer's fp16 expert stacks drawn from it (`w13 [E, 2I,
    H]`, `w2 [E, H, I]`, scaled as trained weights are); the generator goes on to draw the inputs."""
    experts, hidden, inter = config["num_experts"], config["hidden_size"], config["moe_intermediate_size"]
    gen = torch.Generator(device="cuda").manual_seed(seed)
    w13 = (torch.randn(experts, 2 * inter, hidden, device="cuda", generator=gen) * 0.02).half()
    w2 = (torch.randn(experts, hidden, inter, device="cuda", generator=gen) * 0.02).half()
    return gen, w13, w2


DOWN_VARIANTS = (0, *PAIR_DOWN_STAGED_CHUNKS)  # the pair path's down-stage kernels (voltllm.ops.moe)


@torch.inference_mode()
def bench_pair_down(config: dict, args: argparse.Namespace) -> list[dict]:
    """The pair path's down-stage kernels side by side on the model's expert shape: one layer (routing,
    gated stage, down stage) from a CUDA graph, the down stage by difference, and the whole layer, for
    each of DOWN_VARIANTS at each of `--pair-down-tokens` (fresh routings per size; past PAIRS_MAX_TOKENS
    the pair path is not the one dispatched, shown for the trend)."""
    experts, top_k, hidden = config["num_experts"], config["num_experts_per_tok"], config["hidden_size"]
    gen, w13, w2 = random_expert_stacks(config, args.seed)
    rows = []
    print(
        "pair path, one layer from a graph: down stage us by difference (TB/s of its bytes, speed-up over "
        "chunks 0) | whole layer us per variant",
        flush=True,
    )
    for tokens in args.pair_down_tokens:
        x = torch.randn(tokens, hidden, device="cuda", generator=gen).half()
        logits = torch.randn(tokens, experts, device="cuda", generator=gen).half()
        touched = int(torch.unique(topk_softmax(logits, top_k, True)[1]).numel())
        row = {"figure": "pair down", "tokens": tokens, "experts_touched": touched}
        row.update(pair_stage_split(x, logits, w13, w2, top_k, touched, DOWN_VARIANTS))
        rows.append(row)
        downs = " ".join(
            f"{c}: {row[f'down{c}_us']:5.1f} ({row[f'down{c}_gb_s'] / 1e3:4.2f}, "
            f"{row['down0_us'] / row[f'down{c}_us']:4.2f}x)"
            for c in DOWN_VARIANTS
        )
        layers = " ".join(f"{c}: {row[f'layer{c}_us']:5.1f}" for c in DOWN_VARIANTS)
        print(f"{tokens:>4} tokens, {touched:>3} experts | down {downs} | layer {layers}", flush=True)
    return rows


@torch.inference_mode()
def bench_kernels(config: dict, args: argparse.Namespace) -> list[dict]:
    """One layer's experts on the model's expert shape (random weights, fresh routings per size)."""
    experts, top_k, hidden = config["num_experts"], config["num_experts_per_tok"], config["hidden_size"]
    gen, w13, w2 = random_expert_stacks(config, args.seed)
    rows = []
    for tokens in args.kernel_tokens:
        x = torch.randn(tokens, hidden, device="cuda", generator=gen).half()
        logits = torch.randn(tokens, experts, device="cuda", generator=gen).half()
        rows.append(row := kernel_row(x, logits, w13, w2, top_k))
        print(
            f"kernels: {tokens:>5} tokens, {row['experts_touched']:>3} experts: "
            + ", ".join(f"{k} {v:.1f}" for k, v in row.items() if k.endswith(("_us", "_gb_s"))),
            flush=True,
        )
    return rows


def random_int4_experts(num_experts: int, rows: int, k: int, gen: torch.Generator) -> PackedQuantExperts:
    """`num_experts` random 4-bit `[rows, k]` expert matrices, groups of 128 with zero points (AWQ/GPTQ's
    layout), packed for the kernels; dequantized weights within about +-0.02."""
    weights = []
    for _ in range(num_experts):
        groups = k // 128
        weights.append(
            QuantizedWeight(
                codes=torch.randint(0, 16, (rows, k), device="cuda", generator=gen, dtype=torch.uint8),
                scales=(torch.rand(rows, groups, device="cuda", generator=gen) * 0.0013 + 0.0013).half(),
                zeros=torch.randint(7, 9, (rows, groups), device="cuda", generator=gen, dtype=torch.uint8),
                bits=4,
                group_size=128,
            )
        )
    return pack_experts(weights)


def quant_kernel_row(x, logits, w13, w2, w13_dense, w2_dense, top_k: int) -> dict:
    """One layer's quantized experts on `x` by each path, with the packed bytes the tokens touch, and the
    fp16 pair path on the same shape."""
    ids = topk_softmax(logits, top_k, True)[1]
    touched = int(torch.unique(ids).numel())
    packed_bytes = touched * (w13.nbytes_per_expert + w2.nbytes_per_expert)
    tokens = x.shape[0]
    row = {"figure": "quant kernels", "tokens": tokens, "experts_touched": touched}
    paths = [p for p in PATHS if p != "pairs" or tokens <= 256]
    for path in paths:

        def layer(path: str = path) -> torch.Tensor:
            return fused_moe_quantized(x, w13, w2, *topk_softmax(logits, top_k, True), path=path)

        seconds = graph_time(layer, iters=20 if tokens <= 16 else 3)
        row[f"{path}_us"] = seconds * 1e6
        row[f"{path}_gb_s"] = packed_bytes / seconds / 1e9
    if tokens <= PAIRS_TIMED_UP_TO:

        def fp16_pairs() -> torch.Tensor:
            return fused_moe_pairs(x, w13_dense, w2_dense, *topk_softmax(logits, top_k, True))

        row["fp16_pairs_us"] = graph_time(fp16_pairs) * 1e6
    row["chosen"] = quantized_path(tokens)
    return row


@torch.inference_mode()
def bench_quant_kernels(config: dict, args: argparse.Namespace) -> list[dict]:
    """One layer's int4 experts on the model's expert shape (random codes, fresh routings per size)."""
    experts, top_k = config["num_experts"], config["num_experts_per_tok"]
    hidden, inter = config["hidden_size"], config["moe_intermediate_size"]
    gen = torch.Generator(device="cuda").manual_seed(args.seed)
    w13 = random_int4_experts(experts, 2 * inter, hidden, gen)
    w2 = random_int4_experts(experts, hidden, inter, gen)
    w13_dense = (torch.randn(experts, 2 * inter, hidden, device="cuda", generator=gen) * 0.02).half()
    w2_dense = (torch.randn(experts, hidden, inter, device="cuda", generator=gen) * 0.02).half()
    rows = []
    for tokens in args.quant_tokens:
        x = torch.randn(tokens, hidden, device="cuda", generator=gen).half()
        logits = torch.randn(tokens, experts, device="cuda", generator=gen).half()
        rows.append(row := quant_kernel_row(x, logits, w13, w2, w13_dense, w2_dense, top_k))
        print(
            f"quant kernels (int4 g128): {tokens:>5} tokens, {row['experts_touched']:>3} experts: "
            + ", ".join(f"{k} {v:.1f}" for k, v in row.items() if k.endswith(("_us", "_gb_s")))
            + f" (dispatched: {row['chosen']})",
            flush=True,
        )
    return rows


def recapture_graphs(runner, sizes: list[int]) -> None:
    """Drop the runner's decode graphs and capture `sizes` again (the model code as it is now)."""
    runner.graphs = None
    gc.collect()
    torch.cuda.empty_cache()
    runner.capture_cuda_graphs(DecodeGraphs(runner.model, sizes, runner.vocab_size, runner.device))


def bench_decode_ab(model_dir: Path, args: argparse.Namespace) -> list[dict]:
    """The pair path's token limit A/B'd at batch 16 in one engine (graphs recaptured for each, rounds
    alternating): A is the code as it stands (PAIRS_MAX_TOKENS), B the other of 8 and 16."""
    import voltllm.ops.moe as moe_ops

    engine = build_engine(model_dir, args, max_num_seqs=16, eager=False)
    runner = engine.core.runner
    shipped_limit = moe_ops.PAIRS_MAX_TOKENS
    other_limit = 8 if shipped_limit != 8 else 16
    decode_step_times(engine, 16, 128, 4)  # warm-up
    times: dict[str, list[float]] = {"A": [], "B": []}
    for name in ("A", "B", "B", "A"):
        moe_ops.PAIRS_MAX_TOKENS = other_limit if name == "B" else shipped_limit
        recapture_graphs(runner, [16])
        times[name] += decode_step_times(engine, 16, 128, args.tokens // 4)
    moe_ops.PAIRS_MAX_TOKENS = shipped_limit
    del engine, runner
    release_gpu_memory()
    a, b = (statistics.median(times[n]) for n in ("A", "B"))
    return [
        {
            "figure": "decode A/B",
            "batch": 16,
            "a_ms": a * 1e3,
            "b_ms": b * 1e3,
            "b_over_a": b / a,
            "pairs_limit_a": shipped_limit,
            "pairs_limit_b": other_limit,
        }
    ]


def bench_down_ab(model_dir: Path, args: argparse.Namespace, bandwidth: float) -> list[dict]:
    """The decode step's pair-path down-stage kernels (DOWN_VARIANTS, set as PAIR_DOWN_CHUNKS) A/B'd in
    one engine at each of `--ab-batches`: the decode graph recaptured for each variant, rounds in the
    order A B B A, step medians per variant; at batch 1 each against the byte floor
    (`touched_bytes` over the copy bandwidth measured in this run)."""
    import voltllm.ops.moe as moe_ops

    engine = build_engine(model_dir, args, max_num_seqs=max(args.ab_batches), eager=False)
    runner = engine.core.runner
    floor = touched_bytes(runner.model) / bandwidth
    shipped = moe_ops.PAIR_DOWN_CHUNKS
    rows = []
    try:
        for batch in args.ab_batches:
            decode_step_times(engine, batch, 128, 4)  # warm-up
            times: dict[str, list[float]] = {str(chunks): [] for chunks in DOWN_VARIANTS}
            for chunks in DOWN_VARIANTS + DOWN_VARIANTS[::-1]:
                moe_ops.PAIR_DOWN_CHUNKS = chunks
                recapture_graphs(runner, [batch])
                times[str(chunks)] += decode_step_times(engine, batch, 128, args.ab_tokens)
            step = {name: statistics.median(t) for name, t in times.items()}
            row = {"figure": "down A/B", "batch": batch, "floor_ms": floor * 1e3, "shipped": shipped}
            for name in step:
                row[f"{name}_ms"] = step[name] * 1e3
                row[f"{name}_vs_0"] = step["0"] / step[name]
                if batch == 1:
                    row[f"{name}_of_floor"] = floor / step[name]
            rows.append(row)
    finally:
        moe_ops.PAIR_DOWN_CHUNKS = shipped
    del engine, runner
    release_gpu_memory()
    return rows


def print_down_ab(r: dict) -> None:
    print(f"decode step A/B, batch {r['batch']} (variant: ms, speed-up over 0[, of the floor]):", flush=True)
    for name in map(str, DOWN_VARIANTS):
        line = f"  {name:>4}: {r[f'{name}_ms']:.3f} ms, {r[f'{name}_vs_0']:.3f}x"
        if f"{name}_of_floor" in r:
            line += f", {r[f'{name}_of_floor']:.3f} of the {r['floor_ms']:.3f} ms floor (target >= 0.6)"
        print(line, flush=True)


def transformers_generate_batch(model_dir: Path, args, prompts, output_lens) -> float:
    """Output tokens/s of transformers' continuous batching on the same shapes (random weights built on
    the device), every sequence generating the mean output length (the same total)."""
    import transformers

    device = resolve_device(args.device)
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    hf_config = transformers.AutoConfig.from_pretrained(model_dir)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=dtype).eval()
    mean_len = round(sum(output_lens) / len(output_lens))
    gen_config = transformers.GenerationConfig(
        max_new_tokens=mean_len, do_sample=False, eos_token_id=None, pad_token_id=0, use_cuda_graph=False
    )
    model.generate_batch([prompts[0][:16]], generation_config=gen_config, max_new_tokens=4)  # warm-up
    sync(args.device)
    start = time.perf_counter()
    results = model.generate_batch(prompts, generation_config=gen_config)
    sync(args.device)
    elapsed = time.perf_counter() - start
    return sum(len(r.generated_tokens) for r in results.values()) / elapsed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--only",
        nargs="+",
        choices=[
            "kernels",
            "quant",
            "decode",
            "decode-ab",
            "pair-down",
            "down-ab",
            "step",
            "offline",
            "profile",
        ],
        default=["kernels", "decode", "step", "offline"],
    )
    p.add_argument("--tiny", action="store_true", help="a 4-layer Qwen3-MoE instead of the 30B-A3B shape")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="auto", help="auto: fp16 on CUDA, fp32 on the CPU")
    p.add_argument("--tokens", type=int, default=128, help="decode steps timed at batch 1")
    p.add_argument("--num-seqs", type=int, default=256)
    p.add_argument("--min-len", type=int, default=100)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs for voltllm's rows")
    p.add_argument("--skip-baseline", action="store_true", help="no transformers run in the offline figure")
    p.add_argument(
        "--baseline-layers", type=int, default=None, help="run the offline ratio on the first N layers"
    )
    p.add_argument(
        "--cut-only",
        action="store_true",
        help="with --baseline-layers: skip voltllm's full-depth offline run (the ratio is on the cut model)",
    )
    p.add_argument(
        "--kernel-tokens", type=int, nargs="+", default=[1, 8, 16, 64, 256, 1024, 8192], help="kernel sizes"
    )
    p.add_argument(
        "--quant-tokens",
        type=int,
        nargs="+",
        default=[1, 16, 64, 128, 192, 256, 1024],
        help="quantized kernel sizes",
    )
    p.add_argument(
        "--pair-down-tokens", type=int, nargs="+", default=[1, 8, 16, 64], help="pair-down figure sizes"
    )
    p.add_argument("--ab-batches", type=int, nargs="+", default=[1, 8], help="down-ab figure batch sizes")
    p.add_argument("--ab-tokens", type=int, default=24, help="decode steps per round of the down-ab figure")
    p.add_argument("--layers", type=int, default=None, help="cut the model to its first N layers")
    p.add_argument(
        "--quantization", choices=["awq"], help="dummy AWQ weights (4-bit, groups of 128, zero points)"
    )
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    if args.device == "cpu" and args.num_kv_blocks is None:
        args.num_kv_blocks = 1024
    config = dict(TINY_QWEN3_MOE if args.tiny else QWEN3_30B_A3B)
    name = "tiny Qwen3-MoE" if args.tiny else "Qwen3-30B-A3B shape"
    if args.layers:
        config["num_hidden_layers"] = args.layers
        name += f" cut to {args.layers} layers"
    if args.quantization == "awq":  # the routers stay dense, as the quantizing tools leave them
        config["quantization_config"] = {**AWQ_CONFIG, "modules_to_not_convert": ["mlp.gate"]}
        name += ", AWQ 4-bit g128"
    device = resolve_device(args.device)
    hw = torch.cuda.get_device_name() if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    bandwidth = copy_bandwidth(device.type)
    print(f"model: {name} (dummy weights, {args.dtype}); hardware: {hw}; copy {bandwidth / 1e9:.0f} GB/s")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp)
        (model_dir / "config.json").write_text(json.dumps(config))
        if "kernels" in args.only and device.type == "cuda":
            rows.extend(bench_kernels(config, args))
        if "quant" in args.only and device.type == "cuda":
            rows.extend(bench_quant_kernels(config, args))
        if "decode-ab" in args.only and device.type == "cuda":
            for r in bench_decode_ab(model_dir, args):
                rows.append(r)
                print(
                    f"decode A/B, batch {r['batch']}: A (pairs up to {r['pairs_limit_a']} tokens) "
                    f"{r['a_ms']:.3f} ms, B (pairs up to {r['pairs_limit_b']}) {r['b_ms']:.3f} ms: "
                    f"B/A {r['b_over_a']:.3f}",
                    flush=True,
                )
        if "pair-down" in args.only and device.type == "cuda":
            rows.extend(bench_pair_down(config, args))
        if "down-ab" in args.only and device.type == "cuda":
            for r in bench_down_ab(model_dir, args, bandwidth):
                rows.append(r)
                print_down_ab(r)
        if "decode" in args.only:
            rows.append(r := bench_decode(model_dir, args, bandwidth))
            print(
                f"batch-1 decode: step {r['step_ms']:.3f} ms ({1e3 / r['step_ms']:.0f} tok/s), floor "
                f"{r['floor_ms']:.3f} ms: {r['ratio']:.3f} of the floor (target >= 0.6)",
                flush=True,
            )
        if "profile" in args.only:
            rows.append(r := bench_profile(model_dir, args))
            print_profile(r)
        if "step" in args.only:
            rows.append(r := bench_step(model_dir, args))
            print(
                f"batch-64 decode step: {r['step_ms']:.3f} ms vs per-expert loop {r['loop_ms']:.3f} ms: "
                f"{r['ratio']:.2f}x (target >= 5x)",
                flush=True,
            )
        if "offline" in args.only:
            rows.append(r := bench_offline(model_dir, config, args))
            line = f"offline ({r['tokens']} tokens):"
            if "voltllm_tok_s" in r:
                line += f" voltllm {r['voltllm_tok_s']:.1f} tok/s;"
            if "ratio" in r:
                if "voltllm_cut_tok_s" in r:
                    cut = r["voltllm_cut_tok_s"]
                    line += f" first {r['baseline_layers']} layers: voltllm {cut:.1f} tok/s"
                line += (
                    f", transformers generate_batch {r['transformers_tok_s']:.1f} tok/s: {r['ratio']:.2f}x"
                )
                line += " (target >= 10x)"
            print(line, flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
