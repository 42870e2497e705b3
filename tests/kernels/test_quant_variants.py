"""The quantized kernels' instantiations agree in the three places that name them: the sm_70 gate's list
(`voltllm/ops/variants.py`), the torch glue's dispatch (`csrc/torch_glue/ops_quant.cu`) and the Python
face's kind numbers (`voltllm/ops/quantized_linear.py`, `QuantKind` in quant_common.cuh)."""

from __future__ import annotations

import re
from pathlib import Path

from voltllm.ops import quantized_linear, variants

CSRC = Path(__file__).resolve().parents[2] / "csrc"


def _function(text: str, signature: str) -> str:
    body = text[text.index(signature) :]
    return body[: body.index("\n}\n")]


def _dispatches(glue: str, argument: str) -> set[tuple[str, ...]]:
    """The value lists of the glue's `dispatch_built<...>(argument, ...)` calls."""
    found = re.findall(rf"dispatch_built<([\w, ]+)>\({argument},", glue)
    return {tuple(v.strip() for v in values.split(",")) for values in found}


def _dispatched(glue: str, argument: str) -> tuple[str, ...]:
    """The values every `dispatch_built<...>(argument, ...)` of the glue instantiates (all must agree)."""
    found = _dispatches(glue, argument)
    assert len(found) == 1, f"{argument}: dispatched as {found}"
    return found.pop()


def test_glue_dispatches_what_the_gate_checks() -> None:
    glue = (CSRC / "torch_glue" / "ops_quant.cu").read_text()
    rows = _function(glue, "void dispatch_gemv_rows")
    assert (
        tuple(int(r) for r in re.findall(r"integral_constant<int, (\d+)>", rows)) == variants.QUANT_GEMV_ROWS
    )
    assert tuple(map(int, _dispatched(glue, "block_m"))) == variants.QUANT_GEMM_BLOCK_M
    assert tuple(map(int, _dispatched(glue, "m_frags"))) == variants.QUANT_STREAM_M_FRAGS
    assert tuple(map(int, _dispatched(glue, "n_frags"))) == variants.QUANT_STREAM_N_FRAGS
    assert _dispatched(glue, "index") == tuple(str(i) for i in range(variants.QUANT_GEMV_ONE_ROW_SHAPES))
    assert f"kQuantGemvOneRowShapes == {variants.QUANT_GEMV_ONE_ROW_SHAPES}" in glue
    header = (CSRC / "quantization" / "quant_gemv.cuh").read_text()
    built = re.findall(r"struct QuantGemvOneRowShape<(\d+)>", header)
    assert built == [str(i) for i in range(variants.QUANT_GEMV_ONE_ROW_SHAPES)]
    assert f"kQuantGemvOneRowShapes = {variants.QUANT_GEMV_ONE_ROW_SHAPES};" in header
    assert quantized_linear.GEMV_ONE_ROW_SHAPES == variants.QUANT_GEMV_ONE_ROW_SHAPES
    kinds = _function(glue, "void dispatch_quant_kind")
    assert re.findall(r"dispatch_built<([\w, ]+)>", kinds) == ["kQuantInt4, kQuantInt8, kQuantFp8"]


def test_kind_numbers_are_one_definition() -> None:
    header = (CSRC / "quantization" / "quant_common.cuh").read_text()
    numbers = dict(re.findall(r"(kQuant\w+) = (\d+),", header))
    assert numbers == {"kQuantInt4": "0", "kQuantInt8": "1", "kQuantFp8": "2"}
    python = {
        "int4": quantized_linear.KIND_INT4,
        "int8": quantized_linear.KIND_INT8,
        "fp8": quantized_linear.KIND_FP8,
    }
    assert python == variants.QUANT_KINDS
    assert (
        quantized_linear.GEMV_DISPATCH_MAX_ROWS
        <= quantized_linear.GEMV_MAX_ROWS
        == max(variants.QUANT_GEMV_ROWS)
    )
