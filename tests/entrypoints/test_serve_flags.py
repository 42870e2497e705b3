"""Every `voltllm serve` flag says what it does in `--help` (issue 22), and the serve flags parse as
vLLM spells them."""

from __future__ import annotations

import argparse

from voltllm.entrypoints.cli import build_parser


def serve_parser() -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["serve"]


def test_every_serve_flag_has_help() -> None:
    missing = [a.option_strings or [a.dest] for a in serve_parser()._actions if not a.help]
    assert missing == []


def test_serve_flags_parse_like_vllm() -> None:
    args = build_parser().parse_args(
        ["serve", "--allowed-origins", '["http://a.example"]', "--allow-credentials",
         "--max-engine-restarts", "3", "--engine-hang-timeout", "0", "--shutdown-timeout", "12.5"]
    )  # fmt: skip
    assert args.allowed_origins == ["http://a.example"] and args.allowed_methods == ["*"]
    assert args.allow_credentials and args.max_engine_restarts == 3
    assert args.engine_hang_timeout == 0 and args.shutdown_timeout == 12.5
