"""The wire contract between the front end and an EngineCore, as msgspec structs.

`docs/protocol.md` is the specification; this module and `rust/protocol` implement it and are checked
against the golden vectors in `tests/protocol/golden/`. Hot messages are positional arrays, everything
else is a map so that new fields can be added without breaking older peers.

A foundation module: it imports nothing from voltllm, and every layer (`engine/`, `core/`, `worker/`,
the offline API) takes the wire types from here. Class names never reach the bytes, so the two structs
whose user-facing twins share a name carry their own: `EngineSamplingParams` (the user's
`voltllm.SamplingParams` minus what only the front end acts on) and `TokenLogprobs` (the offline API's
`voltllm.outputs.Logprob` is one candidate's entry).
"""

from __future__ import annotations

import enum

import msgspec


class MessageType(enum.IntEnum):
    """First frame of every multipart message."""

    ADD = 0x01
    ABORT = 0x02
    UTILITY = 0x03
    READY = 0x10
    OUTPUTS = 0x11
    UTILITY_RESULT = 0x12
    ERROR = 0x13
    DEAD = 0x14

    def frame(self) -> bytes:
        return bytes([self.value])


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


class StructuredOutputKind(str, enum.Enum):
    """What `StructuredOutput.spec` holds."""

    JSON = "json"  # JSON Schema text
    JSON_OBJECT = "json_object"  # any JSON object; spec is ""
    REGEX = "regex"  # a regular expression the whole output matches
    CHOICE = "choice"  # a JSON array of strings; the output is exactly one of them
    GRAMMAR = "grammar"  # a Lark grammar as llguidance reads it (GBNF is converted by the engine)


class StructuredOutput(msgspec.Struct, kw_only=True):
    """A constraint on the generated tokens, enforced by the engine's grammar matcher (a map)."""

    kind: str
    spec: str = ""
    # JSON kinds only: a regular expression for the whitespace allowed between JSON tokens (None: none).
    whitespace_pattern: str | None = None


class EngineSamplingParams(msgspec.Struct, kw_only=True):
    """Sampling settings of one request, as they travel (validation lives in `voltllm.sampling_params`;
    `SamplingParams.to_wire()` builds one)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    structured_output: StructuredOutput | None = None
    prompt_logprobs: int | None = None


class EngineCoreRequest(msgspec.Struct, array_like=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: EngineSamplingParams
    arrival_time: float
    priority: int = 0


class TokenLogprobs(msgspec.Struct, array_like=True, gc=False):
    """Log-probabilities at one position: the sampled (or, for a prompt position, the prompt's) token
    first, then the top-N alternatives; `rank` is that first token's rank (1 = best)."""

    token_ids: list[int]
    logprobs: list[float]
    rank: int


class EngineCoreOutput(msgspec.Struct, array_like=True, gc=False):
    """One request's news from one step. Untracked by the garbage collector (`gc=False`, no effect on
    the bytes): the engine builds one per running request per step, and none is part of a cycle."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: int | None = None
    error: str | None = None
    num_cached_tokens: int = 0
    queued_ts: float | None = None
    scheduled_ts: float | None = None
    first_token_ts: float | None = None
    # Prompt positions 1..len-1 (position 0 has no context, so no entry), once, on the request's first
    # output that carries tokens; None when the request did not ask for them.
    prompt_logprobs: list[TokenLogprobs] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class SchedulerStats(msgspec.Struct, kw_only=True):
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0


class EngineCoreOutputs(msgspec.Struct, array_like=True):
    engine_index: int
    outputs: list[EngineCoreOutput]
    scheduler_stats: SchedulerStats | None = None
    timestamp: float = 0.0


class EngineReady(msgspec.Struct, kw_only=True):
    engine_index: int
    pid: int
    model_name: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    num_kv_blocks: int
    block_size: int
    dtype: str
    max_num_seqs: int


class UtilityCall(msgspec.Struct, kw_only=True):
    call_id: int
    method: str
    args: list = msgspec.field(default_factory=list)


class UtilityResult(msgspec.Struct, kw_only=True):
    call_id: int
    ok: bool
    result: object = None
    error: str | None = None


class EngineError(msgspec.Struct, kw_only=True):
    engine_index: int
    request_id: str | None = None
    message: str = ""


PAYLOAD_TYPES: dict[MessageType, type] = {
    MessageType.ADD: EngineCoreRequest,
    MessageType.ABORT: list[str],
    MessageType.UTILITY: UtilityCall,
    MessageType.READY: EngineReady,
    MessageType.OUTPUTS: EngineCoreOutputs,
    MessageType.UTILITY_RESULT: UtilityResult,
    MessageType.ERROR: EngineError,
    MessageType.DEAD: EngineError,
}

_encoder = msgspec.msgpack.Encoder()
_decoders = {kind: msgspec.msgpack.Decoder(t) for kind, t in PAYLOAD_TYPES.items()}


def encode(kind: MessageType, payload: object) -> list[bytes]:
    """Frames of one message: `[type byte, msgpack payload]`."""
    return [kind.frame(), _encoder.encode(payload)]


def decode(frames: list[bytes]) -> tuple[MessageType, object]:
    """Inverse of `encode`. Raises `ValueError` on an unknown type or a malformed payload."""
    if len(frames) != 2 or len(frames[0]) != 1:
        raise ValueError(f"expected [type, payload] frames, got {len(frames)} frame(s)")
    try:
        kind = MessageType(frames[0][0])
    except ValueError:
        raise ValueError(f"unknown message type 0x{frames[0][0]:02x}") from None
    try:
        return kind, _decoders[kind].decode(frames[1])
    except msgspec.DecodeError as e:
        raise ValueError(f"malformed {kind.name} payload: {e}") from None
