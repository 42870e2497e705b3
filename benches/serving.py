"""Serving through the Rust front end and ZeroMQ, against the offline engine, in one run (issue #7 item 3).

Targets: output throughput at saturation >= 0.90 of the offline figure for the same workload; median
time to first token for 512-token prompts at low load <= 25 ms.

What it does, in order:

1. Writes a model folder: the config (Qwen3-0.6B shape, or a 4-layer Qwen3 with `--tiny`) with dummy
   weights, and the embedded default model's (SmolLM2) tokenizer, from tests/fixtures/smollm2 (nothing
   is fetched, and the default model's package need not be installed). Qwen3's 151 936 embedding rows
   outnumber SmolLM2's 49 152 tokens, and the front end rejects ids the tokenizer does not know (a
   deliberate rule, docs/text.md), which dummy weights sample all the time. So the served folder's
   tokenizer is padded with plain vocabulary entries `Ġ<ID>` (decoding to " <ID>") up to the
   config's vocabulary: the model keeps Qwen3's exact shape, and since no merge produces them,
   encoding is unchanged. The tiny config's 4096 rows are raised to the tokenizer's 49 152 instead,
   so the prompts' ids stay inside the embedding.
2. Starts `voltllm serve DIR --load-format dummy` with the engine flags given here, waits for /health.
3. Saturation: the load tester (`voltllm bench serve`) sends all `--num-seqs` requests at once
   (`--max-concurrency` = their number), random prompts, input and output lengths uniform in
   [min_len, max_len], ignore_eos, greedy; after as many warm-up requests, which open the connections
   the measured run reuses (docs/bench.md). Checks from the server's /metrics delta that every request
   stopped at its length and that the token counts agree with the harness's.
4. Low load: 512-token prompts, a few output tokens, one request in flight: median TTFT.
5. Stops the server (SIGTERM, also on error or interrupt), then runs the offline engine in this
   process on the same input and output lengths as the measured saturation run, with the same
   engine config (both built from the one set of flags below), and prints the table.

    python benches/serving.py                                          # GPU: Qwen3-0.6B shape, 256 seqs
    python benches/serving.py --tiny --num-seqs 16 --min-len 32 --max-len 64 --ttft-num-prompts 8   # CPU

Engine flags (`--dtype`, `--max-num-seqs` 256, `--max-num-batched-tokens` 8192, `--enforce-eager`,
`--num-kv-blocks`, `--cpu-threads`, ...) are those of `voltllm serve`; `--max-model-len` defaults to
4096 (as nano-vllm's benchmark and offline_throughput.py) and `--cpu-threads` to the cores minus one
(as `voltllm serve` does), for both runs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from model_shapes import QWEN3_0_6B, TINY
from offline_throughput import hardware, time_offline_run

from voltllm.engine.args import add_engine_args, engine_config_from_args, to_argv
from voltllm.engine.core import resolve_device, resolve_dtype
from voltllm.engine.llm_engine import LLMEngine

SERVED_NAME = "bench-model"
SMOLLM2_TOKENIZER = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "smollm2"
RATIO_TARGET = 0.90
TTFT_TARGET_MS = 25.0


# ----- model folder --------------------------------------------------------------------------------


def tokenizer_size(tokenizer: dict[str, Any]) -> int:
    """One past the largest id of a `tokenizer.json`, added tokens included."""
    ids = list(tokenizer["model"]["vocab"].values()) + [t["id"] for t in tokenizer["added_tokens"]]
    return max(ids) + 1


def pad_tokenizer(tokenizer: dict[str, Any], vocab_size: int) -> dict[str, Any]:
    """A copy of a byte-level BPE `tokenizer.json` whose vocabulary reaches `vocab_size` ids.

    The new entries are ordinary tokens (not added/special ones, which the detokenizer may skip and
    the encoder would have to match), written in the byte-level alphabet: `Ġ` is a space, ASCII
    digits and brackets are themselves.
    """
    if tokenizer["model"]["type"] != "BPE" or (tokenizer.get("decoder") or {}).get("type") != "ByteLevel":
        raise ValueError("padding is written for byte-level BPE tokenizers")
    vocab = dict(tokenizer["model"]["vocab"])
    for i in range(tokenizer_size(tokenizer), vocab_size):
        token = f"Ġ<{i}>"
        if token in vocab:
            raise ValueError(f"padding token {token!r} is already in the vocabulary")
        vocab[token] = i
    return {**tokenizer, "model": {**tokenizer["model"], "vocab": vocab}}


def write_model_dir(model_dir: Path, shape: dict[str, Any], tokenizer_dir: Path) -> dict[str, Any]:
    """Writes config.json and a tokenizer covering every row of the embedding; returns the config."""
    tokenizer = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    config = {**shape, "vocab_size": max(shape["vocab_size"], tokenizer_size(tokenizer))}
    (model_dir / "config.json").write_text(json.dumps(config))
    padded = pad_tokenizer(tokenizer, config["vocab_size"])
    (model_dir / "tokenizer.json").write_text(json.dumps(padded, ensure_ascii=False))
    (model_dir / "tokenizer_config.json").write_bytes((tokenizer_dir / "tokenizer_config.json").read_bytes())
    return config


# ----- load tester ---------------------------------------------------------------------------------


def _harness_bounds(length: int, ratio: float) -> tuple[int, int]:
    # The harness's rule for `--random-range-ratio` (rust/bench/src/dataset.rs, sample_len).
    lo = max(math.floor(length * (1.0 - ratio)), 1)
    return lo, max(math.ceil(length * (1.0 + ratio)), lo)


def length_flags(min_len: int, max_len: int) -> tuple[int, float]:
    """`--random-*-len L --random-range-ratio R` whose lengths are uniform in exactly [min_len, max_len]."""
    if not 1 <= min_len <= max_len:
        raise ValueError(f"need 1 <= min_len <= max_len, got [{min_len}, {max_len}]")
    length = (min_len + max_len) // 2
    exact = (length - min_len) / length
    for ratio in (exact, exact - 1e-9, exact + 1e-9):
        if 0.0 <= ratio < 1.0 and _harness_bounds(length, ratio) == (min_len, max_len):
            return length, ratio
    raise ValueError(
        f"the harness draws lengths in [L(1-r), L(1+r)]: [{min_len}, {max_len}] is not such a range "
        "(make min_len + max_len even)"
    )


def run_harness(url: str, tokenizer: Path, result: Path, flags: list[str]) -> dict[str, Any]:
    """Runs the load tester (`voltllm bench serve` without plots) against `url` in a subprocess and
    returns the result JSON it wrote."""
    # The Rust harness through the extension, as `voltllm bench serve` runs it, but without importing
    # the plotting package (matplotlib may be missing on a GPU machine).
    harness = "import sys; from voltllm import _core; sys.exit(_core.bench_main(sys.argv[1:]))"
    cmd = [
        sys.executable, "-c", harness, "serve", "--base-url", url, "--model", SERVED_NAME,
        "--tokenizer", str(tokenizer), "--dataset-name", "random", "--ignore-eos", "--temperature", "0",
        "--save-result", "--result-dir", str(result.parent), "--result-filename", result.name,
        "--disable-tqdm", *flags,
    ]  # fmt: skip
    print("$ voltllm bench " + " ".join(cmd[3:]), flush=True)
    subprocess.run(cmd, check=True)
    return json.loads(result.read_text())


def _metric(delta: dict[str, float], name: str, **labels: str) -> float:
    """Sum of the series of `name` (`_total` suffix or not) whose labels include `labels`."""
    total = 0.0
    for key, value in delta.items():
        base, _, rest = key.partition("{")
        if base.removesuffix("_total") == name and all(f'{k}="{v}"' in rest for k, v in labels.items()):
            total += value
    return total


def check_saturation(result: dict[str, Any], num: int, min_len: int, max_len: int) -> None:
    """Every request completed with lengths in range, stopped at its max_tokens, and the server
    counted the same tokens as the harness. Raises `RuntimeError` otherwise."""
    problems = []
    if result["completed"] != num or result["failed"] != 0:
        problems.append(f"{result['completed']} of {num} completed: {result['failure_reasons']}")
    for key in ("input_lens", "output_lens"):
        outside = [n for n in result[key] if not min_len <= n <= max_len]
        if outside:
            problems.append(f"{len(outside)} {key} outside [{min_len}, {max_len}], e.g. {outside[0]}")
    server = result.get("server_metrics")
    if server is None:
        problems.append("no /metrics delta: cannot check that outputs had their exact length")
    else:
        # Not the harness's `delta`: it keeps only series present before the run, and a labelled
        # counter (finished_reason="length") is born at its first increment, i.e. without warm-ups
        # during the measured run. A new series counts from 0.
        before = server["before"]
        delta = {k: v - before.get(k, 0.0) for k, v in server["after"].items()}
        stopped_at_length = _metric(delta, "vllm:request_success", finished_reason="length")
        checks = [
            ("requests stopped at max_tokens", stopped_at_length, num),
            ("server output tokens", _metric(delta, "vllm:generation_tokens"), result["total_output_tokens"]),
            ("server prompt tokens", _metric(delta, "vllm:prompt_tokens"), result["total_input_tokens"]),
        ]
        problems += [f"{what}: {got:g}, expected {want}" for what, got, want in checks if got != want]
    if problems:
        raise RuntimeError("saturation run is not the intended workload: " + "; ".join(problems))


# ----- server --------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model_dir: Path, engine_args: argparse.Namespace, port: int, log: Path) -> subprocess.Popen:
    """`voltllm serve` in its own session (so a forced stop can take the engine with it)."""
    cmd = [
        sys.executable, "-m", "voltllm.entrypoints.cli", "serve", *to_argv(engine_args, str(model_dir)),
        "--host", "127.0.0.1", "--port", str(port), "--served-model-name", SERVED_NAME,
    ]  # fmt: skip
    print("$ " + " ".join(cmd[2:]) + f"  > {log}", flush=True)
    with log.open("wb") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)


def wait_healthy(server: subprocess.Popen, url: str, timeout_s: float, log: Path) -> float:
    """Polls /health until 200; returns the seconds it took. Raises if the server exits first."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if server.poll() is not None:
            raise RuntimeError(f"voltllm serve exited with status {server.returncode}:\n{_tail(log)}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return time.monotonic() - start
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.5)
    raise RuntimeError(f"voltllm serve not healthy after {timeout_s:.0f} s:\n{_tail(log)}")


