"""`GET /openapi.json` (issue 22) probed by schemathesis: requests generated from the description,
sent to `voltllm serve` (the real engine on a tiny random Llama with the SmolLM2 tokenizer, so each
generation takes milliseconds), and every answer checked: no 5xx, only documented status codes and
content types, every body valid against its schema. Bounded in examples and time."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from voltllm_cli import serving, tiny_llama

pytestmark = pytest.mark.slow

CHECKS = "not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance"
MODEL = "tiny"
# `GET /v1/models/{id}` probed with the served name too, not only with names that 404.
CONFIG = f"""
[[operations]]
include-path = "/v1/models/{{id}}"
parameters = {{ id = "{MODEL}" }}
"""
GENERATING = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
# Each generating route gets its own run and time budget (a slow one would spend a shared budget);
# the other routes share one. Seconds of generation each (schemathesis stops when they are spent).
RUNS = [(["--include-path", path], 15) for path in GENERATING] + [
    ([arg for path in GENERATING for arg in ("--exclude-path", path)], 10)
]
# schemathesis's clock includes building the cases: on a loaded machine (session 10, load 5-14 on 2
# cores) a 15 s budget ran out before the coverage phase had sent one case. A run that its time limit
# stopped short (an operation untested, or nothing the server accepted) runs again with this many times
# the budget, twice at most; a failure or an error is never run again.
BUDGET_GROWTH = 4
BUDGET_ATTEMPTS = 3


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    model = tiny_llama(tmp_path_factory.mktemp("openapi_model"))
    args = ("--served-model-name", MODEL, "--max-model-len", "128", "--num-kv-blocks", "512")
    with serving(str(model), *args) as (_, base):
        yield base


def test_the_description_is_openapi_3_1_and_covers_the_routes(server: str) -> None:
    doc = httpx.get(f"{server}/openapi.json").json()
    assert doc["openapi"].startswith("3.1")
    paths = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/models/{id}", "/health", "/")
    for path in paths:
        assert path in doc["paths"], path
    chat = doc["components"]["schemas"]["ChatRequest"]
    assert chat["additionalProperties"] is False and "messages" in chat["properties"]


def _schemathesis(server: str, tmp_path: Path, selection: list[str], seconds: int) -> dict:
    """One schemathesis run over `selection` with a `seconds` budget; its JSON report. A non-zero exit
    fails here (with the run's output)."""
    report = tmp_path / f"report-{seconds}s.json"
    config = tmp_path / "schemathesis.toml"
    config.write_text(CONFIG)
    # One worker: hypothesis describes strategies with `ast.parse`, which CPython 3.11 does not run
    # safely from two threads ("AST constructor recursion depth mismatch"). The request timeout only
    # catches a hung request: a tiny model's longest answer (128 tokens) takes well under a second.
    command = [
        sys.executable, "-m", "schemathesis.cli", "--config-file", str(config),
        "run", f"{server}/openapi.json", *selection,
        "--checks", CHECKS, "--max-examples", "20", "--max-time", str(seconds), "--seed", "22",
        "--phases", "examples,coverage,fuzzing", "--request-timeout", "60", "--workers", "1",
        "--suppress-health-check", "too_slow,data_too_large",
        "--report", "json", "--report-json-path", str(report),
    ]  # fmt: skip
    run = subprocess.run(command, capture_output=True, text=True, timeout=seconds + 120)
    print(run.stdout[-3000:])  # the run's summary (shown with -s)
    assert run.returncode == 0, run.stdout[-12000:] + run.stderr[-2000:]
    return json.loads(report.read_text())


def _accepted(summary: dict) -> int:
    """Requests the routes accepted (not a 4xx), over every operation and phase."""
    return sum(
        phase.get("accepted", 0) for rates in summary["valid_rates"].values() for phase in rates.values()
    )


def _cut_short(summary: dict) -> bool:
    """Whether the time limit stopped the run before it tested every operation or had one accepted."""
    operations = summary["operations"]
    ran_enough = operations["tested"] == operations["selected"] and _accepted(summary) > 0
    return summary["stop_reason"] == "max_time" and not ran_enough


@pytest.mark.parametrize(("selection", "seconds"), RUNS, ids=[*GENERATING, "the other routes"])
def test_schemathesis_finds_no_server_error_and_no_answer_off_schema(
    server: str, tmp_path: Path, selection: list[str], seconds: int
) -> None:
    for attempt in range(BUDGET_ATTEMPTS):
        summary = _schemathesis(server, tmp_path, selection, seconds * BUDGET_GROWTH**attempt)
        assert summary["failures"] == [] and summary["errors"] == [], summary
        if not _cut_short(summary):
            break
    operations = summary["operations"]
    assert operations["tested"] == operations["selected"] > 0, operations
    # Requests the route accepted, not only 400s: the engine generated for some.
    assert _accepted(summary) > 0, summary["valid_rates"]
