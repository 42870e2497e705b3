"""Command line of `voltllm bench`.

    voltllm bench serve [HARNESS FLAGS] [--plot-dir DIR] [--no-plot]
    voltllm bench plot RESULT.json [--plot-dir DIR]

`serve` hands every flag except the two plot flags to the Rust harness unchanged (see
`voltllm-bench serve --help` or docs/bench.md), making sure a result file is written, then draws the
plots next to it. `plot` redraws them from a saved result or sweep file.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from voltllm.bench import plots

USAGE = __doc__


class HarnessNotFound(RuntimeError):
    """Neither the pyo3 extension nor a `voltllm-bench` binary is available."""


def find_harness_binary() -> Path:
    """Where the standalone harness is: $VOLTLLM_BENCH_BIN, PATH, or a cargo target folder."""
    env = os.environ.get("VOLTLLM_BENCH_BIN")
    if env:
        return Path(env)
    on_path = shutil.which("voltllm-bench")
    if on_path:
        return Path(on_path)
    roots = [Path(os.environ["CARGO_TARGET_DIR"])] if os.environ.get("CARGO_TARGET_DIR") else []
    roots.append(Path(__file__).resolve().parents[3] / "target")
    for root in roots:
        for profile in ("release", "debug"):
            candidate = root / profile / "voltllm-bench"
            if candidate.is_file():
                return candidate
    raise HarnessNotFound(
        "the voltllm-bench harness is not available: install the voltllm wheel, or build it with "
        "`cargo build --release -p voltllm-bench` and put it on PATH (or set VOLTLLM_BENCH_BIN)"
    )


def run_harness(argv: Sequence[str]) -> int:
    """Runs `voltllm-bench serve ARGV...` and returns its exit code.

    A binary named by $VOLTLLM_BENCH_BIN wins (to run a freshly built harness); otherwise in-process
    through the extension (`voltllm._core.bench_main`, the crate's `run_cli` with the GIL released)
    when it is built, else as a subprocess of the standalone binary.
    """
    if os.environ.get("VOLTLLM_BENCH_BIN"):
        return subprocess.run([os.environ["VOLTLLM_BENCH_BIN"], "serve", *argv], check=False).returncode
    try:
        from voltllm import _core  # type: ignore[attr-defined]

        bench_main = getattr(_core, "bench_main", None)
    except ImportError:
        bench_main = None
    if bench_main is not None:
        return int(bench_main(["serve", *argv]))
    binary = find_harness_binary()
    return subprocess.run([str(binary), "serve", *argv], check=False).returncode


def _serve(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print("Plot flags (handled by python): --plot-dir DIR (default: next to the result), --no-plot\n")
        return run_harness(argv)
    own = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    own.add_argument("--plot-dir", type=Path, default=None)
    own.add_argument("--no-plot", action="store_true")
    opts, rest = own.parse_known_args(argv)
    # Read (not consume) the harness flags that decide where results land.
    peek = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    peek.add_argument("--result-dir", type=Path, default=None)
    peek.add_argument("--result-filename", default=None)
    peek.add_argument("--save-result", action="store_true")
    peek.add_argument("--sweep", default=None)
    seen, _ = peek.parse_known_args(rest)
    harness_argv = list(rest)
    if not opts.no_plot or seen.save_result:
        if not seen.save_result:
            harness_argv.append("--save-result")
        if seen.result_filename is None:
            seen.result_filename = f"bench-{time.strftime('%Y%m%d-%H%M%S')}.json"
            harness_argv += ["--result-filename", seen.result_filename]
    code = run_harness(harness_argv)
    if code != 0 or opts.no_plot:
        return code
    result_dir = seen.result_dir or Path(".")
    stem = seen.result_filename.removesuffix(".json")
    path = result_dir / (f"{stem}-sweep.json" if seen.sweep else seen.result_filename)
    return _plot(path, opts.plot_dir)


def _plot(path: Path, plot_dir: Path | None) -> int:
    try:
        written = plots.plot_file(path, plot_dir or path.parent)
    except (OSError, ValueError, KeyError) as e:
        print(f"error: cannot plot {path}: {e}", file=sys.stderr)
        return 1
    for p in written:
        print(f"Plot saved to {p}", file=sys.stderr)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `voltllm bench` and `python -m voltllm.bench`; returns the exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if args else 2
    command, rest = args[0], args[1:]
    try:
        if command == "serve":
            return _serve(rest)
        if command == "plot":
            p = argparse.ArgumentParser(prog="voltllm bench plot")
            p.add_argument("result", type=Path, help="result or sweep JSON written by `serve`")
            p.add_argument("--plot-dir", type=Path, default=None)
            a = p.parse_args(rest)
            return _plot(a.result, a.plot_dir)
    except HarnessNotFound as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"error: unknown bench command '{command}' (use serve or plot)", file=sys.stderr)
    return 2
