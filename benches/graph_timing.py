"""The timing the weight-bandwidth benches share: a call replayed from a CUDA graph over weight copies.

`graph_time_us(fn, copies)` captures `iters` calls `fn(i % copies)` in one CUDA graph (the engine runs
decode steps as graph replays, so launch overhead is not counted) and returns the median over 7 replays
of the time per call, measured with CUDA events. Rotating over enough weight copies to exceed the L2
cache makes every call read its weight from memory, as in a real forward pass.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch

L2_BYTES = 256 * 2**20  # weight copies per timing cover this much, several times an H200's L2


def copies_for(nbytes: int) -> int:
    """How many copies of an `nbytes` weight cover L2_BYTES."""
    return max(1, -(-L2_BYTES // nbytes))


def graph_time_us(fn: Callable[[int], object], copies: int, iters: int = 40) -> float:
    """Median time per call of `fn(i)` over `iters` calls captured in one CUDA graph."""
    for i in range(3):
        fn(i % copies)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(iters):
            fn(i % copies)
    graph.replay()
    samples = []
    for _ in range(7):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / iters)
    del graph
    return statistics.median(samples)
