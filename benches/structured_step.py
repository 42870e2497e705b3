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
import time
from pathlib import Path

import llguidance

sys.path.insert(0, str(Path(__file__).resolve().parent))
from model_shapes import QWEN3_0_6B, TINY  # noqa: E402

from voltllm.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig  # noqa: E402
from voltllm.engine.llm_engine import LLMEngine  # noqa: E402
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


def timed_steps(engine: LLMEngine, args: argparse.Namespace, constrained: bool, tag: str) -> list[float]:
    """Add the batch, run its prefill, then time `args.steps` decode steps; abort the batch after."""
    constraint = StructuredOutput(kind="json", spec=json.dumps(SCHEMA)) if constrained else None
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
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        outputs = engine.step()
        times.append(time.perf_counter() - start)
        assert len(outputs) == args.batch and not any(o.finished for o in outputs), "the batch shrank"
    engine.abort_requests(ids)
    while engine.has_unfinished_requests():
        engine.step()
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true", help="a 4-layer Qwen3 (vocab 4096) for the CPU")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default=None, help="default: float16 on cuda, float32 on cpu")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    args.dtype = args.dtype or ("float32" if args.device == "cpu" else "float16")
    with tempfile.TemporaryDirectory() as tmp:
        engine = build_engine(args, tmp)
    medians: dict[bool, list[float]] = {False: [], True: []}
    for r in range(args.rounds):
        for constrained in (False, True):
            times = timed_steps(engine, args, constrained, f"{r}-{int(constrained)}")
            medians[constrained].append(statistics.median(times))
    plain, constrained = min(medians[False]), min(medians[True])
    shape = "tiny Qwen3" if args.tiny else "Qwen3-0.6B"
    print(f"{shape}, {args.device}, batch {args.batch}, {args.steps} decode steps x {args.rounds} rounds")
    print("| workload | step ms (best round median) | all round medians |")
    print("|---|---|---|")
    for name, key in (("unconstrained", False), ("JSON schema", True)):
        rounds = ", ".join(f"{m * 1e3:.3f}" for m in medians[key])
        print(f"| {name} | {min(medians[key]) * 1e3:.3f} | {rounds} |")
    print(f"ratio constrained / unconstrained: {constrained / plain:.3f} (target <= 1.05)")


if __name__ == "__main__":
    main()
