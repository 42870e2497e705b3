"""`voltllm serve`: run the Rust HTTP front end in this process; it starts the EngineCore processes.

The front end binds its port and the two ZeroMQ sockets first, then starts the engines (one, or
`--data-parallel-size` of them, each told its `--engine-index`) with the command built here and
waits for every READY. It supervises each engine: one that dies or hangs is killed and restarted
with backoff (its in-flight requests end with an error; with one engine `/health` answers 503
meanwhile, with several the others keep serving), up to `--max-engine-restarts` for all engines
together; past that the engine is lost, and once every engine is lost the server exits non-zero.
SIGTERM or Ctrl-C drains: new requests get 503, in-flight ones finish within `--shutdown-timeout`,
then the engines are stopped.
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
from voltllm.engine.args import engine_config_from_args, to_argv
from voltllm.engine.data_parallel import check_data_parallel_config, default_cpu_threads


def serve(args: argparse.Namespace) -> int:
    """Run until interrupted; `args.model` is the resolved model folder. Returns the exit status."""
    model_dir = Path(args.model)
    try:
        config = engine_config_from_args(args)
        check_data_parallel_config(config)
    except ValueError as e:
        print(f"voltllm serve: error: {e}", file=sys.stderr)
        return 1
    run_dir = Path(tempfile.mkdtemp(prefix="voltllm-"))
    input_address = f"ipc://{run_dir}/input"
    output_address = f"ipc://{run_dir}/output"
    if args.cpu_threads is None:
        # The front end's threads share this machine with every rank of every engine: leave them a
        # core, share out the rest.
        threads = default_cpu_threads(os.cpu_count() or 2, config)
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
            num_engines=config.data_parallel_size,
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
