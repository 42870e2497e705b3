"""The golden wire vectors decode to their documented meaning and re-encode byte for byte."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from voltllm import protocol as p

GOLDEN_DIR = Path(__file__).parent / "golden"
NAMES = sorted(f.stem for f in GOLDEN_DIR.glob("*.msgpack"))


def test_every_message_type_has_a_vector() -> None:
    kinds = {json.loads((GOLDEN_DIR / f"{n}.json").read_text())["type"] for n in NAMES}
    assert kinds == {k.name for k in p.MessageType}


@pytest.mark.parametrize("name", NAMES)
def test_golden_round_trip(name: str) -> None:
    raw = (GOLDEN_DIR / f"{name}.msgpack").read_bytes()
    meaning = json.loads((GOLDEN_DIR / f"{name}.json").read_text(encoding="utf-8"))
    kind = p.MessageType[meaning["type"]]
    assert kind.value == meaning["type_byte"]

    decoded_kind, payload = p.decode([kind.frame(), raw])
    assert decoded_kind is kind
    assert msgspec.to_builtins(payload, str_keys=True) == meaning["payload"]
    assert p.encode(kind, payload) == [kind.frame(), raw]


def test_malformed_frames_raise_value_error() -> None:
    with pytest.raises(ValueError, match="unknown message type"):
        p.decode([b"\x7f", b"\x90"])
    with pytest.raises(ValueError, match="malformed ADD"):
        p.decode([p.MessageType.ADD.frame(), b"\xc1garbage"])
    with pytest.raises(ValueError, match="frame"):
        p.decode([b"\x01"])


def test_sampling_params_map_tolerates_unknown_and_missing_keys() -> None:
    """Maps are forward-compatible: a newer peer's extra field is ignored, a missing one defaults."""
    raw = msgspec.msgpack.encode({"temperature": 0.5, "a_future_field": [1, 2]})
    params = msgspec.msgpack.decode(raw, type=p.EngineSamplingParams)
    assert params.temperature == 0.5 and params.max_tokens == 16


def test_output_from_an_older_peer_reads_prompt_logprobs_as_nil() -> None:
    """`EngineCoreOutput` grew an 11th field; a 10-field array (an older engine) still decodes."""
    raw = msgspec.msgpack.encode(["r", [1], None, None, None, None, 0, None, None, None])
    out = msgspec.msgpack.decode(raw, type=p.EngineCoreOutput)
    assert out.prompt_logprobs is None and out.new_token_ids == [1]


@pytest.mark.parametrize(
    ("update", "message"),
    [
        ({"prompt_logprobs": 21}, "prompt_logprobs must be in"),
        ({"prompt_logprobs": -1}, "prompt_logprobs must be in"),
        ({"structured_output": p.StructuredOutput(kind="yaml", spec="x")}, "structured_output.kind"),
        ({"structured_output": p.StructuredOutput(kind="regex", spec="")}, "structured_output.spec is empty"),
    ],
)
def test_wire_validation_names_the_new_fields(update: dict, message: str) -> None:
    from voltllm.sampling_params import validate_wire_params

    params = msgspec.structs.replace(p.EngineSamplingParams(), **update)
    with pytest.raises(ValueError, match=message):
        validate_wire_params(params)
    validate_wire_params(p.EngineSamplingParams(structured_output=p.StructuredOutput(kind="json_object")))
