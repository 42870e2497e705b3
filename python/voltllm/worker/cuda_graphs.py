"""CUDA graphs of the decode step, one per batch-size bucket.

A decode step of a small model is hundreds of tiny kernels; launched one by one from Python the GPU
waits on the host (about 10 us a launch). Captured once into a CUDA graph, the whole forward (and the
logits) replays with one launch. A graph replays with the device addresses it was captured with, so
its inputs are the runner's persistent `StepBuffers` (packed by batch size, hence at fixed addresses
per bucket) and its output goes to one shared logits buffer.

A batch of n decodes runs the smallest captured bucket >= n; the extra rows are padding that computes
garbage nobody reads: token 0 at position 0, a cache slot of -1 (no KV write), context length 1 and
the block table's all-zero pad row. The attention kernels are captured with `max_seq_len =
max_model_len`; the decode kernel reads each sequence's real length from the device, so one graph
serves every context length. All buckets share one memory pool, captured largest first.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from tqdm import tqdm

from voltllm.layers.attention.backend import AttentionMetadata

logger = logging.getLogger(__name__)


def graph_batch_sizes(max_num_seqs: int, limit: int = 512) -> list[int]:
    """Buckets 1, 2, 4, 8, then every multiple of 16 up to `max_num_seqs` (capped at `limit`)."""
    top = min(max_num_seqs, limit)
    sizes = [s for s in (1, 2, 4, 8) if s <= top] + list(range(16, top + 1, 16))
    if sizes[-1] != top:
        sizes.append(top)
    return sizes


def graph_memory_reserve(max_num_seqs: int, vocab_size: int) -> int:
    """Device bytes the KV cache sizing leaves for the graphs: the shared fp32 logits buffer plus the
    graph pool (about one fp16 logits batch)."""
    return 6 * max_num_seqs * vocab_size + (256 << 20)


# (batch size) -> input_ids and positions on the persistent buffers, padded to that size, and a function
# that builds the step's attention metadata from those buffers. It is called inside the capture, so the
# device work it does (gathering the batch's block-table rows) replays with the graph.
DecodeInputs = Callable[[int], tuple[torch.Tensor, torch.Tensor, Callable[[], AttentionMetadata]]]


class DecodeGraphs:
    """Captures and replays `logits = compute_logits(model(decode batch))` per batch-size bucket."""

    def __init__(self, model: torch.nn.Module, sizes: list[int], vocab_size: int, device: torch.device):
        self.model = model
        self.sizes = sorted(sizes)
        self.device = device
        self.logits = torch.empty((self.sizes[-1], vocab_size), dtype=torch.float32, device=device)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._pool = None

    def bucket_for(self, batch_size: int) -> int | None:
        """The smallest captured size that holds `batch_size` decodes, or None (run eagerly)."""
        for size in self.sizes:
            if size >= batch_size:
                return size if size in self._graphs else None
        return None

    @torch.inference_mode()
    def capture(self, decode_inputs: DecodeInputs, kv_caches: list[torch.Tensor]) -> None:
        """Capture every bucket, largest first (later, smaller graphs reuse the pool's memory)."""
        # One eager step first: kernel attributes, cuBLAS handles and workspaces are set up outside
        # any capture.
        input_ids, positions, build_metadata = decode_inputs(self.sizes[-1])
        self._forward(input_ids, positions, build_metadata, kv_caches)
        torch.cuda.synchronize(self.device)
        self._pool = torch.cuda.graph_pool_handle()
        before = torch.cuda.mem_get_info(self.device)[0]
        for size in tqdm(sorted(self.sizes, reverse=True), desc="Capturing CUDA graphs", unit="graph"):
            input_ids, positions, build_metadata = decode_inputs(size)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                self._forward(input_ids, positions, build_metadata, kv_caches)
            self._graphs[size] = graph
        torch.cuda.synchronize(self.device)
        used = before - torch.cuda.mem_get_info(self.device)[0]
        logger.info("captured %d decode CUDA graphs (%.0f MiB)", len(self._graphs), used / 2**20)

    def replay(self, size: int) -> torch.Tensor:
        """Run the graph of bucket `size` on what the buffers hold now; returns its logits rows."""
        self._graphs[size].replay()
        return self.logits[:size]

    def _forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        build_metadata: Callable[[], AttentionMetadata],
        kv_caches: list[torch.Tensor],
    ) -> None:
        hidden = self.model(input_ids, positions, build_metadata(), kv_caches)
        self.model.compute_logits(hidden, out=self.logits[: input_ids.shape[0]])
