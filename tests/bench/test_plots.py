"""Plots and the Python entry of `voltllm bench`, on synthetic results with known shapes."""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import voltllm
from voltllm.bench import cli, plots


def synthetic_result(n: int = 20, ttft: float = 0.2, gap: float = 0.02, chunks: int = 10) -> dict:
    """n requests, one started every 0.5 s, each `chunks` chunks of 2 tokens: TTFT then fixed gaps."""
    itl = [gap] * (chunks - 1)
    lat = ttft + sum(itl)
    return {
        "model_id": "m",
        "dataset_name": "random",
        "request_rate": 2.0,
        "max_concurrency": None,
        "output_throughput": 0.0,
        "request_throughput": 0.0,
        "max_concurrent_requests": 1,
        "ttfts": [ttft] * n,
        "itls": [itl] * n,
        "latencies": [lat] * n,
        "start_times": [0.5 * i for i in range(n)],
        "output_lens": [2 * chunks] * n,
        "input_lens": [8] * n,
        "tpots": [(lat - ttft) / (2 * chunks - 1)] * n,
        "successes": [True] * n,
        "errors": [""] * n,
    }


def test_latency_samples_are_in_ms_and_skip_failures() -> None:
    r = synthetic_result(n=4)
    r["successes"][3] = False
    r["errors"][3] = "HTTP 500"
    s = plots.latency_samples(r)
    assert s["TTFT"].tolist() == pytest.approx([200.0] * 3)
    assert s["ITL"].size == 3 * 9
    assert s["E2E latency"][0] == pytest.approx(200.0 + 9 * 20.0)


def test_timeline_conserves_tokens_and_measures_concurrency() -> None:
    r = synthetic_result(n=20)
    tl = plots.timeline(r)
    # Every output token lands in some bucket.
    assert tl["output_tokens_per_s"].sum() == pytest.approx(20 * 20)
    assert tl["requests_per_s"].sum() == 20
    # Each request is in flight 0.38 s of every 0.5 s: mean concurrency 0.76 in full buckets.
    assert np.median(tl["concurrency"]) == pytest.approx(0.76, abs=1e-9)


def test_plot_result_writes_pngs(tmp_path: Path) -> None:
    path = tmp_path / "run.json"
    path.write_text(json.dumps(synthetic_result()))
    written = plots.plot_file(path, tmp_path / "plots")
    assert [p.name for p in written] == ["run-latency-cdf.png", "run-timeline.png"]
    for p in written:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert p.stat().st_size > 10_000


def test_plot_sweep_writes_curve(tmp_path: Path) -> None:
    runs = [
        {
            "max_concurrency": c,
            "output_throughput": 100.0 * c,
            "mean_ttft_ms": 10.0 * c,
            "p99_ttft_ms": 20.0 * c,
            "mean_tpot_ms": 5.0,
            "p99_tpot_ms": 6.0,
            "model_id": "m",
        }
        for c in (1, 2, 4)
    ]
    path = tmp_path / "x-sweep.json"
    path.write_text(
        json.dumps({"sweep_parameter": "max_concurrency", "sweep_values": [1, 2, 4], "runs": runs})
    )
    (out,) = plots.plot_file(path, tmp_path)
    assert out.name == "x-sweep.png" and out.stat().st_size > 10_000


def test_plot_rejects_other_json(tmp_path: Path) -> None:
    path = tmp_path / "other.json"
    path.write_text("[1, 2]")
    assert cli.main(["plot", str(path)]) == 1


