"""CUDA-graph capture for the GPU kernel tests, as the engine captures a decode step."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

Out = TypeVar("Out")


def capture(step: Callable[[], Out]) -> tuple[torch.cuda.CUDAGraph, Out]:
    """Run `step()` once on a side stream (the warm-up: kernel loads and allocations stay out of the
    graph), then capture it in a CUDA graph, where a host sync would raise. Returns the graph and what
    the captured `step()` returned: buffers each replay rewrites."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    return graph, out