def stop_server(server: subprocess.Popen) -> None:
    """SIGTERM (voltllm serve then stops its engine); SIGKILL to the whole session if that hangs."""
    if server.poll() is None:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            print("voltllm serve ignored SIGTERM for 60 s: killing its process group", file=sys.stderr)
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
    if server.returncode not in (0, -signal.SIGTERM):
        print(f"warning: voltllm serve exited with status {server.returncode}", file=sys.stderr)


def _tail(log: Path, lines: int = 40) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


# ----- offline -------------------------------------------------------------------------------------


def run_offline(
    engine_args: argparse.Namespace, input_lens: list[int], output_lens: list[int], vocab: int, seed: int
) -> tuple[float, int]:
    """(seconds, output tokens) of `LLMEngine.generate_token_ids` on random prompts of these lengths,
    measured by benches/offline_throughput.py's `time_offline_run`."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in input_lens]
    engine = LLMEngine(engine_config_from_args(engine_args))
    return time_offline_run(engine, prompts, output_lens, engine_args.device)


# ----- main ----------------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_engine_args(p)  # its optional `model` positional is refused below: the folder is written here
    p.add_argument("--tiny", action="store_true", help="a 4-layer Qwen3 instead of the Qwen3-0.6B shape")
    p.add_argument("--num-seqs", type=int, default=256, help="requests of the saturation run")
    p.add_argument("--min-len", type=int, default=100)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--num-warmups", type=int, default=None, help="saturation warm-ups (default: --num-seqs)")
    p.add_argument("--ttft-prompt-len", type=int, default=512)
    p.add_argument("--ttft-output-len", type=int, default=16)
    p.add_argument("--ttft-num-prompts", type=int, default=32)
    p.add_argument("--port", type=int, default=0, help="0: a free port")
    p.add_argument("--startup-timeout", type=float, default=900.0, help="seconds to wait for /health")
    p.add_argument("--result-dir", type=Path, default=None, help="keep JSON results and server log here")
    p.add_argument(
        "--tokenizer-dir",
        type=Path,
        default=SMOLLM2_TOKENIZER,
        help="folder with a byte-level BPE tokenizer.json and tokenizer_config.json (default: SmolLM2's)",
    )
    p.set_defaults(max_model_len=4096)  # as nano-vllm's benchmark and offline_throughput.py
    args = p.parse_args()
    if args.model is not None:
        p.error("the model folder is written by this script (Qwen3-0.6B shape, or --tiny)")
    if args.cpu_threads is None:
        args.cpu_threads = max(1, (os.cpu_count() or 2) - 1)  # voltllm serve's default, for both runs
    args.load_format = "dummy"
    return args


def main() -> None:
    args = parse_args()
    length_flags(args.min_len, args.max_len)  # fail on an inexpressible range before starting anything
    with tempfile.TemporaryDirectory(prefix="voltllm-serving-") as tmp:
        model_dir = Path(tmp) / "model"
        model_dir.mkdir()
        out = args.result_dir or Path(tmp)
        out.mkdir(parents=True, exist_ok=True)
        config = write_model_dir(model_dir, TINY if args.tiny else QWEN3_0_6B, args.tokenizer_dir)
        engine_args = argparse.Namespace(**{**vars(args), "model": str(model_dir)})
        saturation, low_load = measure_serving(args, engine_args, out)
        prompt_vocab = tokenizer_size(json.loads((args.tokenizer_dir / "tokenizer.json").read_text()))
        seconds, tokens = run_offline(
            engine_args, saturation["input_lens"], saturation["output_lens"], prompt_vocab, args.seed
        )
        print_table(args, config, saturation, low_load, tokens / seconds)
        if args.result_dir is not None:
            print(f"results and server log in {args.result_dir}")


def measure_serving(
    args: argparse.Namespace, engine_args: argparse.Namespace, out: Path
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Starts the server, runs the saturation and the low-load harness runs, stops the server even on
    error or interrupt. Returns both result JSONs."""
    length, ratio = length_flags(args.min_len, args.max_len)
    port = args.port or free_port()
    url = f"http://127.0.0.1:{port}"
    tokenizer = args.tokenizer_dir / "tokenizer.json"
    log = out / "server.log"
    # SIGTERM must unwind through the `finally` below, so the server never outlives this script.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    server = start_server(Path(engine_args.model), engine_args, port, log)
    try:
        startup_s = wait_healthy(server, url, args.startup_timeout, log)
        print(f"server healthy after {startup_s:.1f} s", flush=True)
        num_warmups = args.num_seqs if args.num_warmups is None else args.num_warmups
        saturation = run_harness(url, tokenizer, out / "saturation.json", [
            "--random-input-len", str(length), "--random-output-len", str(length),
            "--random-range-ratio", repr(ratio), "--num-prompts", str(args.num_seqs),
            "--max-concurrency", str(args.num_seqs), "--num-warmups", str(num_warmups),
            "--seed", str(args.seed),
        ])  # fmt: skip
        check_saturation(saturation, args.num_seqs, args.min_len, args.max_len)
        low_load = run_harness(url, tokenizer, out / "low_load.json", [
            "--random-input-len", str(args.ttft_prompt_len), "--random-output-len", str(args.ttft_output_len),
            "--num-prompts", str(args.ttft_num_prompts), "--max-concurrency", "1", "--num-warmups", "4",
            "--seed", str(args.seed + 1), "--metric-percentiles", "50,90,99",
        ])  # fmt: skip
        if low_load["failed"]:
            raise RuntimeError(f"low-load run failed requests: {low_load['failure_reasons']}")
    except Exception:
        if log.exists():
            print(f"--- tail of {log}:\n{_tail(log)}", file=sys.stderr)
        raise
    finally:
        stop_server(server)
    return saturation, low_load


