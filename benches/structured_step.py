"""A JSON-schema-constrained decode step at batch 64 against an unconstrained one (target <= 1.05).

One `LLMEngine` with dummy weights of the Qwen3-0.6B shape (`--tiny`: a 4-layer Qwen3 for the CPU)
runs two identical workloads, alternating, in the same process: 64 requests with 128-token prompts,
greedy, ignore_eos, max_tokens large enough that none finishes while it is timed; one workload
unconstrained, the other with every request under its own matcher of `SCHEMA` (an array of at
least 1,000 small objects, so no grammar ends while it is timed and the matchers walk through keys,
numbers, strings and booleans). After the prefill, `--steps` decode steps of each are timed; the
table gives each workload's median step time over `--rounds` rounds and the ratio. On the GPU the
constrained step fills its masks in a thread while the forward runs (CUDA graphs in both workloads)
and applies them to the logits on the device.

Where the constrained step's extra time goes: a second table splits the median step of each workload
into the engine's own timings (`EngineStepTimings`: schedule, the runner's prepare / forward enqueue /
sync / post, the scheduler's update, outputs) and the constrained path's parts, measured by wrappers
this script puts around them: the grammar accept of the last step's tokens and the mask fill (both in
the mask thread, which starts once the last step's tokens are known and runs while the engine
finishes that step, stages the next one and runs its forward), the runner's wait for that thread once
the logits exist, the bitmask upload + apply (host launch time and CUDA-event device time), and, in
the `mask-profile` workload only, each mask computed alone on a copy of its matcher after the fill:
the slowest single mask of the step (the parallel fill cannot be shorter) and their sum. Other
workloads switch parts off or change them (bench-only, through the same wrappers): `no-maxLength`
uses `SCHEMA` without the string's `maxLength` (bounded strings are the grammar engine's expensive
case), `apply-unpack` applies the masks with the torch reference (unpack to int32 bits, compare,
`masked_fill`: what ran before the kernel), `all-cores` gives llguidance one thread per core (its
default is 80% of them), `no-accept` never advances the matchers (each step masks
with the same state), `fill-only` fills and waits but leaves the logits unmasked, `apply-only` uploads
and applies the last filled masks without filling new ones (both also skip the accept, which would
reject unmasked tokens).

The dummy checkpoint has no tokenizer, so the grammar engine gets a synthetic vocabulary of the
model's size (`synthetic_tokenizer`: the 256 bytes, then deterministic pseudo-words, JSON
punctuation and digit runs; the mask's cost grows with the vocabulary and its structure, so this
stands in for Qwen3's 151,669 tokens, not equals them).

    python benches/structured_step.py                       # Qwen3-0.6B shape on the GPU
    python benches/structured_step.py --tiny --device cpu   # smoke test on the CPU
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import llguidance
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from model_shapes import QWEN3_0_6B, TINY  # noqa: E402

import voltllm.structured_output.grammar as grammar_module  # noqa: E402
import voltllm.structured_output.masks as masks_module  # noqa: E402
from voltllm.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig  # noqa: E402
from voltllm.engine.llm_engine import LLMEngine  # noqa: E402
from voltllm.ops.structured import apply_token_bitmask_ref  # noqa: E402
from voltllm.protocol import EngineCoreRequest, EngineSamplingParams, StructuredOutput  # noqa: E402

SCHEMA = {
    "type": "array",
    "minItems": 1000,
    "items": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 0, "maximum": 99999},
            "name": {"type": "string", "maxLength": 12},
            "ok": {"type": "boolean"},
        },
        "required": ["id", "name", "ok"],
        "additionalProperties": False,
    },
}
# The same array of objects with an unbounded string.
SCHEMA_NO_MAXLENGTH = json.loads(json.dumps(SCHEMA))
del SCHEMA_NO_MAXLENGTH["items"]["properties"]["name"]["maxLength"]
PROMPT_LEN = 128
_PIECES = ['{"', '":', '",', "},", "[{", "}]", '"', ",", ":", "{", "}", "[", "]", "true", "false", "null"]


def synthetic_tokenizer(vocab_size: int, eos_token_id: int) -> llguidance.LLTokenizer:
    """An llguidance tokenizer over `vocab_size` distinct byte strings: every byte, JSON pieces, then
    pseudo-words (with and without a leading space) and digit runs; `eos_token_id` is special."""
    rng = random.Random(0)
    tokens: list[bytes] = [bytes([b]) for b in range(256)] + [p.encode() for p in _PIECES]
    seen = set(tokens)
    letters = "etaoinshrdlucmfwypvbgkjqxz"
    while len(tokens) < vocab_size:
        kind = rng.random()
        if kind < 0.1:
            word = "".join(rng.choice("0123456789") for _ in range(rng.randint(2, 4)))
        else:
            word = "".join(rng.choice(letters) for _ in range(rng.randint(2, 9)))
            word = (" " if kind < 0.6 else "") + (word.capitalize() if rng.random() < 0.1 else word)
        token = word.encode()
        if token not in seen:
            seen.add(token)
            tokens.append(token)
    tokens[eos_token_id] = b"<|eos|>"

    class Vocabulary:
        """What `llguidance.TokenizerWrapper` reads: tokens, special ids and an encoder (bytewise)."""

        bos_token_id = None
        special_token_ids = [eos_token_id]

        def __init__(self) -> None:
            self.eos_token_id = eos_token_id
            self.tokens = tokens

        def __call__(self, text: bytes) -> list[int]:
            return list(text)  # ids 0..255 are the single bytes

    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(Vocabulary()), n_vocab=vocab_size)


def build_engine(args: argparse.Namespace, tmp: str) -> LLMEngine:
    shape = TINY if args.tiny else QWEN3_0_6B
    (Path(tmp) / "config.json").write_text(json.dumps(shape))
    config = EngineConfig(
        model=ModelConfig(model=tmp, load_format="dummy", dtype=args.dtype, max_model_len=4096),
        cache=CacheConfig(
            num_kv_blocks=args.batch * (PROMPT_LEN + args.steps * args.rounds * 2 + 64) // 16 + 64
        ),
        scheduler=SchedulerConfig(max_num_seqs=args.batch, max_num_batched_tokens=8192),
        device=args.device,
        enforce_eager=args.device == "cpu",
    )
    engine = LLMEngine(config)
    core = engine.core
    core.structured_output._tokenizer = synthetic_tokenizer(core.vocab_size, core.eos_token_ids[0])
    return engine


@dataclass(frozen=True)
class Variant:
    """One timed workload: constrained or not, and which parts of the constrained path run."""

    name: str
    constrained: bool
    fill: bool = True
    apply: bool = True
    accept: bool = True
    apply_unpack: bool = False  # apply with the torch reference instead of the kernel
    profile_masks: bool = False  # time each mask alone after the fill (step times not comparable)
    threads: int | None = None  # llguidance's threads for the fill and accept (None: its default)
    schema: dict = field(default_factory=lambda: SCHEMA, compare=False)


VARIANTS = {
    v.name: v
    for v in (
        Variant("unconstrained", False),
        Variant("JSON schema", True),
        Variant("no-maxLength", True, schema=SCHEMA_NO_MAXLENGTH),
        Variant("apply-unpack", True, apply_unpack=True),
        Variant("no-accept", True, accept=False),
        Variant("fill-only", True, apply=False, accept=False),
        Variant("apply-only", True, fill=False, accept=False),
        Variant("all-cores", True, threads=os.cpu_count()),
        Variant("mask-profile", True, profile_masks=True),
    )
}
ENGINE_PARTS = (
    "schedule_s",
    "prepare_s",
    "forward_s",
    "sync_s",
    "post_s",
    "update_s",
    "outputs_s",
    "total_s",
)
PROBE_PARTS = (
    "accept_s",
    "fill_s",
    "fill_wait_s",
    "apply_host_s",
    "apply_device_s",
    "slowest_mask_s",
    "sum_of_masks_s",
)


@dataclass
class StepRecord:
    """One timed step: the engine's timings and the constrained path's parts (seconds; 0 = not run)."""

    engine: dict[str, float]
    probe: dict[str, float] = field(default_factory=dict)


class ConstrainedPathProbe:
    """Wraps the runner's `TokenMasks` (accept, fill, apply) to time the parts and to switch them off
    per variant. Device times come from CUDA events read after the workload. The mask thread's parts
    are recorded in the step whose apply waits for them."""

    def __init__(self, engine: LLMEngine) -> None:
        self.masks = masks = engine.core.runner.masks
        self.cuda = masks.device.type == "cuda"
        self.variant = VARIANTS["JSON schema"]
        self.current: dict[str, float] = {}
        self._thread_parts: dict[str, float] = {}
        self._events: list[tuple[dict[str, float], object, object]] = []
        accept, fill, apply = masks._accept, masks._fill, masks.apply

        def timed_accept(accepts) -> list:
            begin = time.perf_counter()
            ended = accept(accepts) if self.variant.accept else []
            self._thread_parts["accept_s"] = time.perf_counter() - begin
            return ended

        def timed_fill(matchers: list) -> None:
            if self.variant.profile_masks:
                self._profile(matchers)
            begin = time.perf_counter()
            if self.variant.fill:
                fill(matchers)
            self._thread_parts["fill_s"] = time.perf_counter() - begin

        def timed_apply(pending, logits: torch.Tensor) -> None:
            begin = time.perf_counter()
            pending.done.result()
            waited = time.perf_counter() - begin
            self.current.update(self._thread_parts)  # the thread is idle now
            self._thread_parts = {}
            self.current["fill_wait_s"] = waited
            if not self.variant.apply:
                return
            first = self._mark()
            if self.variant.apply_unpack:
                apply_unpacked(pending, logits)
            else:
                apply(pending, logits)
            self.current["apply_host_s"] = time.perf_counter() - begin - waited
            self._events.append((self.current, first, self._mark()))

        def apply_unpacked(pending, logits: torch.Tensor) -> None:
            num = len(pending.rows)
            bits = masks._host[:num].to(masks.device, non_blocking=True)
            rows = torch.tensor(pending.rows, dtype=torch.int32, device=masks.device)
            apply_token_bitmask_ref(logits, bits, None if pending.rows[-1] == num - 1 else rows)

        masks._accept, masks._fill, masks.apply = timed_accept, timed_fill, timed_apply

        def executor_of_variant() -> llguidance.LLExecutor:
            return threads_executor(self.variant.threads)

        # Both modules call `executor()` for llguidance's pool: the variant's pool instead.
        masks_module.executor = grammar_module.executor = executor_of_variant

    def _profile(self, matchers: list) -> None:
        """Each mask alone, on a copy of its matcher taken before the fill (a matcher keeps its last
        mask: a copy taken after would return it from that cache)."""
        scratch = torch.empty(self.masks.num_words, dtype=torch.int32)
        times = []
        for matcher, _ in matchers:
            copy = matcher.deep_copy()
            begin = time.perf_counter()
            copy.unsafe_compute_mask_ptr(scratch.data_ptr(), scratch.numel() * 4)
            times.append(time.perf_counter() - begin)
        self._thread_parts["slowest_mask_s"] = max(times, default=0.0)
        self._thread_parts["sum_of_masks_s"] = sum(times)

    def _mark(self) -> object:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def new_step(self) -> dict[str, float]:
        self.current = {}
        return self.current

    def resolve_device_times(self) -> None:
        """Fill in `apply_device_s` of every recorded step (syncs the device)."""
        if self.cuda:
            torch.cuda.synchronize()
        for record, begin, end in self._events:
            record["apply_device_s"] = (
                begin.elapsed_time(end) / 1e3 if self.cuda else end - begin  # type: ignore[attr-defined]
            )
        self._events.clear()


@functools.cache
def threads_executor(threads: int | None) -> llguidance.LLExecutor:
    return llguidance.LLExecutor(num_threads=threads)


def timed_steps(
    engine: LLMEngine, args: argparse.Namespace, variant: Variant, probe: ConstrainedPathProbe, tag: str
) -> list[StepRecord]:
    """Add the batch, run its prefill, then time `args.steps` decode steps; abort the batch after."""
    probe.variant = variant
    schema = json.dumps(variant.schema)
    constraint = StructuredOutput(kind="json", spec=schema) if variant.constrained else None
    params = EngineSamplingParams(
        temperature=0.0, max_tokens=100_000 // 8, ignore_eos=True, structured_output=constraint
    )
    ids = [f"{tag}-{i}" for i in range(args.batch)]
    for i, request_id in enumerate(ids):
        prompt = [(7 * i + j) % 1000 + 300 for j in range(PROMPT_LEN)]
        engine.add_request(EngineCoreRequest(request_id, prompt, params, time.time()))
    while engine.core.scheduler.waiting or any(
        r.num_output_tokens == 0 for r in engine.core.scheduler.running
    ):
        engine.step()
    for _ in range(3):  # warm-up (the first masks of a grammar build its lexer caches)
        engine.step()
    records = []
    for _ in range(args.steps):
        probe_parts = probe.new_step()
        outputs = engine.step()
        timings = engine.core.last_step_timings
        records.append(StepRecord({k: getattr(timings, k) for k in ENGINE_PARTS}, probe_parts))
        assert len(outputs) == args.batch and not any(o.finished for o in outputs), "the batch shrank"
    probe.resolve_device_times()
    engine.abort_requests(ids)
    while engine.has_unfinished_requests():
        engine.step()
    return records


def median_of(records: list[StepRecord], part: str) -> float:
    values = [r.engine[part] if part in r.engine else r.probe.get(part, 0.0) for r in records]
    return statistics.median(values)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true", help="a 4-layer Qwen3 (vocab 4096) for the CPU")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default=None, help="default: float16 on cuda, float32 on cpu")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument(
        "--variants",
        default=",".join(VARIANTS),
        help=f"comma-separated workloads to time (default all: {', '.join(VARIANTS)})",
    )
    args = p.parse_args()
    args.dtype = args.dtype or ("float32" if args.device == "cpu" else "float16")
    names = [n.strip() for n in args.variants.split(",") if n.strip()]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown or names[:2] != ["unconstrained", "JSON schema"]:
        p.error(f"--variants must start with 'unconstrained,JSON schema' and name only {list(VARIANTS)}")
    with tempfile.TemporaryDirectory() as tmp:
        engine = build_engine(args, tmp)
    probe = ConstrainedPathProbe(engine)
    medians: dict[str, list[float]] = {n: [] for n in names}
    records: dict[str, list[StepRecord]] = {n: [] for n in names}
    for r in range(args.rounds):
        for name in names:
            steps = timed_steps(engine, args, VARIANTS[name], probe, f"{r}-{name}")
            medians[name].append(statistics.median(s.engine["total_s"] for s in steps))
            records[name] += steps
        # One line per round as it ends, so a run cut short still reports what it timed.
        done = ", ".join(f"{name} {medians[name][-1] * 1e3:.3f}" for name in names)
        print(f"round {r + 1} step ms: {done}", flush=True)
    plain = min(medians["unconstrained"])
    shape = "tiny Qwen3" if args.tiny else "Qwen3-0.6B"
    print(f"{shape}, {args.device}, batch {args.batch}, {args.steps} decode steps x {args.rounds} rounds")
    print("| workload | step ms (best round median) | x unconstrained | all round medians |")
    print("|---|---|---|---|")
    for name in names:
        rounds = ", ".join(f"{m * 1e3:.3f}" for m in medians[name])
        best = min(medians[name])
        print(f"| {name} | {best * 1e3:.3f} | {best / plain:.3f} | {rounds} |")
    print(f"ratio constrained / unconstrained: {min(medians['JSON schema']) / plain:.3f} (target <= 1.05)")
    print()
    print("per-step medians over all rounds, us (fill runs in its thread, overlapping the forward;")
    print("fill wait, apply host and sync are on the critical path)")
    print("| part | " + " | ".join(names) + " |")
    print("|---" * (len(names) + 1) + "|")
    for part in ENGINE_PARTS + PROBE_PARTS:
        cells = " | ".join(f"{median_of(records[n], part) * 1e6:.0f}" for n in names)
        print(f"| {part[:-2]} | {cells} |")


if __name__ == "__main__":
    main()
