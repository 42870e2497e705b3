"""`voltllm serve`: start the EngineCore process, then run the Rust HTTP front end in this process.

The front end binds the two ZeroMQ sockets and waits for the engine's READY; it watches the engine's
process id from the start, so an engine that dies (while loading or later) fails in-flight requests,
turns `/health` to 503 and makes the server exit non-zero.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from voltllm import _core
from voltllm.engine.args import to_argv


def serve(args: argparse.Namespace) -> int:
    """Run until interrupted; `args.model` is the resolved model folder. Returns the exit status."""
    model_dir = Path(args.model)
    run_dir = Path(tempfile.mkdtemp(prefix="voltllm-"))
    input_address = f"ipc://{run_dir}/input"
    output_address = f"ipc://{run_dir}/output"
    if args.cpu_threads is None:
        # The front end's threads share this machine with the engine: leave them a core.
        args = argparse.Namespace(**{**vars(args), "cpu_threads": max(1, (os.cpu_count() or 2) - 1)})
    engine_cmd = [
        sys.executable, "-m", "voltllm.engine.core_proc", *to_argv(args, str(model_dir)),
        "--input-address", input_address, "--output-address", output_address, "--engine-index", "0",
    ]  # fmt: skip
    engine = subprocess.Popen(engine_cmd)
    # SIGTERM would otherwise end this process on the spot and orphan the engine: make it unwind
    # like Ctrl-C, through the server's shutdown and the `finally` below.
    signal.signal(signal.SIGTERM, signal.default_int_handler)

    def engine_poll() -> str | None:
        status = engine.poll()
        return (
            None if status is None else f"the engine process exited with status {status}; see its log above"
        )

    # vLLM names the model after the argument given; the embedded default model after its folder.
    served_name = args.served_model_name or args.model_arg or model_dir.name
    try:
        _core.serve(
            str(model_dir),
            input_address,
            output_address,
            host=args.host,
            port=args.port,
            api_key=args.api_key,
            served_model_name=[served_name],
            max_model_len=args.max_model_len,
            max_waiting_requests=args.max_waiting_requests,
            engine_pids=[engine.pid],
        )
        return 0
    except RuntimeError as e:
        print(f"voltllm serve: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        _stop(engine)
        shutil.rmtree(run_dir, ignore_errors=True)


def _stop(engine: subprocess.Popen) -> None:
    if engine.poll() is not None:
        return
    engine.terminate()
    try:
        engine.wait(timeout=10)
    except subprocess.TimeoutExpired:
        engine.kill()
        engine.wait()
