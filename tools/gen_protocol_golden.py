"""Write the wire protocol's golden vectors: `tests/protocol/golden/<name>.msgpack` + `<name>.json`.

Each vector is one message encoded by the Python implementation (`voltllm.protocol`). The JSON
file gives its meaning: the message type and the payload as plain JSON (maps for map structs, arrays for
array structs, `logit_bias` keys as strings since JSON keys must be). Both test suites decode the bytes,
compare with the meaning, and re-encode them byte for byte. Run after any change to docs/protocol.md.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import msgspec

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "python"))

from voltllm import protocol as p  # noqa: E402

GOLDEN_DIR = ROOT / "tests" / "protocol" / "golden"


def vectors() -> dict[str, tuple[p.MessageType, object]]:
    """A representative message of every type, covering nil/optional fields and edge values."""
    greedy = p.EngineSamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    full = p.EngineSamplingParams(
        temperature=0.7,
        top_p=0.9,
        top_k=50,
        min_p=0.05,
        presence_penalty=0.5,
        frequency_penalty=-0.25,
        repetition_penalty=1.1,
        seed=2**63 - 1,
        max_tokens=1024,
        min_tokens=4,
        stop_token_ids=[2, 49152],
        ignore_eos=False,
        logprobs=5,
        logit_bias={0: -100.0, 65535: 2.5},
        structured_output=p.StructuredOutput(
            kind="json",
            spec='{"type": "object", "properties": {"name": {"type": "string"}}}',
            whitespace_pattern="[ ]?",
        ),
        prompt_logprobs=0,
    )
    choice = p.EngineSamplingParams(
        temperature=0.0,
        max_tokens=8,
        structured_output=p.StructuredOutput(kind="choice", spec='["yes", "no"]'),
        prompt_logprobs=2,
    )
    stats = p.SchedulerStats(
        num_running=3,
        num_waiting=1,
        kv_cache_usage=0.375,
        prefix_cache_queries=4096,
        prefix_cache_hits=1024,
        num_preemptions=2,
        num_prompt_tokens=70000,
        num_generation_tokens=123456,
    )
    return {
        "add_greedy": (p.MessageType.ADD, p.EngineCoreRequest("req-0", [1, 2, 3], greedy, 1700000000.25)),
        "add_full": (
            p.MessageType.ADD,
            p.EngineCoreRequest(
                "chatcmpl-é中-1",
                [0, 127, 128, 255, 256, 65535, 65536, 2**31 - 1],
                full,
                1700000001.5,
                priority=-3,
            ),
        ),
        "add_choice": (p.MessageType.ADD, p.EngineCoreRequest("cmpl-2-0", [5, 6], choice, 1700000002.0)),
        "abort": (p.MessageType.ABORT, ["req-0", "chatcmpl-é中-1"]),
        "utility": (p.MessageType.UTILITY, p.UtilityCall(call_id=7, method="reset_prefix_cache", args=[])),
        "ready": (
            p.MessageType.READY,
            p.EngineReady(
                engine_index=0,
                pid=4242,
                model_name="SmolLM2-135M-Instruct",
                max_model_len=8192,
                vocab_size=49152,
                eos_token_ids=[2],
                num_kv_blocks=4096,
                block_size=16,
                dtype="float32",
                max_num_seqs=256,
            ),
        ),
        "outputs": (
            p.MessageType.OUTPUTS,
            p.EngineCoreOutputs(
                engine_index=1,
                outputs=[
                    p.EngineCoreOutput(
                        "req-0",
                        [42],
                        queued_ts=1700000000.5,
                        scheduled_ts=1700000000.625,
                        first_token_ts=1700000000.75,
                    ),
                    p.EngineCoreOutput(
                        "req-1",
                        [7, 8],
                        new_logprobs=[
                            p.TokenLogprobs([7, 7, 9], [-0.5, -0.5, -1.25], 1),
                            p.TokenLogprobs([8, 3, 8], [-2.0, -0.125, -2.0], 2),
                        ],
                        num_cached_tokens=32,
                    ),
                    p.EngineCoreOutput("req-2", [2], finish_reason="stop", stop_reason=2),
                    p.EngineCoreOutput("req-3", [], finish_reason="error", error="prompt is empty"),
                    p.EngineCoreOutput("req-4", [], finish_reason="abort"),
                    p.EngineCoreOutput("req-5", [99], finish_reason="length"),
                    p.EngineCoreOutput(
                        "req-6",
                        [11],
                        prompt_logprobs=[
                            p.TokenLogprobs([20, 20, 4], [-1.5, -1.5, -2.75], 1),
                            p.TokenLogprobs([30, 31, 32], [-4.0, -0.25, -1.0], 3),
                        ],
                    ),
                    p.EngineCoreOutput(
                        "req-7",
                        [],
                        finish_reason="error",
                        error="structured_output: invalid JSON schema: expected value at line 1 column 1",
                    ),
                ],
                scheduler_stats=stats,
                timestamp=1700000001.0,
            ),
        ),
        "outputs_empty": (
            p.MessageType.OUTPUTS,
            p.EngineCoreOutputs(engine_index=0, outputs=[], timestamp=0.0),
        ),
        "utility_result": (p.MessageType.UTILITY_RESULT, p.UtilityResult(call_id=7, ok=True, result=True)),
        "error": (
            p.MessageType.ERROR,
            p.EngineError(engine_index=0, request_id=None, message="malformed ADD payload"),
        ),
        "dead": (
            p.MessageType.DEAD,
            p.EngineError(engine_index=0, request_id=None, message="engine core failed: CUDA out of memory"),
        ),
    }


def meaning(kind: p.MessageType, payload: object) -> dict:
    plain = msgspec.to_builtins(payload, str_keys=True)
    return {"type": kind.name, "type_byte": int(kind), "payload": plain}


def main() -> None:
    GOLDEN_DIR.mkdir(parents=True, exist_ok=True)
    for name, (kind, payload) in vectors().items():
        frames = p.encode(kind, payload)
        (GOLDEN_DIR / f"{name}.msgpack").write_bytes(frames[1])
        (GOLDEN_DIR / f"{name}.json").write_text(
            json.dumps(meaning(kind, payload), indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
        )
        print(f"{name}: {kind.name}, {len(frames[1])} bytes")


if __name__ == "__main__":
    main()
