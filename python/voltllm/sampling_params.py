"""User-facing sampling settings and the one validation function shared with the engine.

`SamplingParams` uses vLLM's field names. Fields that only the front end acts on (`n`, `stop`,
`include_stop_str_in_output`, `skip_special_tokens`) stay here; `to_wire()` keeps the rest, as the
protocol struct that crosses to the engine. The engine calls `validate_wire_params` again on every
incoming request, so a bad value sent over the wire fails that request instead of the engine.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from voltllm.protocol import EngineSamplingParams, StructuredOutput, StructuredOutputKind

MAX_LOGPROBS = 20
_FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)
_SEED_MIN = -(2**63)
_SEED_MAX = 2**64 - 1  # the range torch.Generator.manual_seed accepts


def _check_float(name: str, value: float, lo: float, hi: float, *, lo_open: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    below = value <= lo if lo_open else value < lo
    if below or value > hi:
        left = "(" if lo_open else "["
        raise ValueError(f"{name} must be in {left}{lo}, {hi}], got {value}")


def _check_int(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")


def _check_token_id(name: str, token_id: int, vocab_size: int | None) -> None:
    _check_int(name, token_id)
    if token_id < 0 or (vocab_size is not None and token_id >= vocab_size):
        bound = f"[0, {vocab_size})" if vocab_size is not None else ">= 0"
        raise ValueError(f"{name} contains token id {token_id}, outside the vocabulary {bound}")


def validate_wire_params(params: EngineSamplingParams, vocab_size: int | None = None) -> None:
    """Check every field against the ranges in docs/protocol.md; raise `ValueError` naming the field.

    `vocab_size` (known to the engine, not always to the user) also bounds token ids.
    """
    _check_float("temperature", params.temperature, 0.0, math.inf)
    _check_float("top_p", params.top_p, 0.0, 1.0, lo_open=True)
    _check_int("top_k", params.top_k)
    if params.top_k < -1:
        raise ValueError(f"top_k must be 0 or -1 (off) or >= 1, got {params.top_k}")
    _check_float("min_p", params.min_p, 0.0, 1.0)
    _check_float("presence_penalty", params.presence_penalty, -2.0, 2.0)
    _check_float("frequency_penalty", params.frequency_penalty, -2.0, 2.0)
    _check_float("repetition_penalty", params.repetition_penalty, 0.0, math.inf, lo_open=True)
    if params.seed is not None:
        _check_int("seed", params.seed)
        if not _SEED_MIN <= params.seed <= _SEED_MAX:
            raise ValueError(f"seed must fit in 64 bits, got {params.seed}")
    _check_int("max_tokens", params.max_tokens)
    if params.max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {params.max_tokens}")
    _check_int("min_tokens", params.min_tokens)
    if not 0 <= params.min_tokens <= params.max_tokens:
        raise ValueError(
            f"min_tokens must be in [0, max_tokens={params.max_tokens}], got {params.min_tokens}"
        )
    for token_id in params.stop_token_ids:
        _check_token_id("stop_token_ids", token_id, vocab_size)
    if not isinstance(params.ignore_eos, bool):
        raise ValueError(f"ignore_eos must be a boolean, got {params.ignore_eos!r}")
    if params.logprobs is not None:
        _check_int("logprobs", params.logprobs)
        if not 0 <= params.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {params.logprobs}")
    if params.logit_bias is not None:
        for token_id, bias in params.logit_bias.items():
            _check_token_id("logit_bias", token_id, vocab_size)
            _check_float(f"logit_bias[{token_id}]", bias, -100.0, 100.0)
    if params.prompt_logprobs is not None:
        _check_int("prompt_logprobs", params.prompt_logprobs)
        if not 0 <= params.prompt_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {params.prompt_logprobs}")
    if params.structured_output is not None:
        _check_structured_output(params.structured_output)


def _check_structured_output(constraint: StructuredOutput) -> None:
    """The shape of a constraint; whether its spec compiles is the grammar engine's to say."""
    kinds = [k.value for k in StructuredOutputKind]
    if constraint.kind not in kinds:
        raise ValueError(f"structured_output.kind must be one of {', '.join(kinds)}; got {constraint.kind!r}")
    if not isinstance(constraint.spec, str):
        raise ValueError(f"structured_output.spec must be a string, got {constraint.spec!r}")
    if constraint.kind != StructuredOutputKind.JSON_OBJECT.value and not constraint.spec:
        raise ValueError(f"structured_output.spec is empty; a {constraint.kind!r} constraint needs one")
    pattern = constraint.whitespace_pattern
    if pattern is not None:
        if not isinstance(pattern, str):
            raise ValueError(f"structured_output.whitespace_pattern must be a string, got {pattern!r}")
        json_kinds = (StructuredOutputKind.JSON.value, StructuredOutputKind.JSON_OBJECT.value)
        if constraint.kind not in json_kinds:
            raise ValueError(
                "structured_output.whitespace_pattern applies to json and json_object constraints, "
                f"not {constraint.kind!r}"
            )


