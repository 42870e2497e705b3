"""The engine's command-line flags, defined once.

`voltllm serve / generate / chat / engine` and the EngineCore process (`python -m
voltllm.engine.core_proc`) all take these flags; `voltllm serve` hands them on to the engine process
it starts with `to_argv`. Names follow vLLM's.
"""

from __future__ import annotations

import argparse
from typing import Any

from voltllm.config import (
    DTYPES,
    LOAD_FORMATS,
    QUANTIZATION_METHODS,
    CacheConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
)

# (flag, argparse keywords + "aliases"): the one list both `add_engine_args` and `to_argv` read.
_FLAGS: list[tuple[str, dict[str, Any]]] = [
    ("--dtype", {"default": "auto", "choices": DTYPES, "help": "weight dtype (auto: the checkpoint's)"}),
    ("--max-model-len", {"type": int, "default": None, "help": "context length (default: the model's)"}),
    ("--max-num-seqs", {"type": int, "default": 256, "help": "requests run at once (default: %(default)s)"}),
    (
        "--max-num-batched-tokens",
        {"type": int, "default": 8192, "help": "tokens computed per step (default: %(default)s)"},
    ),
    (
        "--gpu-memory-utilization",
        {"type": float, "default": 0.9, "help": "share of GPU memory to use (default: %(default)s)"},
    ),
    (
        "--num-kv-blocks",
        {"type": int, "default": None, "help": "KV cache size in blocks (CPU default: 1 GiB)"},
    ),
    ("--kv-cache-memory-bytes", {"type": int, "default": None, "help": "KV cache size in bytes"}),
    ("--block-size", {"type": int, "default": 16, "help": "tokens per KV block (default: %(default)s)"}),
    (
        "--tensor-parallel-size",
        {
            "aliases": ["-tp"],
            "type": int,
            "default": 1,
            "help": "ranks the model is sharded over: a process (and a GPU) each",
        },
    ),
    (
        "--data-parallel-size",
        {
            "aliases": ["-dp"],
            "type": int,
            "default": 1,
            "help": "engines (model replicas, of --tensor-parallel-size ranks each) behind one front end;"
            " voltllm serve only",
        },
    ),
    ("--seed", {"type": int, "default": 0, "help": "random seed of the engine (default: %(default)s)"}),
    ("--load-format", {"default": "auto", "choices": LOAD_FORMATS, "help": "how to read the weights"}),
    (
        "--quantization",
        {
            "default": None,
            "choices": QUANTIZATION_METHODS,
            "help": "the checkpoint's quantization method, checked against its config (default: read it)",
        },
    ),
    ("--device", {"default": "auto", "choices": ["auto", "cpu", "cuda"], "help": "auto: CUDA when present"}),
    ("--attention-backend", {"default": "auto", "help": "auto, torch or sm70"}),
    ("--policy", {"default": "fcfs", "choices": ["fcfs", "priority"], "help": "scheduling order"}),
    ("--cpu-threads", {"type": int, "default": None, "help": "torch threads on the CPU (default: torch's)"}),
    ("--enforce-eager", {"action": "store_true", "help": "do not capture CUDA graphs"}),
    (
        "--async-scheduling",
        {
            "action": argparse.BooleanOptionalAction,
            "default": None,
            "help": "plan the next step while the current one runs (default: the engine's, CUDA only)",
        },
    ),
    (
        "--no-enable-prefix-caching",
        {"action": "store_false", "dest": "enable_prefix_caching", "help": "do not reuse cached prefixes"},
    ),
]


def _dest(flag: str, kwargs: dict[str, Any]) -> str:
    return kwargs.get("dest", flag.removeprefix("--").replace("-", "_"))


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Model, cache, scheduler and device flags, with the model folder as an optional positional."""
    p.add_argument(
        "model",
        nargs="?",
        default=None,
        help="model folder or .gguf file; omitted: the embedded SmolLM2-135M-Instruct",
    )
    for flag, kwargs in _FLAGS:
        options = {k: v for k, v in kwargs.items() if k != "aliases"}
        p.add_argument(flag, *kwargs.get("aliases", ()), **options)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The `EngineConfig` these flags describe. Invalid values raise `ValueError` naming the field."""
    return EngineConfig(
        model=ModelConfig(
            model=args.model,
            dtype=args.dtype,
            max_model_len=args.max_model_len,
            load_format=args.load_format,
            seed=args.seed,
            quantization=args.quantization,
        ),
        cache=CacheConfig(
            block_size=args.block_size,
            gpu_memory_utilization=args.gpu_memory_utilization,
            num_kv_blocks=args.num_kv_blocks,
            kv_cache_memory_bytes=args.kv_cache_memory_bytes,
            enable_prefix_caching=args.enable_prefix_caching,
        ),
        scheduler=SchedulerConfig(
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_num_seqs=args.max_num_seqs,
            policy=args.policy,
        ),
        device=args.device,
        attention_backend=args.attention_backend,
        enforce_eager=args.enforce_eager,
        tensor_parallel_size=args.tensor_parallel_size,
        data_parallel_size=args.data_parallel_size,
        cpu_threads=args.cpu_threads,
        async_scheduling=args.async_scheduling,
    )


def to_argv(args: argparse.Namespace, model: str | None) -> list[str]:
    """The flags that reproduce `args`' engine settings on another command line, for `model`."""
    argv = [] if model is None else [model]
    for flag, kwargs in _FLAGS:
        value = getattr(args, _dest(flag, kwargs))
        switch = kwargs.get("action")
        if switch in ("store_true", "store_false"):
            argv += [flag] if value == (switch == "store_true") else []
        elif switch is argparse.BooleanOptionalAction:
            argv += [] if value is None else [flag if value else "--no-" + flag.removeprefix("--")]
        elif value is not None:
            argv += [flag, str(value)]
    return argv
