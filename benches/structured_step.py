"""A JSON-schema-constrained decode step at batch 64 against an unconstrained one (target <= 1.05).

One `LLMEngine` with dummy weights of the Qwen3-0.6B shape (`--tiny`: a 4-layer Qwen3 for the CPU)
runs identical workloads, alternating, in the same process: 64 requests with 128-token prompts,
greedy, ignore_eos, max_tokens large enough that none finishes while it is timed; one workload
unconstrained, the others with every request under its own matcher of `SCHEMA` (an array of at
least 1,000 small objects, so no grammar ends while it is timed and the matchers walk through keys,
numbers, strings and booleans). After the prefill, `--steps` decode steps of each are timed; the
table gives each workload's median step time over `--rounds` rounds and the ratio to the
unconstrained one. On the GPU the constrained step hands its grammar work to the mask thread once
the forward is queued (CUDA graphs in both workloads): accept the last step's tokens, fill the
masks, queue their copy to the device on a side stream; the step applies them to the logits.

Where the constrained step's extra time goes: a second table splits the median step of each workload
into the engine's own timings (`EngineStepTimings`: schedule, the runner's prepare / forward enqueue
/ sync / post, the scheduler's update, outputs) and the constrained path's parts, measured by
wrappers this script puts around the runner's `TokenMasks`: in the mask thread, the delay from the
hand-off to the thread's start (the GIL, the queue), the accept, the fill, the upload's host time
and its device time (CUDA events on the copy stream); on the main thread, the wait for the thread
once the logits exist, and the apply's host time and device time (CUDA events around it on the
step's stream: a late upload shows here). The `mask-profile` workload also computes each step's
masks on copies of the matchers after the step's own fill, one after another on one thread: the
slowest single mask and the sum (its step times are not comparable). Other workloads change one
thing, bench-only, through the same wrappers: `upload-at-apply` copies the masks on the step's
stream after the wait (before: the copy was on the critical path), `no-maxLength` uses `SCHEMA`
without the string's `maxLength` (bounded strings are the grammar engine's expensive case),
`apply-only` uploads and applies the last filled masks without filling new ones or accepting (the
floor of the device side). Every workload runs with the engine's asynchronous scheduling (its CUDA
default: the next step is planned and launched before the last one's ids reach the host; a
constrained step's draw is queued by the mask thread once its masks are filled, and the main thread
waits for that only before the next forward: `launch_wait`), but the `-sync` ones, which step
synchronously. After each constrained workload (but `apply-only`) every request's tokens are fed to
a fresh matcher of its schema: a token the grammar rejects stops the script (the masks were wrong or
late); the first round's greedy outputs of the `SCHEMA` workloads are also compared token by token
with `JSON schema-sync`'s.

The dummy checkpoint has no tokenizer, so the grammar engine gets a synthetic vocabulary of the
model's size (`synthetic_tokenizer`: the 256 bytes, then deterministic pseudo-words, JSON
punctuation and digit runs; the mask's cost grows with the vocabulary and its structure, so this
stands in for Qwen3's 151,669 tokens, not equals them).

    python benches/structured_step.py                       # Qwen3-0.6B shape on the GPU
    python benches/structured_step.py --tiny --device cpu   # smoke test on the CPU
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import llguidance
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from model_shapes import QWEN3_0_6B, TINY  # noqa: E402

from voltllm.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig  # noqa: E402
from voltllm.engine.llm_engine import LLMEngine  # noqa: E402
from voltllm.protocol import EngineCoreRequest, EngineSamplingParams, StructuredOutput  # noqa: E402
from voltllm.structured_output import TokenMasks  # noqa: E402

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
    """One timed workload: constrained or not, and which parts of the constrained path run how."""

    name: str
    constrained: bool
    fill: bool = True
    accept: bool = True
    upload_at_apply: bool = False  # copy the masks on the step's stream after the wait
    profile_masks: bool = False  # time the masks again on copies (step times not comparable)
    async_scheduling: bool = True  # the engine's asynchronous scheduling (the CUDA default)
    schema: dict = field(default_factory=lambda: SCHEMA, compare=False)


VARIANTS = {
    v.name: v
    for v in (
        Variant("unconstrained", False),
        Variant("JSON schema", True),
        Variant("unconstrained-sync", False, async_scheduling=False),
        Variant("JSON schema-sync", True, async_scheduling=False),
        Variant("upload-at-apply", True, upload_at_apply=True),
        Variant("no-maxLength", True, schema=SCHEMA_NO_MAXLENGTH),
        Variant("apply-only", True, fill=False, accept=False),
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
    "start_delay_s",
    "accept_s",
    "fill_s",
    "upload_host_s",
    "upload_device_s",
    "fill_wait_s",
    "launch_wait_s",
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
    """Wraps the parts of the runner's `TokenMasks` (start, accept, fill, upload, apply) to time them
    and to switch them per variant. Device times come from CUDA events read after the workload. The
    mask thread's parts are recorded in the step whose apply waits for them."""

    def __init__(self, engine: LLMEngine) -> None:
        self.runner = engine.core.runner
        self.cuda = self.runner.device.type == "cuda"
        self.variant = VARIANTS["JSON schema"]
        self.current: dict[str, float] = {}
        self._events: list[tuple[dict[str, float], str, object, object]] = []
        self._wrap(self.runner.masks)
        self._wrap_launch_wait()

    def use(self, variant: Variant) -> None:
        """Time `variant` next (the wrappers read it)."""
        self.variant = variant

    def _wrap(self, masks: TokenMasks) -> None:
        start, run, accept, fill = masks.start, masks._run, masks._accept, masks._fill
        upload, apply, apply_filled = masks._upload, masks.apply, masks.apply_filled
        # The records of the steps whose work was handed to the thread, in order, and when: a job
        # writes its parts into the record of the step that started it.
        jobs: deque[tuple[dict[str, float], float]] = deque()
        local = threading.local()  # the mask thread's current record

        def timed_start(masked, accepts=None, then=None):
            jobs.append((self.current, time.perf_counter()))
            return start(masked, accepts, then)

        def timed_run(accepts, masked, then=None):
            local.parts, started = jobs.popleft()
            local.parts["start_delay_s"] = time.perf_counter() - started
            return run(accepts, masked, then)

        def timed_accept(accepts) -> list:
            begin = time.perf_counter()
            ended = accept(accepts) if self.variant.accept else []
            local.parts["accept_s"] = time.perf_counter() - begin
            return ended

        def timed_fill(matchers: list) -> None:
            # A matcher keeps its last mask: copies for the profile are taken before the fill.
            copies = self._copy_matchers(matchers) if self.variant.profile_masks else None
            begin = time.perf_counter()
            if self.variant.fill:
                fill(matchers)
            local.parts["fill_s"] = time.perf_counter() - begin
            if copies is not None:
                self._profile(masks, copies, local.parts)

        def timed_upload(masked) -> None:
            if self.variant.upload_at_apply:
                return
            begin = time.perf_counter()
            first = self._mark(masks._copy_stream)
            upload(masked)
            local.parts["upload_host_s"] = time.perf_counter() - begin
            self._events.append((local.parts, "upload_device_s", first, self._mark(masks._copy_stream)))

        def timed_apply(pending, logits: torch.Tensor) -> None:
            """The synchronous path's wait for the thread (then `apply_filled`, timed below)."""
            begin = time.perf_counter()
            pending.done.result()
            self.current["fill_wait_s"] = time.perf_counter() - begin
            apply(pending, logits)

        def timed_apply_filled(masked, logits: torch.Tensor) -> None:
            """The apply, on the main thread (synchronous path) or in the mask thread (its draw)."""
            in_thread = threading.current_thread() is not threading.main_thread()
            parts = local.parts if in_thread else self.current
            begin = time.perf_counter()
            first = self._mark()
            if self.variant.upload_at_apply and self.cuda:
                num = len(masked.rows)
                masks._bits[:num].copy_(masks._host[:num], non_blocking=True)
                if not masked.rows_are_prefix:
                    masks._host_rows.numpy()[:num] = masked.rows
                    masks._rows[:num].copy_(masks._host_rows[:num], non_blocking=True)
            apply_filled(masked, logits)
            parts["apply_host_s"] = time.perf_counter() - begin
            self._events.append((parts, "apply_device_s", first, self._mark()))

        masks.start, masks._run, masks._accept, masks._fill = timed_start, timed_run, timed_accept, timed_fill
        masks._upload, masks.apply, masks.apply_filled = timed_upload, timed_apply, timed_apply_filled

    def _wrap_launch_wait(self) -> None:
        """Time the main thread's wait for a constrained step's draw to be queued by the mask thread
        (the asynchronous path's critical-path wait; several calls a step add up)."""
        wait = self.runner._wait_launched

        def timed_wait(handle) -> None:
            begin = time.perf_counter()
            wait(handle)
            self.current["launch_wait_s"] = (
                self.current.get("launch_wait_s", 0.0) + time.perf_counter() - begin
            )

        self.runner._wait_launched = timed_wait

    @staticmethod
    def _copy_matchers(matchers: list) -> list:
        """Copies of the step's matchers (a matcher keeps its last mask)."""
        return [(m.deep_copy(), i) for m, i in matchers]

    def _profile(self, masks: TokenMasks, copies: list, parts: dict[str, float]) -> None:
        """The step's masks again on `copies`, one after another on this thread (each mask alone)."""
        mask_bytes = masks.num_words * 4
        scratch = torch.empty((len(copies), masks.num_words), dtype=torch.int32)
        times = []
        for copy, i in copies:
            begin = time.perf_counter()
            copy.unsafe_compute_mask_ptr(scratch[i].data_ptr(), mask_bytes)
            times.append(time.perf_counter() - begin)
        parts["slowest_mask_s"] = max(times, default=0.0)
        parts["sum_of_masks_s"] = sum(times)

    def _mark(self, stream: torch.cuda.Stream | None = None) -> object:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(stream)
        return event

    def new_step(self) -> dict[str, float]:
        self.current = {}
        return self.current

    def resolve_device_times(self) -> None:
        """Fill in the device times of every recorded step (waits for the mask thread, then syncs
        the device)."""
        self.runner.masks._thread.submit(lambda: None).result()  # its last events are recorded
        if self.cuda:
            torch.cuda.synchronize()
        for record, part, begin, end in self._events:
            record[part] = begin.elapsed_time(end) / 1e3 if self.cuda else end - begin  # type: ignore[attr-defined]
        self._events.clear()