@dataclass
class StructuredOutputsParams:
    """One constraint on the output, as vLLM's `StructuredOutputsParams` spells it: set exactly one of
    `json` (a JSON Schema, as a dict or its text), `regex`, `choice` (strings), `grammar` (Lark, or
    GBNF) or `json_object=True` (any JSON object). With `json` or `json_object`, `whitespace_pattern`
    (a regular expression) is the whitespace allowed between JSON tokens; without it the output is
    compact JSON. Raises `ValueError` otherwise."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    whitespace_pattern: str | None = None

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        if self.json_object:
            given.append("json_object")
        if len(given) != 1:
            which = ", ".join(given) if given else "none"
            raise ValueError(
                "structured_outputs takes exactly one of json, regex, choice, grammar, json_object; "
                f"got {which}"
            )
        self.to_wire()

    def to_wire(self) -> StructuredOutput:
        """The wire constraint (validated for shape; whether it compiles is the engine's to say)."""
        if self.json is not None:
            spec = self.json if isinstance(self.json, str) else json.dumps(self.json)
            constraint = StructuredOutput(kind=StructuredOutputKind.JSON.value, spec=spec)
        elif self.regex is not None:
            constraint = StructuredOutput(kind=StructuredOutputKind.REGEX.value, spec=self.regex)
        elif self.choice is not None:
            if isinstance(self.choice, str) or not all(isinstance(c, str) for c in self.choice):
                raise ValueError(f"structured_outputs.choice must be a list of strings, got {self.choice!r}")
            spec = json.dumps(self.choice)
            constraint = StructuredOutput(kind=StructuredOutputKind.CHOICE.value, spec=spec)
        elif self.grammar is not None:
            constraint = StructuredOutput(kind=StructuredOutputKind.GRAMMAR.value, spec=self.grammar)
        else:
            constraint = StructuredOutput(kind=StructuredOutputKind.JSON_OBJECT.value, spec="")
        constraint.whitespace_pattern = self.whitespace_pattern
        _check_structured_output(constraint)
        return constraint


@dataclass
class SamplingParams:
    """How to sample one completion. Raises `ValueError` naming the field on an invalid value.

    `temperature == 0` means greedy. `top_k` 0 or -1 and `top_p == 1` disable those filters.
    `stop` strings, `n`, `include_stop_str_in_output` and `skip_special_tokens` are applied by the
    front end / detokenizer; the engine sees only token ids.
    """

    n: int = 1
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
    stop: list[str] | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        _check_int("n", self.n)
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is not None:
            if not all(isinstance(s, str) for s in self.stop):
                raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
            if any(s == "" for s in self.stop):
                raise ValueError("stop must not contain the empty string")
        self.stop_token_ids = list(self.stop_token_ids)
        # The wire encodes these as float64 whatever the user typed (1 vs 1.0); bools stay invalid.
        for name in _FLOAT_FIELDS:
            value = getattr(self, name)
            if isinstance(value, int) and not isinstance(value, bool):
                setattr(self, name, float(value))
        if self.logit_bias is not None:
            # JSON object keys arrive as strings; accept "123" the way OpenAI's API does.
            try:
                self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            except (TypeError, ValueError):
                msg = f"logit_bias must map token ids to numbers, got {self.logit_bias!r}"
                raise ValueError(msg) from None
        constraint = self.structured_outputs
        if constraint is not None and not isinstance(constraint, StructuredOutputsParams):
            kind = type(constraint).__name__
            raise ValueError(f"structured_outputs must be a StructuredOutputsParams, got {kind}")
        validate_wire_params(self.to_wire())

    def to_wire(self) -> EngineSamplingParams:
        """The engine-facing part of these settings (what travels in `EngineCoreRequest`)."""
        return EngineSamplingParams(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            seed=self.seed,
            max_tokens=self.max_tokens,
            min_tokens=self.min_tokens,
            stop_token_ids=list(self.stop_token_ids),
            ignore_eos=self.ignore_eos,
            logprobs=self.logprobs,
            logit_bias=dict(self.logit_bias) if self.logit_bias is not None else None,
            structured_output=None if self.structured_outputs is None else self.structured_outputs.to_wire(),
            prompt_logprobs=self.prompt_logprobs,
        )
