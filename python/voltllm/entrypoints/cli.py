"""The `voltllm` command: serve, generate, chat, engine, bench.

Flag names follow vLLM's. Usage errors and a missing model print one clear line and exit 2/1, never a
traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NoReturn

from voltllm import _core
from voltllm.engine.args import add_engine_args, engine_config_from_args, to_argv


class _Parser(argparse.ArgumentParser):
    """argparse that reports a usage error in one line instead of the usage block."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class CliError(Exception):
    """A user-facing failure: printed as one line, exit status 1."""


def resolve_model(model: str | None, load_format: str = "auto") -> Path:
    """The model folder the engine will load: the default model, an HF folder, or an imported GGUF."""
    from voltllm.config import ModelConfig
    from voltllm.loader.loader import resolve_model_source

    try:
        model_dir, _ = resolve_model_source(ModelConfig(model=model, load_format=load_format))
    except (FileNotFoundError, ValueError, RuntimeError) as e:
        raise CliError(str(e)) from None
    return model_dir


def folder_load_format(load_format: str) -> str:
    """How to load the already resolved (GGUF-imported) folder: dummy stays dummy, all else is read."""
    return "dummy" if load_format == "dummy" else "auto"


def resolved_engine_args(args: argparse.Namespace) -> argparse.Namespace:
    """`args` with the model resolved to the folder the engine loads (GGUF imported, default found)."""
    model_dir = resolve_model(args.model, args.load_format)
    resolved = {
        "model": str(model_dir),
        "model_arg": args.model,
        "load_format": folder_load_format(args.load_format),
    }
    return argparse.Namespace(**{**vars(args), **resolved})


def make_llm(args: argparse.Namespace):  # -> LLM (imported lazily: torch is slow to import)
    from voltllm.entrypoints.llm import LLM

    try:
        config = engine_config_from_args(resolved_engine_args(args))
    except ValueError as e:
        raise CliError(str(e)) from None
    return LLM.from_engine_config(config)


def cmd_serve(args: argparse.Namespace) -> int:
    from voltllm.entrypoints.serve import serve

    return serve(resolved_engine_args(args))


def cmd_engine(args: argparse.Namespace) -> int:
    from voltllm.engine.core_proc import main as engine_main

    if not args.headless:
        raise CliError("voltllm engine runs an EngineCore without a front end: pass --headless")
    engine_args = resolved_engine_args(args)
    return engine_main(
        [
            *to_argv(engine_args, engine_args.model),
            "--input-address", args.input_address,
            "--output-address", args.output_address,
            "--engine-index", str(args.engine_index),
        ]
    )  # fmt: skip


def cmd_generate(args: argparse.Namespace) -> int:
    from voltllm.sampling_params import SamplingParams

    sp = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.sampling_seed)
    llm = make_llm(args)
    if args.chat:
        out = llm.chat([{"role": "user", "content": args.prompt}], sp, use_tqdm=False)
    else:
        out = llm.generate([args.prompt], sp, use_tqdm=False)
    print(out[0].outputs[0].text)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from voltllm.entrypoints.chat import run_chat

    return run_chat(args)


def cmd_bench(args: argparse.Namespace) -> int:
    from voltllm.bench import main as bench_main

    return bench_main(args.bench_args)


