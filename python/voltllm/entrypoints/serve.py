"""`voltllm serve`: run the Rust HTTP front end in this process; it starts the EngineCore process.

The front end binds its port and the two ZeroMQ sockets first, then starts the engine with the
command built here and waits for READY. It supervises the engine: one that dies or hangs is killed
and restarted with backoff (in-flight requests end with an error, `/health` answers 503 meanwhile),
up to `--max-engine-restarts`; past that the server exits non-zero. SIGTERM or Ctrl-C drains: new
requests get 503, in-flight ones finish within `--shutdown-timeout`, then the engine is stopped.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
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
        # The front end's threads share this machine with the engine's ranks: leave them a core.
        threads = max(1, ((os.cpu_count() or 2) - 1) // args.tensor_parallel_size)
        args = argparse.Namespace(**{**vars(args), "cpu_threads": threads})
    # The front end appends `--engine-index I` and starts (and restarts) the process itself.
    engine_cmd = [
        sys.executable, "-m", "voltllm.engine.core_proc", *to_argv(args, str(model_dir)),
        "--input-address", input_address, "--output-address", output_address,
    ]  # fmt: skip
    # SIGTERM would otherwise end this process on the spot and orphan the engine: make it unwind
    # like Ctrl-C, through the server's drain and shutdown.
    signal.signal(signal.SIGTERM, signal.default_int_handler)

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
            max_pending_outputs=args.max_pending_outputs,
            engine_command=engine_cmd,
            max_engine_restarts=args.max_engine_restarts,
            engine_hang_timeout=args.engine_hang_timeout,
            shutdown_timeout=args.shutdown_timeout,
            max_request_body_bytes=args.max_request_body_bytes,
            allowed_origins=args.allowed_origins,
            allowed_methods=args.allowed_methods,
            allowed_headers=args.allowed_headers,
            allow_credentials=args.allow_credentials,
            enable_auto_tool_choice=args.enable_auto_tool_choice,
            tool_call_parser=args.tool_call_parser,
            reasoning_parser=args.reasoning_parser,
        )
        return 0
    except (RuntimeError, ValueError) as e:
        print(f"voltllm serve: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
