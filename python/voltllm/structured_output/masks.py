"""The grammar work of a step, on the host while the forward runs: advance the constrained requests'
grammars by the previous step's tokens, fill this step's next-token masks, then apply the masks to
the logits on the device.

llguidance writes one bit per token id (bit `i % 32` of int32 word `i // 32`, 1 = allowed) into a
pinned host buffer from its own threads, with the GIL released; the runner starts a step's grammar
work in a worker thread before it launches the forward and waits for it only when the logits exist.
The buffer then goes to the device in one copy, is unpacked there to a boolean mask and applied with
one `masked_fill` on the rows of the constrained requests. The logits of a captured CUDA graph are
masked the same way, after the replay: the mask never enters the graph.

Advancing the grammars here, one step late, keeps llguidance's token acceptance off the path between
"step N's tokens are known" and "step N+1 is launched". A grammar that ends with step N's token is
then found during step N+1, whose token for that request the scheduler drops (its mask allowed only
EOS): the request's tokens and finish reason are those it would have had (`docs/engine.md`).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from voltllm.structured_output.grammar import EndedGrammar, Grammar, TokensToAccept, executor


class PendingMasks:
    """A step's grammar work in flight: the masks of the sampling rows `rows` (the i-th mask row is
    `rows[i]`'s, the request `request_ids[i]` with grammar `grammars[i]`), after accepting the last
    step's tokens. `done` resolves to the grammars those tokens ended."""

    __slots__ = ("rows", "request_ids", "grammars", "done")

    def __init__(
        self, rows: list[int], request_ids: list[str], grammars: list[Grammar], done: Future
    ) -> None:
        self.rows = rows
        self.request_ids = request_ids
        self.grammars = grammars
        self.done = done

    def ended(self) -> list[EndedGrammar]:
        """Wait for the work; the grammars that ended with (or rejected) the accepted tokens."""
        return self.done.result()

    def tokens_to_accept(self, sampled: np.ndarray) -> TokensToAccept:
        """The masked rows' tokens out of the step's sampled ids (in sampling order)."""
        rows = self.rows
        tokens = sampled.tolist() if len(rows) == len(sampled) else sampled[rows].tolist()
        return TokensToAccept(self.request_ids, self.grammars, tokens)


class TokenMasks:
    """One runner's mask buffers (for up to `max_rows` constrained requests a step) and its thread."""

    def __init__(self, max_rows: int, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.num_words = (vocab_size + 31) // 32
        pin = device.type == "cuda"
        self._host = torch.empty((max_rows, self.num_words), dtype=torch.int32, pin_memory=pin)
        self._shifts = torch.arange(32, dtype=torch.int32, device=device)
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="voltllm-masks")

    def start(
        self, constrained: list[tuple[int, str, Grammar]], accepts: TokensToAccept | None = None
    ) -> PendingMasks:
        """Begin, in the thread, accepting `accepts` and then filling the masks of the
        `(sampling row, request id, grammar)` triples; returns at once."""
        rows = [row for row, _, _ in constrained]
        request_ids = [request_id for _, request_id, _ in constrained]
        grammars = [grammar for _, _, grammar in constrained]
        matchers = [(grammar.matcher, i) for i, grammar in enumerate(grammars)]
        done = self._thread.submit(self._run, accepts, matchers)
        return PendingMasks(rows, request_ids, grammars, done)

    def _run(self, accepts: TokensToAccept | None, matchers: list) -> list[EndedGrammar]:
        ended = self._accept(accepts) if accepts is not None else []
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
        # The step syncs on its sampled ids before the next fill, so this copy is done by then.
        bits = self._host[:num].to(self.device, non_blocking=True)
        disallowed = ((bits.unsqueeze(-1) >> self._shifts) & 1).view(num, -1)[:, : self.vocab_size] == 0
        if num == logits.shape[0] and pending.rows == list(range(num)):
            logits.masked_fill_(disallowed, float("-inf"))
        else:
            index = torch.tensor(pending.rows, dtype=torch.int64, device=self.device)
            logits[index] = logits[index].masked_fill(disallowed, float("-inf"))