def add_serve_args(p: argparse.ArgumentParser) -> None:
    """The HTTP front end's flags (vLLM's names), beside the engine's."""
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default: %(default)s)")
    p.add_argument(
        "--api-key",
        default=os.environ.get("VOLTLLM_API_KEY"),
        help="require 'Authorization: Bearer KEY' on every route but /health and /ping"
        " (default: $VOLTLLM_API_KEY)",
    )
    p.add_argument(
        "--served-model-name", default=None, help="the model name clients use (default: the model argument)"
    )
    p.add_argument(
        "--max-waiting-requests",
        type=int,
        default=1024,
        help="requests that may wait beyond --max-num-seqs; more get 503 (default: %(default)s)",
    )
    p.add_argument(
        "--max-pending-outputs",
        type=int,
        default=4096,
        help="outputs held for one request whose client reads too slowly; past it the request is"
        " dropped with an error instead of stalling the others (default: %(default)s)",
    )
    p.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=32 << 20,
        help="larger request bodies get 413 (default: %(default)s)",
    )
    p.add_argument(
        "--max-engine-restarts",
        type=int,
        default=5,
        help="restarts of dead or hung engines, all engines together; an engine that dies after them is"
        " lost, and the server exits non-zero once every engine is (default: %(default)s)",
    )
    p.add_argument(
        "--engine-hang-timeout",
        type=float,
        default=30.0,
        help="seconds an engine holding requests may send nothing (not even its heartbeat) before it is"
        " declared hung and restarted; 0 turns the check off (default: %(default)s)",
    )
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM/SIGINT, seconds in-flight requests may take to finish while new ones get 503"
        " (default: %(default)s)",
    )
    p.add_argument(
        "--allowed-origins",
        type=json.loads,
        default=["*"],
        help='CORS origins as a JSON list (default: ["*"])',
    )
    p.add_argument(
        "--allowed-methods",
        type=json.loads,
        default=["*"],
        help='CORS methods as a JSON list (default: ["*"])',
    )
    p.add_argument(
        "--allowed-headers",
        type=json.loads,
        default=["*"],
        help='CORS request headers as a JSON list (default: ["*"])',
    )
    p.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials")
    p.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='parse the model\'s own tool calls for tool_choice "auto" (needs --tool-call-parser); without'
        ' it, a request with tools and tool_choice "auto" gets 400',
    )
    p.add_argument(
        "--tool-call-parser",
        default=None,
        choices=_core.TOOL_CALL_PARSERS,
        help="the model's tool-call format, for --enable-auto-tool-choice: hermes (Qwen2.5/Qwen3),"
        " qwen3_coder, llama3_json (Llama 3.1/3.2), mistral, pythonic (Llama 3.2/4)",
    )
    p.add_argument(
        "--reasoning-parser",
        default=None,
        choices=_core.REASONING_PARSERS,
        help="move <think>...</think> text to reasoning_content: qwen3 or deepseek_r1",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="voltllm", description="OpenAI-compatible LLM serving for Volta and newer GPUs")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    serve = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    add_engine_args(serve)
    add_serve_args(serve)
    serve.set_defaults(func=cmd_serve)

    engine = sub.add_parser("engine", help="run one EngineCore process for a separately started front end")
    add_engine_args(engine)
    engine.add_argument("--headless", action="store_true")
    engine.add_argument("--input-address", required=True)
    engine.add_argument("--output-address", required=True)
    engine.add_argument("--engine-index", type=int, default=0)
    engine.set_defaults(func=cmd_engine)

    gen = sub.add_parser("generate", help="generate once for a prompt given on the command line")
    add_engine_args(gen)
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--chat", action="store_true", help="apply the chat template to the prompt")
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--sampling-seed", type=int, default=None)
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="interactive chat in the terminal (Ctrl-D to leave)")
    add_engine_args(chat)
    chat.add_argument(
        "--url",
        default=None,
        help="a running server's base URL, e.g. http://127.0.0.1:8000/v1;"
        " without it the model runs in this process",
    )
    chat.add_argument("--api-key", default=os.environ.get("VOLTLLM_API_KEY"))
    chat.add_argument("--system", default=None, help="system prompt")
    chat.add_argument("--temperature", type=float, default=0.7)
    chat.add_argument("--max-tokens", type=int, default=512)
    chat.set_defaults(func=cmd_chat)

    bench = sub.add_parser("bench", help="load testing: voltllm bench serve --help", add_help=False)
    bench.add_argument("bench_args", nargs=argparse.REMAINDER)
    bench.set_defaults(func=cmd_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except CliError as e:
        print(f"voltllm {args.command}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