def timed_steps(
    engine: LLMEngine, args: argparse.Namespace, variant: Variant, probe: ConstrainedPathProbe, tag: str
) -> tuple[list[StepRecord], list[list[int]]]:
    """Add the batch, run its prefill, then time `args.steps` decode steps; abort the batch after.
    Returns the timed steps and every request's tokens (in request order)."""
    probe.use(variant)
    engine.core.set_async_scheduling(variant.async_scheduling)
    schema = json.dumps(variant.schema)
    constraint = StructuredOutput(kind="json", spec=schema) if variant.constrained else None
    params = EngineSamplingParams(
        temperature=0.0, max_tokens=100_000 // 8, ignore_eos=True, structured_output=constraint
    )
    ids = [f"{tag}-{i}" for i in range(args.batch)]
    tokens: dict[str, list[int]] = {request_id: [] for request_id in ids}

    def step() -> list:
        outputs = engine.step()
        for out in outputs:
            tokens[out.request_id] += out.new_token_ids
        return outputs

    for i, request_id in enumerate(ids):
        prompt = [(7 * i + j) % 1000 + 300 for j in range(PROMPT_LEN)]
        engine.add_request(EngineCoreRequest(request_id, prompt, params, time.time()))
    while engine.core.scheduler.waiting or any(
        r.num_output_tokens == 0 for r in engine.core.scheduler.running
    ):
        step()
    for _ in range(3):  # warm-up (the first masks of a grammar build its lexer caches)
        step()
    records = []
    for _ in range(args.steps):
        probe_parts = probe.new_step()
        outputs = step()
        timings = engine.core.last_step_timings
        records.append(StepRecord({k: getattr(timings, k) for k in ENGINE_PARTS}, probe_parts))
        assert len(outputs) == args.batch and not any(o.finished for o in outputs), "the batch shrank"
    probe.resolve_device_times()
    engine.abort_requests(ids)
    while engine.has_unfinished_requests():
        step()
    if constraint is not None and variant.fill and variant.accept:
        check_grammar(engine, constraint, tokens, variant.name)
    return records, [tokens[request_id] for request_id in ids]


