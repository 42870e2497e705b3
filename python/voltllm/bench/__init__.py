"""`voltllm bench`: load testing of OpenAI-compatible servers.

The measuring is done by the Rust harness (crate `voltllm-bench`, reached in-process through
`voltllm._core.bench_main` when the extension provides it, else as the `voltllm-bench` binary);
this package runs it and draws plots from the JSON result it writes.
"""

from __future__ import annotations

from voltllm.bench.cli import main

__all__ = ["main"]
