"""What sampling costs in a decode step: the same engine, the same batch, greedy against temperature 0.6
(and 0.6 with top-p 0.95), in one process, at batch 1 and 256 (issue 21's item 3: at most 3%).

Qwen3-0.6B shape, dummy weights, fp16, CUDA graphs. For each batch size, `batch` requests (128-token
prompts, ignore_eos) are prefilled, then every setting runs `--steps` decode steps in turn for
`--rounds` rounds (the settings alternate, so drift hits them alike); a setting's step time is the
median over its steps of the host wall time of `LLMEngine.step` (each step ends with the sampled ids on
the host, so it covers the GPU work). The table gives each setting's step time, its cost over greedy
as a share of its step, and the runner's host split of a step (prepare, forward enqueue, sample +
wait, post).

`--async-scheduling both` runs the table with asynchronous scheduling off, then on, on one engine
(a row's step time is then the period of `LLMEngine.step`, which returns the previous step's tokens).

    python benches/sampling_step.py
    python benches/sampling_step.py --batch-sizes 1 --steps 100
    python benches/sampling_step.py --async-scheduling both
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from model_shapes import QWEN3_0_6B, TINY  # noqa: E402

from voltllm.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig  # noqa: E402
from voltllm.engine.llm_engine import LLMEngine  # noqa: E402
from voltllm.protocol import EngineCoreRequest, EngineSamplingParams  # noqa: E402

SETTINGS = {  # name -> (temperature, top_p)
    "greedy": (0.0, 1.0),
    "T=0.6": (0.6, 1.0),
    "T=0.6 top-p 0.95": (0.6, 0.95),
}
PROMPT_LEN = 128
ASYNC_MODES = {"off": (False,), "on": (True,), "both": (False, True)}


def make_engine(max_num_seqs: int, device: str) -> LLMEngine:
    """Qwen3-0.6B shape in fp16 on a GPU; a tiny Qwen3 in fp32 elsewhere (a smoke test of the script)."""
    cuda = device == "cuda"
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(QWEN3_0_6B if cuda else TINY))
        dtype = "float16" if cuda else "float32"
        config = EngineConfig(
            model=ModelConfig(model=tmp, load_format="dummy", dtype=dtype, max_model_len=4096),
            cache=CacheConfig(num_kv_blocks=16384 if cuda else 512),
            scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=8192),
            device=device,
        )
        return LLMEngine(config)


def run_setting(
    engine: LLMEngine, batch: int, setting: str, steps: int, tag: str
) -> tuple[list[float], list]:
    """Prefills `batch` requests of `setting`, then times `steps` decode steps; aborts them after."""
    temperature, top_p = SETTINGS[setting]
    params = EngineSamplingParams(
        temperature=temperature, top_p=top_p, max_tokens=steps + 16, ignore_eos=True
    )
    ids = [f"{tag}-{i}" for i in range(batch)]
    for i, rid in enumerate(ids):
        prompt = [10 + (i * 7 + j) % 1000 for j in range(PROMPT_LEN)]
        engine.add_request(EngineCoreRequest(rid, prompt, params, 0.0))
    while engine.get_stats().num_waiting:
        engine.step()  # prefill
    for _ in range(3):
        engine.step()  # the last prefill chunks, warm-up
    times, timings = [], []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
        timings.append(engine.core.runner.last_timings)
    engine.abort_requests(ids)
    while engine.has_unfinished_requests():
        engine.step()
    return times, timings


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch-sizes", default="1,256")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--device", default="cuda", help="cuda; cpu runs a tiny model (a smoke test)")
    p.add_argument("--async-scheduling", choices=sorted(ASYNC_MODES), default="off")
    args = p.parse_args()
    batches = [int(b) for b in args.batch_sizes.split(",")]
    engine = make_engine(max(batches), args.device)
    print(
        "| scheduling | batch | sampling | step (ms) | cost over greedy (% of step) "
        "| prepare / forward / sample+wait / post (us) | graph steps |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for mode in ASYNC_MODES[args.async_scheduling]:
        engine.core.set_async_scheduling(mode)
        for batch in batches:
            print_rows(engine, "async" if mode else "sync", batch, args.steps, args.rounds)


def print_rows(engine: LLMEngine, mode: str, batch: int, steps: int, rounds: int) -> None:
    """Time every setting at `batch` for `rounds` alternating rounds and print its rows."""
    times: dict[str, list[float]] = {s: [] for s in SETTINGS}
    timings: dict[str, list] = {s: [] for s in SETTINGS}
    for r in range(rounds):
        for setting in SETTINGS:
            t, tm = run_setting(engine, batch, setting, steps, f"{mode}-b{batch}-r{r}-{setting}")
            times[setting] += t
            timings[setting] += tm
    greedy = statistics.median(times["greedy"])
    for setting in SETTINGS:
        step = statistics.median(times[setting])
        split = " / ".join(
            f"{statistics.median(getattr(t, f) for t in timings[setting]) * 1e6:.0f}"
            for f in ("prepare_s", "forward_s", "sync_s", "post_s")
        )
        cost = "" if setting == "greedy" else f"{(step - greedy) / step * 100:.1f}%"
        graphs = f"{sum(t.cuda_graph for t in timings[setting])}/{len(timings[setting])}"
        print(
            f"| {mode} | {batch} | {setting} | {step * 1e3:.3f} | {cost} | {split} | {graphs} |", flush=True
        )


if __name__ == "__main__":
    main()