def follows_schema(variant: Variant) -> bool:
    """Whether the variant's greedy outputs are `SCHEMA`'s (masks filled, tokens accepted)."""
    return variant.constrained and variant.fill and variant.accept and variant.schema is SCHEMA


def compare_outputs(outputs: dict[str, list[list[int]]], baseline: str) -> None:
    """Print whether each greedy constrained workload with `SCHEMA` gave `baseline`'s tokens (on the
    tokens both have: an asynchronous run delivers one token less or more before the abort)."""
    for name, tokens in outputs.items():
        if name == baseline:
            continue
        lengths = [min(len(a), len(b)) for a, b in zip(tokens, outputs[baseline], strict=True)]
        differ = sum(a[:n] != b[:n] for a, b, n in zip(tokens, outputs[baseline], lengths, strict=True))
        verdict = "equal" if not differ else f"DIFFERENT in {differ} requests"
        print(f"exactness: {name} vs {baseline}: {verdict} ({min(lengths)}+ tokens each, first round)")


def check_grammar(
    engine: LLMEngine, constraint: StructuredOutput, tokens: dict[str, list[int]], name: str
) -> None:
    """Every request's tokens must be accepted, one by one, by a fresh matcher of `constraint`."""
    compiler = engine.core.structured_output
    for request_id, ids in tokens.items():
        matcher = compiler.compile(constraint).matcher
        if not all(matcher.consume_token(t) for t in ids):
            raise AssertionError(f"{name}: {request_id}'s tokens break the grammar: {matcher.get_error()}")


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
    outputs: dict[str, list[list[int]]] = {}  # the first round's, of the greedy SCHEMA workloads
    for r in range(args.rounds):
        for name in names:
            steps, tokens = timed_steps(engine, args, VARIANTS[name], probe, f"{r}-{name}")
            if r == 0 and follows_schema(VARIANTS[name]):
                outputs[name] = tokens
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
    print(f"grammar check: every constrained workload's {args.batch} outputs follow the schema")
    same_round = [c / u for c, u in zip(medians["JSON schema"], medians["unconstrained"], strict=True)]
    print(
        f"ratio constrained / unconstrained: {min(medians['JSON schema']) / plain:.3f} of the best rounds, "
        f"{statistics.median(same_round):.3f} the median of same-round ratios (target <= 1.05)"
    )
    if "JSON schema-sync" in outputs:
        compare_outputs(outputs, "JSON schema-sync")
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