def print_table(
    args: argparse.Namespace,
    config: dict[str, Any],
    saturation: dict[str, Any],
    low_load: dict[str, Any],
    offline_tok_s: float,
) -> None:
    """The summary: serving vs offline throughput, low-load TTFT, each against its target."""
    device = resolve_device(args.device)
    name = "tiny Qwen3" if args.tiny else "Qwen3-0.6B shape"
    flags = " ".join(to_argv(args, None))
    serving_tok_s = saturation["output_throughput"]
    ratio = serving_tok_s / offline_tok_s
    ttft = low_load["median_ttft_ms"]
    dtype = str(resolve_dtype(args.dtype, device)).removeprefix("torch.")
    print(
        f"\nmodel: {name}, dummy weights, vocab {config['vocab_size']}, {dtype}; "
        f"hardware: {hardware(args.device)}\n"
        f"engine flags (serve and offline): {flags}\n"
        f"saturation: {args.num_seqs} requests at once, in/out lengths uniform in [{args.min_len}, "
        f"{args.max_len}], {saturation['total_input_tokens']} prompt / {saturation['total_output_tokens']} "
        f"output tokens, {saturation['duration']:.2f} s; low load: {args.ttft_prompt_len}-token prompts, "
        f"{args.ttft_output_len} output tokens, 1 in flight, {low_load['completed']} requests\n"
    )
    rows = [
        ("serving output throughput at saturation (tok/s)", f"{serving_tok_s:.1f}", "", ""),
        ("offline output throughput, same lengths (tok/s)", f"{offline_tok_s:.1f}", "", ""),
        ("ratio serving / offline", f"{ratio:.3f}", f">= {RATIO_TARGET:.2f}", _yes(ratio >= RATIO_TARGET)),
        (
            f"median TTFT, {args.ttft_prompt_len}-token prompts, low load (ms)",
            f"{ttft:.2f}",
            f"<= {TTFT_TARGET_MS:g}",
            _yes(ttft <= TTFT_TARGET_MS),
        ),
        ("p90 TTFT, low load (ms)", f"{low_load['p90_ttft_ms']:.2f}", "", ""),
        ("median TPOT, low load (ms)", f"{low_load['median_tpot_ms']:.2f}", "", ""),
        ("median TTFT at saturation (ms)", f"{saturation['median_ttft_ms']:.1f}", "", ""),
    ]
    header = ("metric", "value", "target", "met")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(4)]
    for row in [header, tuple("-" * w for w in widths), *rows]:
        print("| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |")


def _yes(ok: bool) -> str:
    return "yes" if ok else "NO"


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        sys.exit(130)
    except subprocess.CalledProcessError as e:
        print(f"serving.py: error: the load tester exited with status {e.returncode}", file=sys.stderr)
        sys.exit(1)
    except (RuntimeError, ValueError) as e:
        print(f"serving.py: error: {e}", file=sys.stderr)
        sys.exit(1)
