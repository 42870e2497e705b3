"""The grammar work of a step, on the host off the critical path: advance the constrained requests'
grammars by the previous step's tokens, fill this step's next-token masks and copy them to the
device, then apply the masks to the logits.

llguidance writes one bit per token id (bit `i % 32` of int32 word `i // 32`, 1 = allowed) into a
pinned host buffer, with the GIL released. The runner hands that work to a worker thread once the
step's forward is queued (before an eager forward's Python launch, right after a CUDA graph's replay),
so the thread's few moments under the GIL fall where the main thread only waits, and it waits for
the thread only when the logits exist. Under asynchronous scheduling the thread goes on to queue the
apply and the draw itself (`start(..., then=...)`, `apply_filled`) and the main thread does not wait
for the masks at all, only for that draw to be queued before the next forward. The thread computes
the masks one after another (each llguidance call releases the GIL): on the H200's 16-core host
llguidance's own parallel fill of 64 masks was ~3x slower than the same masks one at a time (RESULTS
"Structured outputs (issue 20)");
`threads > 1` splits the batch into that many runs of masks, each computed one after another by its
own thread. `pool_threads > 0` (read per step) instead accepts the tokens and fills the masks in one
llguidance call each on a pool of that many threads (`LLExecutor`): the mask thread then gives up the
GIL twice a step instead of once per mask, which matters under asynchronous scheduling, where the
main thread plans the next step in Python while the masks are filled (the default stays 0 until the
H100 measures it: `benches/structured_step.py`'s `pool-N` workloads). As soon as the masks are
filled, the thread queues their copy into a device buffer allocated once on a stream of its own, so
when the logits exist only one kernel (`voltllm.ops.structured.apply_token_bitmask`) is left: it
reads the bits and sets the disallowed logits of the constrained rows to -inf. The logits of a
captured CUDA graph are masked the same way, after the replay: the mask never enters the graph.

Advancing the grammars here, one step late, keeps llguidance's token acceptance off the path between
"step N's tokens are known" and "step N+1 is launched". A grammar that ends with step N's token is
then found during step N+1, whose token for that request the scheduler drops (its mask allowed only
EOS): the request's tokens and finish reason are those it would have had (`docs/engine.md`).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from itertools import pairwise

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

    def __init__(self, max_rows: int, vocab_size: int, device: torch.device, threads: int = 1) -> None:
        """threads: how many threads compute a step's masks (the mask thread and `threads - 1`
        helpers, each one run of masks after another); the mask thread accepts the tokens."""
        if threads < 1:
            raise ValueError(f"the mask fill needs at least one thread, got {threads}")
        self.vocab_size = vocab_size
        self.device = device
        self.num_words = (vocab_size + 31) // 32
        on_cuda = device.type == "cuda"
        self._host = torch.empty((max_rows, self.num_words), dtype=torch.int32, pin_memory=on_cuda)
        self._host_rows = torch.empty(max_rows, dtype=torch.int32, pin_memory=on_cuda)
        # Where the masks are read on the device (the host buffers themselves on the CPU).
        self._bits = torch.empty_like(self._host, device=device) if on_cuda else self._host
        self._rows = torch.empty_like(self._host_rows, device=device) if on_cuda else self._host_rows
        self.threads = threads
        # Read per step: 0, the accept and the fill one matcher after another in the mask thread (each
        # fill releases the GIL, and takes it back, once per mask); N > 0, each in one call on an
        # llguidance pool of N threads (`_pool`), the GIL released once. Same masks, same tokens.
        self.pool_threads = 0
        self._pools: dict[int, llguidance.LLExecutor] = {}
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="voltllm-masks")
        self._helpers = ThreadPoolExecutor(threads - 1, "voltllm-masks-help") if threads > 1 else None
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

    def _pool(self) -> llguidance.LLExecutor | None:
        """The llguidance pool of `pool_threads` threads (made on first use), or None (0)."""
        num = self.pool_threads
        if num <= 0:
            return None
        pool = self._pools.get(num)
        if pool is None:
            pool = self._pools[num] = llguidance.LLExecutor(num_threads=num)
        return pool

    def _accept(self, accepts: TokensToAccept) -> list[EndedGrammar]:
        return accepts.accept(self._pool())

    def _fill(self, matchers: list[tuple[llguidance.LLMatcher, int]]) -> None:
        if self._uploaded is not None:
            self._uploaded.synchronize()  # the last upload has read the host buffers
        pool = self._pool()
        if pool is not None:
            # One call, the GIL released once: the pool's threads write each mask into its row.
            pool.unsafe_compute_mask_ptr(
                matchers, self._host.data_ptr(), self.num_words * 4, self._host.shape[0]
            )
            return
        if self._helpers is None or len(matchers) < 2:
            self._fill_run(matchers)
            return
        # Contiguous runs of masks, one per thread; this thread computes the first.
        num_runs = min(self.threads, len(matchers))
        runs = list(pairwise(len(matchers) * k // num_runs for k in range(num_runs + 1)))
        helped = [self._helpers.submit(self._fill_run, matchers[a:b]) for a, b in runs[1:]]
        self._fill_run(matchers[: runs[0][1]])
        for run in helped:
            run.result()

    def _fill_run(self, matchers: list[tuple[llguidance.LLMatcher, int]]) -> None:
        """Compute these masks one after another into their rows of the host buffer."""
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
