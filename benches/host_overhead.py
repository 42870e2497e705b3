"""Host time per engine step at decode batch 256 (and 64, 1), split by phase, against a 1 ms target.

An `EngineCore` (real scheduler, KV cache manager, `ModelRunner` and `Sampler`) runs around either
- a "null" model on the CPU (default): forward returns a preallocated [T, hidden] tensor and
  compute_logits a preallocated [N, vocab] zero tensor, so what is left is host work; or
- `--model-config qwen3-0.6b --device cuda`: the Qwen3-0.6B shape with dummy weights, where `sync` is
  the GPU's time and everything else is what the host adds around it.

Workload: `--num-seqs` requests (256), prompts uniform in [min_len, max_len] tokens,
ignore_eos, greedy, max_tokens large enough that none finishes. Once every prompt is computed (pure
decode), `--steps` decode steps are timed at each batch size, largest first (requests are aborted to
shrink the batch), `--repeats` times; each column is the smallest of the repeats' medians (a shared
CPU's noise comes in phases longer than a run of steps). Every step's output is also msgpack-encoded
as `core_proc` sends it (`encode`).

Columns, median microseconds per step: schedule (`Scheduler.schedule`), the runner's prepare /
forward (enqueueing forward + sampling) / sync (waiting for sampled tokens; on the CPU the argmax
itself; with `--async-scheduling on`, the default with CUDA, the wait for the running step's ids) /
post, as it reports them in `ModelRunner.last_timings` ("-" when it reports none; `execute`
is its whole call), update (`update_from_output`), outputs (building `EngineCoreOutputs`), encode, and
host = step wall time - sync + encode. The last column is host / 1 ms.

On the CPU there are no CUDA graphs, so decode steps take the runner's eager path. `--fake-graphs`
installs `FakeDecodeGraphs` instead: the runner stages every decode step for a graph bucket (padding,
fixed buffer addresses) and "replays" it, so the host work of the GPU's graph path is what is timed
(minus the CUDA calls themselves, which cost ~10-20 us each on the GPU machine).

    python benches/host_overhead.py                                   # CPU, null model, eager path
    python benches/host_overhead.py --fake-graphs                     # CPU, null model, graph path
    python benches/host_overhead.py --model-config qwen3-0.6b --device cuda
    python benches/host_overhead.py --model-config qwen3-0.6b --device cuda --count-cuda-calls

`--count-cuda-calls` adds, per batch size, the CUDA runtime calls (kernel and graph launches, copies,
event and stream calls; each costs host time) per decode step, counted by the torch profiler over
`CUDA_COUNT_STEPS` more steps.
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from voltllm import protocol
from voltllm.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from voltllm.engine.core import EngineCore, EngineStepTimings
from voltllm.protocol import EngineCoreRequest, EngineSamplingParams, MessageType
from voltllm.worker.cuda_graphs import DecodeGraphs, graph_batch_sizes
from voltllm.worker.model_runner import ModelRunner

sys.path.insert(0, str(Path(__file__).resolve().parent))
from offline_throughput import QWEN3_0_6B  # noqa: E402

TARGET_S = 1e-3
CUDA_COUNT_STEPS = 10
COLUMNS = ("schedule", "execute", "prepare", "forward", "sync", "post", "update", "outputs", "encode", "host")


class NullModel(torch.nn.Module):
    """The model interface with no compute: fixed tensors of the right shapes."""

    num_layers = 1

    def __init__(self, hidden: int, vocab: int, max_tokens: int, max_seqs: int) -> None:
        super().__init__()
        self._hidden = torch.zeros(max_tokens, hidden)
        self._logits = torch.zeros(max_seqs, vocab)

    def forward(self, input_ids, positions, metadata, kv_caches) -> torch.Tensor:
        return self._hidden[: input_ids.shape[0]]

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        logits = self._logits[: hidden.shape[0]]
        return logits if out is None else out.copy_(logits)

    def kv_cache_shape_per_layer(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return (2, num_blocks, block_size, 1, 1)  # the runner allocates it; nothing reads it


class _NoGraph:
    """A captured graph that does nothing when replayed."""

    def replay(self) -> None:
        pass


class FakeDecodeGraphs(DecodeGraphs):
    """`DecodeGraphs` on the CPU, so that the runner's CUDA-graph path runs there: "capture" stages
    each bucket's inputs as the real capture does and records nothing; a replay returns rows of the
    (zero) logits buffer. The bucket choice and the replay's own Python are the real ones."""

    def capture(self, decode_inputs, kv_caches: list[torch.Tensor]) -> None:
        for size in sorted(self.sizes, reverse=True):
            decode_inputs(size)
            self._graphs[size] = _NoGraph()


