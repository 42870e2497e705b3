"""The grammar work of a step, on the host off the critical path: advance the constrained requests'
grammars by the previous step's tokens, fill this step's next-token masks, then apply the masks to
the logits on the device.

llguidance writes one bit per token id (bit `i % 32` of int32 word `i // 32`, 1 = allowed) into a
pinned host buffer from its own threads, with the GIL released. The runner starts that work in a
worker thread as soon as the previous step's tokens are known (or, when the batch changed, before it
launches the forward) and waits for it only when the logits exist.
The buffer then goes to the device in one copy into a buffer allocated once, and one kernel
(`voltllm.ops.structured.apply_token_bitmask`) reads the bits and sets the disallowed logits of the
constrained rows to -inf. The logits of a captured CUDA graph are masked the same way, after the
replay: the mask never enters the graph.

Advancing the grammars here, one step late, keeps llguidance's token acceptance off the path between
"step N's tokens are known" and "step N+1 is launched". A grammar that ends with step N's token is
then found during step N+1, whose token for that request the scheduler drops (its mask allowed only
EOS): the request's tokens and finish reason are those it would have had (`docs/engine.md`).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from voltllm.ops.structured import apply_token_bitmask
from voltllm.structured_output.grammar import EndedGrammar, Grammar, TokensToAccept, executor


class MaskedRows:
    """The constrained sampling rows of a step: mask row i is sampling row `rows[i]`, the request
    `request_ids[i]` under `grammars[i]`. The runner builds it once per batch and reuses it while the
    batch stays the same."""

    __slots__ = ("rows", "request_ids", "grammars", "matchers")

    def __init__(self, constrained: list[tuple[int, str, Grammar]]) -> None:
        """constrained: (sampling row, request id, grammar) in increasing row order."""
        self.rows = [row for row, _, _ in constrained]
        self.request_ids = [request_id for _, request_id, _ in constrained]
        self.grammars = [grammar for _, _, grammar in constrained]
        self.matchers = [(grammar.matcher, i) for i, grammar in enumerate(self.grammars)]


class PendingMasks:
    """A step's grammar work in flight: accepting the last step's tokens, then filling the masks of
    `masked`. `done` resolves to the grammars those tokens ended."""

    __slots__ = ("masked", "done")

    def __init__(self, masked: MaskedRows, done: Future) -> None:
        self.masked = masked
        self.done = done

    @property
    def rows(self) -> list[int]:
        return self.masked.rows

    def ended(self) -> list[EndedGrammar]:
        """Wait for the work; the grammars that ended with (or rejected) the accepted tokens."""
        return self.done.result()

    def tokens_to_accept(self, sampled: np.ndarray) -> TokensToAccept:
        """The masked rows' tokens out of the step's sampled ids (in sampling order)."""
        masked = self.masked
        rows = masked.rows
        tokens = sampled.tolist() if len(rows) == len(sampled) else sampled[rows].tolist()
        return TokensToAccept(masked.request_ids, masked.grammars, tokens)


class TokenMasks:
    """One runner's mask buffers (for up to `max_rows` constrained requests a step) and its thread."""

    def __init__(self, max_rows: int, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.num_words = (vocab_size + 31) // 32
        on_cuda = device.type == "cuda"
        self._host = torch.empty((max_rows, self.num_words), dtype=torch.int32, pin_memory=on_cuda)
        self._host_rows = torch.empty(max_rows, dtype=torch.int32, pin_memory=on_cuda)
        # Where the masks are read on the device (the host buffers themselves on the CPU).
        self._bits = torch.empty_like(self._host, device=device) if on_cuda else self._host
        self._rows = torch.empty_like(self._host_rows, device=device) if on_cuda else self._host_rows
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="voltllm-masks")

    def start(
        self,
        masked: MaskedRows,
        accepts: TokensToAccept | None = None,
        after: PendingMasks | None = None,
    ) -> PendingMasks:
        """Begin, in the thread, accepting `accepts` and then filling the masks of `masked`; returns
        at once. `after`: earlier work whose masks are not wanted (its batch changed); its ended
        grammars are carried into this work's."""
        return PendingMasks(masked, self._thread.submit(self._run, accepts, masked.matchers, after))

    def _run(
        self, accepts: TokensToAccept | None, matchers: list, after: PendingMasks | None = None
    ) -> list[EndedGrammar]:
        # `after` ran on this same thread before this work, so its result is ready.
        ended = list(after.done.result()) if after is not None else []
        if accepts is not None:
            ended += self._accept(accepts)
        if matchers:
            self._fill(matchers)
        return ended

    def _accept(self, accepts: TokensToAccept) -> list[EndedGrammar]:
        return accepts.accept()

    def _fill(self, matchers: list) -> None:
        host = self._host
        executor().unsafe_compute_mask_ptr(matchers, host.data_ptr(), self.num_words * 4, host.shape[0])

    def apply(self, pending: PendingMasks, logits: torch.Tensor) -> None:
        """Wait for the work and set every disallowed token's logit to -inf, in place.

        logits: [num_sampling, vocab_size]."""
        pending.done.result()
        num = len(pending.rows)
        if num == 0:
            return
        # The step syncs on its sampled ids before the next fill, so these copies are done by then.
        bits = self._upload(self._host, self._bits, num)
        rows = None  # the rows are 0..num-1 when the last one is num-1 (they increase)
        if pending.rows[-1] != num - 1:
            self._host_rows.numpy()[:num] = pending.rows
            rows = self._upload(self._host_rows, self._rows, num)
        apply_token_bitmask(logits, bits, rows)

    @staticmethod
    def _upload(host: torch.Tensor, device: torch.Tensor, num: int) -> torch.Tensor:
        if device is host:
            return host[:num]
        return device[:num].copy_(host[:num], non_blocking=True)
