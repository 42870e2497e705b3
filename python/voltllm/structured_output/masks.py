"""The grammar work of a step, on the host off the critical path: advance the constrained requests'
grammars by the previous step's tokens, fill this step's next-token masks and copy them to the
device, then apply the masks to the logits.

llguidance writes one bit per token id (bit `i % 32` of int32 word `i // 32`, 1 = allowed) into a
pinned host buffer, with the GIL released. The runner hands that work to a worker thread once the
step's forward is queued (before an eager forward's Python launch, right after a CUDA graph's replay),
so the thread's few moments under the GIL fall where the main thread only waits, and it waits for
the thread only when the logits exist. Under asynchronous scheduling the thread goes on to queue the
apply and the draw itself (`start(..., then=...)`, `apply_filled`) and the main thread does not wait
for the masks at all, only for that draw to be queued before the next forward. The thread accepts
the tokens and computes the masks one matcher after another (each llguidance call releases the GIL).
As soon as the masks are filled, the thread queues their copy into a device buffer allocated once on
a stream of its own, so when the logits exist only one kernel
(`voltllm.ops.structured.apply_token_bitmask`) is left: it reads the bits and sets the disallowed
logits of the constrained rows to -inf. The logits of a captured CUDA graph are masked the same way,
after the replay: the mask never enters the graph.

Advancing the grammars here, one step late, keeps llguidance's token acceptance off the path between
"step N's tokens are known" and "step N+1 is launched". A grammar that ends with step N's token is
then found during step N+1, whose token for that request the scheduler drops (its mask allowed only
EOS): the request's tokens and finish reason are those it would have had (`docs/engine.md`).

Tried and measured slower: llguidance's pool and several Python threads. An `LLExecutor` of N
threads doing the accept and the fill in one call each (the GIL given up twice a step instead of once
per mask) gained nothing: on the H100 (16 cores), Qwen3-0.6B shape, batch 64, asynchronous
scheduling, step ms per round were unconstrained 1.837 / 1.843 / 1.849, one by one (this path)
1.939 / 1.928 / 1.927, a pool of 1 1.929 / 1.932 / 1.932, a pool of 4 1.921 / 1.928 / 2.001 (and on
the H200 host session 9's pool of 12 filled 64 masks ~3x slower than one by one). Splitting the
masks into runs over 2 or 4 Python threads was slower than one thread (session 10: fill 935 / 1,476
us against 788; steps 2.211 / 2.524 ms against 2.154). RESULTS "Structured outputs (issue 20)".
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import llguidance
import numpy as np
import torch

from voltllm.ops.structured import apply_token_bitmask
from voltllm.structured_output.grammar import EndedGrammar, Grammar, TokensToAccept


class MaskedRows:
    """The constrained sampling rows of a step: mask row i is sampling row `rows[i]`, the request
    `request_ids[i]` under `grammars[i]`. The runner builds it once per batch and reuses it while the
    batch stays the same."""

    __slots__ = ("rows", "request_ids", "grammars", "matchers", "rows_are_prefix")

    def __init__(self, constrained: list[tuple[int, str, Grammar]]) -> None:
        """constrained: (sampling row, request id, grammar) in increasing row order."""
        self.rows = [row for row, _, _ in constrained]
        self.request_ids = [request_id for _, request_id, _ in constrained]
        self.grammars = [grammar for _, _, grammar in constrained]
        self.matchers = [(grammar.matcher, i) for i, grammar in enumerate(self.grammars)]
        # Rows 0..n-1 (they increase, so the last one says it): mask i is row i, no row list needed.
        self.rows_are_prefix = not self.rows or self.rows[-1] == len(self.rows) - 1


class PendingMasks:
    """A step's grammar work in flight: accepting the last step's tokens, then filling (and, on a GPU,
    uploading) the masks of `masked`. `done` resolves to the grammars those tokens ended."""

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
        return TokensToAccept(masked.request_ids, masked.grammars, _tokens_of(masked.rows, sampled))

    def tokens_to_accept_later(self, sampled: Callable[[], np.ndarray]) -> TokensToAccept:
        """`tokens_to_accept` of ids still on their way: `sampled()` waits for them (in the mask
        thread, when the next step's work accepts them)."""
        masked = self.masked
        rows = masked.rows
        return TokensToAccept(masked.request_ids, masked.grammars, None, lambda: _tokens_of(rows, sampled()))


def _tokens_of(rows: list[int], sampled: np.ndarray) -> list[int]:
    """The tokens of sampling rows `rows` out of a step's sampled ids (in sampling order)."""
    return sampled.tolist() if len(rows) == len(sampled) else sampled[rows].tolist()


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
        # On a GPU: the uploads' stream, the last upload (the host buffers are free once it is done)
        # and the last apply (the device buffers are free once it is done).
        self._copy_stream = torch.cuda.Stream(device) if on_cuda else None
        self._uploaded = torch.cuda.Event() if on_cuda else None
        self._applied = torch.cuda.Event() if on_cuda else None

    def start(
        self,
        masked: MaskedRows,
        accepts: TokensToAccept | None = None,
        then: Callable[[MaskedRows], None] | None = None,
    ) -> PendingMasks:
        """Begin, in the thread, accepting `accepts` and then filling and uploading the masks of
        `masked`, then `then(masked)` (an asynchronous step's draw: `apply_filled` and the sampling,
        queued by the thread); returns at once. The work's future resolves once all of it ran."""
        return PendingMasks(masked, self._thread.submit(self._run, accepts, masked, then))

    def _run(
        self,
        accepts: TokensToAccept | None,
        masked: MaskedRows,
        then: Callable[[MaskedRows], None] | None = None,
    ) -> list[EndedGrammar]:
        ended = self._accept(accepts) if accepts is not None else []
        if masked.rows:
            self._fill(masked.matchers)
            self._upload(masked)
        if then is not None:
            then(masked)
        return ended

    def _accept(self, accepts: TokensToAccept) -> list[EndedGrammar]:
        return accepts.accept()

    def _fill(self, matchers: list[tuple[llguidance.LLMatcher, int]]) -> None:
        """Compute the masks one after another into their rows of the host buffer (each llguidance
        call releases the GIL)."""
        if self._uploaded is not None:
            self._uploaded.synchronize()  # the last upload has read the host buffers
        base, mask_bytes = self._host.data_ptr(), self.num_words * 4
        for matcher, i in matchers:
            matcher.unsafe_compute_mask_ptr(base + i * mask_bytes, mask_bytes)

    def _upload(self, masked: MaskedRows) -> None:
        """Stage the row list and, on a GPU, queue the copies of the filled masks (and rows)."""
        num = len(masked.rows)
        if not masked.rows_are_prefix:
            self._host_rows.numpy()[:num] = masked.rows
        stream = self._copy_stream
        if stream is None:
            return
        with torch.cuda.stream(stream):
            stream.wait_event(self._applied)  # the last apply has read the device buffers
            self._bits[:num].copy_(self._host[:num], non_blocking=True)
            if not masked.rows_are_prefix:
                self._rows[:num].copy_(self._host_rows[:num], non_blocking=True)
            self._uploaded.record(stream)

    def apply(self, pending: PendingMasks, logits: torch.Tensor) -> None:
        """Wait for the work and set every disallowed token's logit to -inf, in place, on the current
        stream (after the masks' upload).

        logits: [num_sampling, vocab_size]."""
        pending.done.result()
        self.apply_filled(pending.masked, logits)

    def apply_filled(self, masked: MaskedRows, logits: torch.Tensor) -> None:
        """`apply` of masks the thread has filled and uploaded already, without waiting (the mask
        thread's own call, at the end of its work for an asynchronous step)."""
        num = len(masked.rows)
        if num == 0:
            return
        if self._uploaded is not None:
            self._uploaded.wait()
        apply_token_bitmask(logits, self._bits[:num], None if masked.rows_are_prefix else self._rows[:num])
        if self._applied is not None:
            self._applied.record()