def test_serve_passes_flags_and_plots(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`serve` forwards harness flags, asks for a result file, then plots it.

    A stand-in harness (a script that records its argv and writes a result) replaces the binary, so
    this checks the wrapper's contract without a server.
    """
    record = tmp_path / "argv.json"
    fake = tmp_path / "voltllm-bench"
    fake.write_text(
        f"#!{sys.executable}\n"
        "import json, sys, pathlib\n"
        f"pathlib.Path({str(record)!r}).write_text(json.dumps(sys.argv[1:]))\n"
        "a = sys.argv\n"
        "d = pathlib.Path(a[a.index('--result-dir') + 1])\n"
        "f = a[a.index('--result-filename') + 1]\n"
        f"d.joinpath(f).write_text({json.dumps(json.dumps(synthetic_result()))})\n"
    )
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("VOLTLLM_BENCH_BIN", str(fake))
    monkeypatch.setitem(sys.modules, "voltllm._core", None)  # force the subprocess path
    code = cli.main(
        ["serve", "--base-url", "http://x", "--result-dir", str(tmp_path), "--plot-dir", str(tmp_path / "p")]
    )
    assert code == 0
    argv = json.loads(record.read_text())
    assert argv[:3] == ["serve", "--base-url", "http://x"]
    assert "--save-result" in argv and "--plot-dir" not in argv
    name = argv[argv.index("--result-filename") + 1]
    assert (tmp_path / "p" / name.replace(".json", "-latency-cdf.png")).is_file()


def test_missing_harness_is_one_clear_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.delenv("VOLTLLM_BENCH_BIN", raising=False)
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.setenv("CARGO_TARGET_DIR", "/nonexistent")
    monkeypatch.setitem(sys.modules, "voltllm._core", None)
    # An already imported extension is also an attribute of the package, which `from voltllm import
    # _core` would find first.
    monkeypatch.delattr(voltllm, "_core", raising=False)
    if (Path(cli.__file__).resolve().parents[3] / "target").exists():
        pytest.skip("a repo-local target/ folder provides a harness")
    assert cli.main(["serve", "--no-plot"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "voltllm-bench harness is not available" in err[0]


def test_usage_errors() -> None:
    assert cli.main([]) == 2
    assert cli.main(["frobnicate"]) == 2


def _wait_listening(port: int, proc: subprocess.Popen, timeout: float = 60) -> None:
    """Until something accepts connections on 127.0.0.1:`port` (`proc` must not exit first)."""
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, "the mock server exited"
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            assert time.monotonic() < deadline, "the mock server never listened"
            time.sleep(0.1)


def _built(name: str) -> Path | None:
    root = Path(os.environ.get("CARGO_TARGET_DIR", Path(__file__).resolve().parents[2] / "target"))
    for profile in ("release-tests", "release", "debug"):  # release-tests: tools/test.sh's cargo test
        if (root / profile / name).is_file():
            return root / profile / name
    return None


@pytest.mark.slow
def test_end_to_end_against_mock_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The real harness against the mock server: JSON with the measured delays, and the plots."""
    harness, mock_bin = _built("voltllm-bench"), _built("examples/mock_server")
    if harness is None or mock_bin is None:
        pytest.skip("build with: cargo build -p voltllm-bench --bins --examples")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mock = subprocess.Popen(
        [str(mock_bin), "--port", str(port), "--ttft-ms", "100", "--tpot-ms", "10"], stderr=subprocess.DEVNULL
    )
    try:
        _wait_listening(port, mock)
        monkeypatch.setenv("VOLTLLM_BENCH_BIN", str(harness))
        monkeypatch.setitem(sys.modules, "voltllm._core", None)
        tok = Path(__file__).resolve().parents[1] / "fixtures/smollm2/tokenizer.json"
        code = cli.main(
            ["serve", "--base-url", f"http://127.0.0.1:{port}", "--tokenizer", str(tok), "--num-prompts", "8",
             "--max-concurrency", "4", "--random-input-len", "16", "--random-output-len", "11",
             "--result-dir", str(tmp_path), "--result-filename", "e2e.json", "--disable-tqdm"]
        )  # fmt: skip
    finally:
        mock.terminate()
        mock.wait()
    assert code == 0
    r = json.loads((tmp_path / "e2e.json").read_text())
    assert r["completed"] == 8 and r["total_output_tokens"] == 88
    # The mock's tokens leave at absolute deadlines (100 ms, then every 10 ms): never early, but a loaded
    # machine wakes it late by milliseconds, which a 10% window did not allow for. A unit error (s for ms)
    # or TTFT counted into TPOT still lands far outside.
    assert 100 * 0.98 <= r["mean_ttft_ms"] <= 100 * 1.5, r["mean_ttft_ms"]
    assert 10 * 0.9 <= r["mean_tpot_ms"] <= 10 * 1.5, r["mean_tpot_ms"]
    assert (tmp_path / "e2e-latency-cdf.png").is_file() and (tmp_path / "e2e-timeline.png").is_file()
