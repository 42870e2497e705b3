"""The next-token masks of a step's constrained requests: filled on the host while the forward runs,
applied to the logits on the device.

llguidance writes one bit per token id (bit `i % 32` of int32 word `i // 32`, 1 = allowed) into a
pinned host buffer from its own threads, with the GIL released; the runner starts that fill in a
worker thread before it launches the forward and waits for it only when the logits exist. The buffer
then goes to the device in one copy, is unpacked there to a boolean mask and applied with one
`masked_fill` on the rows of the constrained requests. The logits of a captured CUDA graph are masked
the same way, after the replay: the mask never enters the graph.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch

from voltllm.structured_output.grammar import Grammar, executor


class PendingMasks:
    """Masks being filled for the sampling rows `rows` (the i-th mask row is `rows[i]`'s)."""

    __slots__ = ("rows", "done")

    def __init__(self, rows: list[int], done: Future) -> None:
        self.rows = rows
        self.done = done


class TokenMasks:
    """One runner's mask buffers (for up to `max_rows` constrained requests a step) and fill thread."""

    def __init__(self, max_rows: int, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.num_words = (vocab_size + 31) // 32
        pin = device.type == "cuda"
        self._host = torch.empty((max_rows, self.num_words), dtype=torch.int32, pin_memory=pin)
        self._shifts = torch.arange(32, dtype=torch.int32, device=device)
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="voltllm-masks")

    def start(self, constrained: list[tuple[int, Grammar]]) -> PendingMasks:
        """Begin filling the masks of `(sampling row, grammar)` pairs; returns at once."""
        rows = [row for row, _ in constrained]
        matchers = [(grammar.matcher, i) for i, (_, grammar) in enumerate(constrained)]
        return PendingMasks(rows, self._thread.submit(self._fill, matchers))

    def _fill(self, matchers: list) -> None:
        host = self._host
        executor().unsafe_compute_mask_ptr(matchers, host.data_ptr(), self.num_words * 4, host.shape[0])

    def apply(self, pending: PendingMasks, logits: torch.Tensor) -> None:
        """Wait for the fill and set every disallowed token's logit to -inf, in place.

        logits: [num_sampling, vocab_size]."""
        pending.done.result()
        num = len(pending.rows)
        # The step syncs on its sampled ids before the next fill, so this copy is done by then.
        bits = self._host[:num].to(self.device, non_blocking=True)
        disallowed = ((bits.unsqueeze(-1) >> self._shifts) & 1).view(num, -1)[:, : self.vocab_size] == 0
        if num == logits.shape[0] and pending.rows == list(range(num)):
            logits.masked_fill_(disallowed, float("-inf"))
        else:
            index = torch.tensor(pending.rows, dtype=torch.int64, device=self.device)
            logits[index] = logits[index].masked_fill(disallowed, float("-inf"))