def install_fake_graphs(runner: ModelRunner) -> None:
    sizes = graph_batch_sizes(runner.max_num_seqs)
    graphs = FakeDecodeGraphs(runner.model, sizes, runner.vocab_size, runner.device)
    graphs.logits.zero_()
    runner.capture_cuda_graphs(graphs)


@dataclass
class NullLoaded:
    """Stands in for `voltllm.loader.LoadedModel`."""

    model: NullModel
    max_model_len: int
    vocab_size: int
    model_dir: Path = Path("/nonexistent/null")
    eos_token_ids: tuple[int, ...] = (0,)
    dtype: torch.dtype = torch.float32


ASYNC_MODES = {"auto": None, "on": True, "off": False}


def build_core(args: argparse.Namespace, tmp: Path) -> EngineCore:
    num_batches = len(args.batch_sizes.split(","))
    steps_per_batch = 1 + args.repeats * (args.warmup + args.steps) + CUDA_COUNT_STEPS * args.count_cuda_calls
    max_model_len = args.max_len + num_batches * steps_per_batch + 64
    scheduler = SchedulerConfig(
        max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.num_seqs
    )
    if args.model_config == "null":
        block_size = 16
        num_blocks = args.num_seqs * -(-max_model_len // block_size) + 16
        config = EngineConfig(
            cache=CacheConfig(block_size=block_size, num_kv_blocks=num_blocks),
            scheduler=scheduler,
            device="cpu",
            async_scheduling=ASYNC_MODES[args.async_scheduling],
        )
        model = NullModel(args.hidden, args.vocab, args.max_num_batched_tokens, args.num_seqs)
        loaded = NullLoaded(model, max_model_len=max_model_len, vocab_size=args.vocab)
        core = EngineCore(config, loaded, torch.device("cpu"))
        if args.fake_graphs:
            install_fake_graphs(core.runner)
        return core
    (tmp / "config.json").write_text(json.dumps(QWEN3_0_6B))
    config = EngineConfig(
        model=ModelConfig(model=str(tmp), load_format="dummy", max_model_len=max_model_len),
        scheduler=scheduler,
        device=args.device,
        async_scheduling=ASYNC_MODES[args.async_scheduling],
    )
    return EngineCore.from_config(config)


def add_requests(core: EngineCore, args: argparse.Namespace) -> list[str]:
    rng = random.Random(args.seed)
    params = EngineSamplingParams(temperature=0.0, max_tokens=core.max_model_len, ignore_eos=True)
    ids = [str(i) for i in range(args.num_seqs)]
    for rid in ids:
        prompt = [rng.randrange(1, core.vocab_size) for _ in range(rng.randint(args.min_len, args.max_len))]
        core.add_request(EngineCoreRequest(rid, prompt, params, time.time()))
    return ids


def run_prefill(core: EngineCore) -> int:
    """Step until every request is decoding (its prompt computed, one sampled token to feed back)."""
    steps = 0
    sched = core.scheduler
    while sched.waiting or any(r.num_tokens - r.num_computed_tokens != 1 for r in sched.running):
        outs = core.step().outputs
        assert not any(o.finished for o in outs), "a request finished during prefill"
        steps += 1
    return steps


def best_of(core: EngineCore, args: argparse.Namespace, batch: int) -> dict[str, float]:
    """Per column, the smallest median over `args.repeats` runs of `time_steps`."""
    runs = [time_steps(core, args.warmup, args.steps, batch) for _ in range(args.repeats)]
    return {c: min(r[c] for r in runs) for c in COLUMNS}


def time_steps(core: EngineCore, warmup: int, steps: int, batch: int) -> dict[str, float]:
    """Median microseconds per column over `steps` decode steps at `batch` sequences."""
    rows: list[dict[str, float]] = []
    for i in range(warmup + steps):
        out = core.step()
        t0 = time.perf_counter()
        protocol.encode(MessageType.OUTPUTS, out)
        encode_s = time.perf_counter() - t0
        assert len(out.outputs) == batch, f"expected {batch} outputs, got {len(out.outputs)}"
        if i >= warmup:
            rows.append(row_of(core.last_step_timings, encode_s))
    return {c: statistics.median(r[c] for r in rows) for c in COLUMNS}


def count_cuda_calls(core: EngineCore, steps: int) -> dict[str, float]:
    """CUDA runtime (and driver) API calls per step over `steps` steps, by name, from the profiler."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            core.step()
    counts: collections.Counter[str] = collections.Counter()
    for event in prof.key_averages():
        # Host-side events named cuda* / cu* are API calls; kernels are device-side events.
        if event.device_type == DeviceType.CPU and event.key.startswith("cu"):
            counts[event.key] += event.count
    return {name: n / steps for name, n in counts.most_common()}


def row_of(t: EngineStepTimings, encode_s: float) -> dict[str, float]:
    row = {c: getattr(t, f"{c}_s", 0.0) * 1e6 for c in COLUMNS if c not in ("encode", "host")}
    row["encode"] = encode_s * 1e6
    row["host"] = (t.host_s + encode_s) * 1e6
    return row


def shrink(core: EngineCore, ids: list[str], batch: int) -> list[str]:
    """Abort requests until `batch` remain, and let one step deliver the aborts to the runner."""
    core.abort_requests(ids[batch:])
    core.step()
    return ids[:batch]


def print_table(results: dict[int, dict[str, float]], runner_split: bool) -> None:
    print(f"{'batch':>5} " + " ".join(f"{c:>9}" for c in COLUMNS) + f" {'host/1ms':>9}")
    for batch, r in results.items():
        cells = []
        for c in COLUMNS:
            hidden = c in ("prepare", "forward", "sync", "post") and not runner_split
            cells.append(f"{'-':>9}" if hidden else f"{r[c]:9.1f}")
        print(f"{batch:>5} " + " ".join(cells) + f" {r['host'] * 1e-6 / TARGET_S:9.2f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-config", choices=("null", "qwen3-0.6b"), default="null")
    p.add_argument("--device", default="cpu")
    p.add_argument(
        "--fake-graphs",
        action="store_true",
        help="null model only: run decode steps through the runner's CUDA-graph path (fake graphs)",
    )
    p.add_argument("--num-seqs", type=int, default=256)
    p.add_argument("--batch-sizes", default="256,64,1", help="decode batches to time, largest first")
    p.add_argument("--min-len", type=int, default=100)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--repeats", type=int, default=3, help="timed runs per batch size; best median kept")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=1024, help="null model hidden size")
    p.add_argument("--vocab", type=int, default=1024, help="null model vocabulary (argmax is host work)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--async-scheduling",
        choices=list(ASYNC_MODES),
        default="auto",
        help="auto: the engine's default (on with CUDA); on: sync is then the wait for the running step",
    )
    p.add_argument(
        "--count-cuda-calls", action="store_true", help="CUDA API calls per decode step (CUDA device only)"
    )
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    batches = sorted((int(b) for b in args.batch_sizes.split(",")), reverse=True)
    if batches[0] > args.num_seqs:
        p.error("the largest batch size exceeds --num-seqs")
    if args.fake_graphs and args.model_config != "null":
        p.error("--fake-graphs is for the null model on the CPU (a real model captures real graphs)")
    if args.count_cuda_calls and not args.device.startswith("cuda"):
        p.error("--count-cuda-calls needs --device cuda")
    with tempfile.TemporaryDirectory() as tmp:
        core = build_core(args, Path(tmp))
        ids = add_requests(core, args)
        t0 = time.perf_counter()
        num_prefill = run_prefill(core)
        path = ", fake CUDA graphs" if args.fake_graphs else ""
        mode = "on" if core.async_scheduling else "off"
        print(
            f"model: {args.model_config}{path} on {args.device}, async scheduling {mode}, "
            f"torch threads {torch.get_num_threads()}; "
            f"{args.num_seqs} requests, prompts uniform in [{args.min_len}, {args.max_len}]: "
            f"prefilled in {num_prefill} steps ({time.perf_counter() - t0:.1f} s); "
            f"best of {args.repeats} medians of {args.steps} decode steps, microseconds"
        )
        results: dict[int, dict[str, float]] = {}
        cuda_calls: dict[int, dict[str, float]] = {}
        for batch in batches:
            ids = shrink(core, ids, batch)
            results[batch] = best_of(core, args, batch)
            if args.count_cuda_calls:
                cuda_calls[batch] = count_cuda_calls(core, CUDA_COUNT_STEPS)
        runner_split = getattr(core.runner, "last_timings", None) is not None
    print_table(results, runner_split)
    for batch, calls in cuda_calls.items():
        listed = ", ".join(f"{name} {n:g}" for name, n in calls.items())
        print(f"batch {batch}: {sum(calls.values()):g} CUDA API calls per step ({listed})")
    host = results[batches[0]]["host"]
    ratio = host * 1e-6 / TARGET_S
    print(f"host time per step at batch {batches[0]}: {host:.0f} us = {ratio:.2f}x the 1 ms target")


if __name__ == "__main__":
    main()
