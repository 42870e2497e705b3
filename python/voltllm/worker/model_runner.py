"""Executes a scheduler plan on the model: flat input tensors -> forward -> logits -> sampled tokens.

The runner keeps the state of every request it is running (`request_state`: token ids, block table,
progress) so a plan only needs to carry diffs for them. A step is: update the request states from the
plan, stage its inputs (`input_builder`: decode steps, replayed from a CUDA graph when one fits, or
mixed prefill steps), run the model (or the graph), sample (`sampler`, fed by `sampling_metadata`),
and write the sampled tokens back into the request arrays. A request samples only when its scheduled
tokens reach the end of its known tokens: a non-final prefill chunk computes KV and samples nothing.
How many KV blocks to allocate is `kv_cache_sizing`'s question.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from voltllm.config import CacheConfig
from voltllm.core.sched_output import ModelRunnerOutput, SchedulerOutput
from voltllm.layers.attention.backend import AttentionMetadata
from voltllm.protocol import TokenLogprobs
from voltllm.structured_output import EndedGrammar, TokenMasks, TokensToAccept
from voltllm.structured_output.masks import MaskedRows, PendingMasks
from voltllm.worker import kv_cache_sizing
from voltllm.worker.cuda_graphs import DecodeGraphs, graph_batch_sizes, graph_memory_reserve
from voltllm.worker.input_builder import InputBuilder, StepInputs
from voltllm.worker.request_state import CachedRequestState, RequestArrays, uses_penalties
from voltllm.worker.sampler import Sampler, SamplingMetadata, wants_logprobs
from voltllm.worker.sampling_metadata import SamplingStager, build_sampling_metadata, with_section
from voltllm.worker.step_inputs import BlockTable, StepBuffers

logger = logging.getLogger(__name__)

# Block-table updates one step can stage with its inputs (more, rare, go in a copy of their own).
MAX_STAGED_BLOCK_UPDATES = 1 << 16
# Prompt positions whose logits are computed at once for prompt logprobs ([chunk, vocab] float32).
PROMPT_LOGPROBS_CHUNK = 512


class Model(Protocol):
    """What the runner needs from a model (see `voltllm.models`)."""

    num_layers: int

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: AttentionMetadata,
        kv_caches: list[torch.Tensor],
    ) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor: ...

    def kv_cache_shape_per_layer(self, num_blocks: int, block_size: int) -> tuple[int, ...]: ...


@dataclass
class StepTimings:
    """Where the last `execute_model` spent its time, in seconds (host clock)."""

    prepare_s: float = 0.0  # plan -> inputs on the device (host work and async uploads)
    forward_s: float = 0.0  # enqueueing the forward and logits (a graph replay, or eager launches)
    sync_s: float = 0.0  # sampling and waiting for the sampled ids (GPU time the host did not hide)
    post_s: float = 0.0  # sampled ids -> runner state and output
    cuda_graph: bool = False  # the step replayed a CUDA graph

    @property
    def host_s(self) -> float:
        """Host time of the step: everything but waiting on the device."""
        return self.prepare_s + self.forward_s + self.post_s


@dataclass(slots=True)
class StepHandle:
    """A step `ModelRunner.enqueue` launched. `output` is set when the step finished there; otherwise
    the step is running: its sampled ids are on the device (`sampled`, in sampling order) and on their
    way to `host_ids` (`done` is recorded after that copy; None on the CPU). A constrained step's
    draw is queued by the mask thread once its masks are filled (`launch`)."""

    output: ModelRunnerOutput | None
    inputs: StepInputs | None = None
    sampled: torch.Tensor | None = None
    host_ids: torch.Tensor | None = None
    done: torch.cuda.Event | None = None
    row_epochs: np.ndarray | None = None  # of the sampling rows at launch: whose request each was
    written: bool = False  # the ids are in the request arrays
    # A constrained step's draw, queued by the mask thread: resolves (to the grammars that ended with
    # the tokens of the step before) once it is queued; None once waited for, or when queued here.
    launch: Future | None = None
    ended_grammars: list[EndedGrammar] | None = None  # (the launch's result: the output's)

    @property
    def is_running(self) -> bool:
        """The step's ids are not on the host yet: `ModelRunner.collect` waits for them."""
        return self.output is None


class _DeviceIdsCopy:
    """Copies chosen entries of one device tensor of ids into chosen entries of another. The index
    pairs travel in a pinned buffer, two of them alternating, each refilled only once its last copy
    has run (on the CPU nothing is copied)."""

    def __init__(self, max_entries: int, device: torch.device) -> None:
        on_gpu = device.type == "cuda"
        self._host = [torch.zeros(2 * max_entries, dtype=torch.int64, pin_memory=on_gpu) for _ in range(2)]
        self._dev = [torch.zeros_like(h, device=device) if on_gpu else h for h in self._host]
        self._copied = [torch.cuda.Event() if on_gpu else None for _ in range(2)]
        self._slot = 0

    def write(
        self, dst: torch.Tensor, dst_index: np.ndarray, src: torch.Tensor, src_index: np.ndarray
    ) -> None:
        """`dst[dst_index] = src[src_index]`, queued on the current stream."""
        self._slot = slot = 1 - self._slot
        copied = self._copied[slot]
        if copied is not None:
            copied.synchronize()
        n = len(dst_index)
        host, dev = self._host[slot], self._dev[slot]
        staged = host.numpy()
        staged[:n], staged[n : 2 * n] = dst_index, src_index
        if dev is not host:
            dev[: 2 * n].copy_(host[: 2 * n], non_blocking=True)
            copied.record()
        dst.index_copy_(0, dev[:n], src.index_select(0, dev[n : 2 * n]))


class ModelRunner:
    """Runs plans on one model; owns its KV cache, its request states and its step buffers."""

    def __init__(
        self,
        model: Model,
        *,
        device: torch.device,
        dtype: torch.dtype,
        vocab_size: int,
        eos_token_ids: tuple[int, ...],
        block_size: int,
        max_model_len: int,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        seed: int = 0,
        enforce_eager: bool = True,
        samples: bool = True,
    ) -> None:
        """`enforce_eager=False` lets `capture_cuda_graphs` capture decode steps (CUDA only).
        `samples=False` is a tensor-parallel rank other than 0: it computes the logits (their gather
        is a collective every rank joins) but samples nothing, and learns the step's tokens from
        rank 0 through `apply_sampled` before its next step."""
        self.model = model
        self.device = device
        self.dtype = dtype
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.block_size = block_size
        self.max_model_len = max_model_len  # final once `initialize_kv_cache` has run
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.requests: dict[str, CachedRequestState] = {}
        # How many of `requests` have a grammar / are computing prompt logprobs: a step looks for
        # them only when there are any.
        self._num_constrained = 0
        self._num_prompt_logprobs = 0
        self._num_penalized = 0  # requests whose sampling reads their output ids (`uses_penalties`)
        # Asynchronous scheduling (set by the engine): `enqueue` may leave a step running, its ids on
        # the device; the next step reads them there (`_fill_ids_on_device`).
        self.async_scheduling = False
        # The launched step whose ids are not in the request arrays yet (`_write_sampled`).
        self._running: StepHandle | None = None
        self.masks: TokenMasks | None = None
        # The last step's constrained tokens, which this step's mask thread feeds to their grammars
        # before it fills this step's masks (None: the last step sampled none).
        self._to_accept: TokensToAccept | None = None
        # The constrained rows of the last batch in which every sequence sampled, and that batch
        # (`_last_batch`, whose identity changes with its requests): reused while it stays.
        self._masked_batch: tuple[object, MaskedRows] | None = None
        self.kv_caches: list[torch.Tensor] = []
        self.num_blocks = 0
        self.enforce_eager = enforce_eager
        self.samples = samples
        # The last step's sampled ids in sampling order (None: it sampled nothing), for the other ranks.
        self.last_sampled: np.ndarray | None = None
        # Without sampling: the (rows, ends) of the last step's sampling sequences, awaiting their ids.
        self._awaiting_ids: tuple[np.ndarray, np.ndarray] | None = None
        # Built by `initialize_kv_cache`, sized by the KV cache and max_model_len:
        self.block_table: BlockTable | None = None
        self.arrays: RequestArrays | None = None
        self.buffers: StepBuffers | None = None
        self.inputs: InputBuilder | None = None
        # The last step's batch: its request ids, their rows, whether all are plain greedy.
        self._last_batch: tuple[list[str], np.ndarray, bool] = ([], np.zeros(0, dtype=np.int64), True)
        self.graphs: DecodeGraphs | None = None
        self.last_timings = StepTimings()
        self.seed = seed  # of the noise of unseeded rows (`SamplingStager`)
        self.sampler = Sampler()

    # ----- KV cache ------------------------------------------------------------------------------

    def kv_cache_bytes_per_block(self) -> int:
        return kv_cache_sizing.kv_cache_bytes_per_block(self.model, self.block_size, self.dtype)

    def determine_num_blocks(self, cache: CacheConfig) -> int:
        """KV blocks to allocate (`kv_cache_sizing.determine_num_blocks`); on CUDA this profiles the
        largest step."""
        cuda_budget = None
        if self.device.type == "cuda":

            def cuda_budget(utilization: float) -> int:
                return kv_cache_sizing.profile_cuda_kv_budget(
                    self.model,
                    utilization,
                    device=self.device,
                    dtype=self.dtype,
                    block_size=self.block_size,
                    max_model_len=self.max_model_len,
                    max_num_batched_tokens=self.max_num_batched_tokens,
                    max_num_seqs=self.max_num_seqs,
                    reserve_bytes=graph_memory_reserve(self.max_num_seqs, self.vocab_size)
                    if self._graphs_wanted()
                    else 0,
                )

        return kv_cache_sizing.determine_num_blocks(
            cache,
            bytes_per_block=self.kv_cache_bytes_per_block(),
            block_size=self.block_size,
            max_model_len=self.max_model_len,
            max_num_seqs=self.max_num_seqs,
            cuda_budget=cuda_budget,
        )

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate the paged KV cache, the block table, the request arrays and the step buffers."""
        shape = self.model.kv_cache_shape_per_layer(num_blocks, self.block_size)
        self.kv_caches = [
            torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.model.num_layers)
        ]
        self.num_blocks = num_blocks
        logger.info(
            "KV cache: %d blocks of %d tokens (%.2f GiB)",
            num_blocks,
            self.block_size,
            num_blocks * self.kv_cache_bytes_per_block() / 2**30,
        )
        max_blocks_per_seq = -(-self.max_model_len // self.block_size)
        self.block_table = BlockTable(self.max_num_seqs, max_blocks_per_seq, self.device)
        self.arrays = RequestArrays(self.max_num_seqs, self.max_model_len)
        max_tokens = max(self.max_num_batched_tokens, self.max_num_seqs)
        # At least a graph bucket's worth: a graph step stages one update per sequence.
        max_block_updates = max(
            min(self.max_num_seqs * max_blocks_per_seq, MAX_STAGED_BLOCK_UPDATES), self.max_num_seqs
        )
        self.buffers = StepBuffers(max_tokens, self.max_num_seqs, max_block_updates, self.device)
        self.masks = TokenMasks(self.max_num_seqs, self.vocab_size, self.device)
        # For asynchronous steps: per row, a count of the requests that held it (a row freed and taken
        # again between a launch and its ids must not receive them); a scratch map row -> position;
        # two pinned buffers for the sampled ids and events marking their copies; the id copier.
        rows = self.max_num_seqs + 1
        self._row_epochs = np.zeros(rows, dtype=np.int64)
        self._row_positions = np.full(rows, -1, dtype=np.int64)
        on_gpu = self.device.type == "cuda"
        self._host_ids = [
            torch.zeros(self.max_num_seqs, dtype=torch.int64, pin_memory=on_gpu) for _ in range(2)
        ]
        self._ids_copied = [torch.cuda.Event() if on_gpu else None for _ in range(2)]
        self._id_slot = 0
        self._ids_patch = _DeviceIdsCopy(self.max_num_seqs, self.device)
        self.inputs = InputBuilder(
            self.arrays,
            self.block_table,
            self.buffers,
            block_size=self.block_size,
            max_model_len=self.max_model_len,
            sampling=SamplingStager(self.arrays.sampling, self.buffers, self.seed) if self.samples else None,
        )

    # ----- CUDA graphs ---------------------------------------------------------------------------

    def _graphs_wanted(self) -> bool:
        backend = getattr(self.model, "attn_backend", None)
        return (
            self.device.type == "cuda"
            and not self.enforce_eager
            and bool(getattr(backend, "supports_cuda_graphs", False))
        )

    def capture_cuda_graphs(self, graphs: DecodeGraphs | None = None) -> None:
        """Capture the decode step for each batch-size bucket (after `initialize_kv_cache`). A no-op
        on the CPU, with `enforce_eager`, or when the attention backend cannot be captured, unless
        `graphs` are given (tests and benchmarks pass stand-ins that run on the CPU)."""
        if graphs is None:
            if not self._graphs_wanted():
                if self.device.type == "cuda" and not self.enforce_eager:
                    logger.info("attention backend cannot run in CUDA graphs: decode runs eagerly")
                return
            graphs = DecodeGraphs(
                self.model, graph_batch_sizes(self.max_num_seqs), self.vocab_size, self.device
            )
        self.graphs = graphs
        graphs.capture(self.inputs.padding_decode_inputs, self.kv_caches)

    # ----- one step ------------------------------------------------------------------------------

    @torch.inference_mode()
    def execute_model(self, plan: SchedulerOutput) -> ModelRunnerOutput:
        """Run one scheduler plan: update request states, compute, sample. Timings in `last_timings`."""
        return self.collect(self.enqueue(plan))

    @torch.inference_mode()
    def enqueue(self, plan: SchedulerOutput) -> StepHandle:
        """Launch one scheduler plan: update request states, stage the inputs, queue the forward and
        the sampling. With `async_scheduling` a step that can (every sampled id reaches the host in
        one copy, nothing on the host needs them before the next step) is left running: its ids stay
        on the device, where the next step's inputs are read from, and `collect` waits for them. Any
        other step is finished here. Timings in `last_timings`."""
        timings = self.last_timings = StepTimings()
        t0 = time.perf_counter()
        self.last_sampled = None
        if self._awaiting_ids is not None:
            raise RuntimeError("a rank that does not sample needs the last step's ids (apply_sampled) first")
        self._update_states(plan)
        to_accept, self._to_accept = self._to_accept, None
        if plan.is_empty:
            ended = self.masks.start(_NO_MASKED_ROWS, to_accept).ended() if to_accept else []
            return StepHandle(ModelRunnerOutput(ended_grammars=ended))
        req_ids = list(plan.num_scheduled_tokens)
        rows, plain_greedy = self._batch_rows(req_ids)
        scoring_prompt = self._num_prompt_logprobs > 0 and any(
            self.requests[r].prompt_logprobs is not None for r in req_ids
        )
        running = self._running
        if running is not None and (self._num_penalized or scoring_prompt):
            self._write_sampled(running)  # penalties and scores read the ids on the host
            running = None
        graphs = None if scoring_prompt else self.graphs  # prompt logprobs need every position's hidden
        inputs = self.inputs.prepare(plan, req_ids, rows, plain_greedy, graphs)
        if running is not None:
            # Its draw may still be the mask thread's to queue: it must precede this step's reads.
            self._wait_launched(running)
            self._fill_ids_on_device(plan, inputs, running)
        metadata = self._sampling_metadata(inputs) if self.samples else None
        num_sampling = len(inputs.sampling_req_ids)
        # The grammars advance and the masks are filled on the host while the device runs the forward,
        # in a thread started once the forward is queued: an eager forward's Python launch overlaps
        # it, and a graph's replay is queued first so the thread's GIL needs never delay the launch.
        # A rank that samples nothing masks nothing.
        has_mask_work = bool(self._num_constrained and self.samples) or to_accept is not None
        runs_ahead = (
            self.async_scheduling
            and num_sampling
            and self.samples
            and not scoring_prompt
            and (metadata is None or not wants_logprobs(metadata))
        )
        # With masks to apply, a step that runs ahead leaves its draw to the mask thread (`_draw_later`):
        # the thread queues the apply and the draw once the masks are filled, while this thread plans
        # the next step (H100 A/B, RESULTS "Structured outputs (issue 20)": 1.08x unconstrained, against
        # 1.25x when such a step waited for its masks in `enqueue`).
        draws_later = bool(runs_ahead and has_mask_work)
        if draws_later and metadata is not None:
            metadata = with_section(metadata, inputs.sampling, self.buffers.copy_sampling(inputs.layout))
        masks = handle = logits_ready = None
        if has_mask_work and inputs.graph_size is None:
            if draws_later:
                handle, logits_ready = self._new_running_handle(inputs), Future()
                masks = self._draw_later(inputs, to_accept, handle, metadata, logits_ready)
            else:
                masks = self._start_masks(inputs, to_accept)
        prompt_starts = self.arrays.num_computed[rows].copy() if scoring_prompt else None
        t1 = time.perf_counter()
        prompt_logprobs: dict[str, list[TokenLogprobs]] = {}
        if inputs.graph_size is not None:
            logits = self.graphs.replay(inputs.graph_size)
            if num_sampling != inputs.graph_size:
                logits = logits[:num_sampling]
            if draws_later:
                handle = self._new_running_handle(inputs)
                masks = self._draw_later(inputs, to_accept, handle, metadata, logits)
            elif has_mask_work:
                masks = self._start_masks(inputs, to_accept)
            timings.cuda_graph = True
        else:
            hidden, logits = self._eager_forward(inputs, num_sampling, logits_ready)
            if scoring_prompt:
                prompt_logprobs = self._score_prompts(plan, rows, prompt_starts, hidden)
        t2 = time.perf_counter()
        timings.prepare_s, timings.forward_s = t1 - t0, t2 - t1
        if draws_later:
            if masks.rows:  # the next step's mask thread accepts these tokens, once they are here
                self._to_accept = masks.tokens_to_accept_later(lambda: self._ids_on_host(handle))
            timings.post_s = time.perf_counter() - t2
            return handle
        if runs_ahead and masks is None:
            handle = self._new_running_handle(inputs)
            self._draw(handle, logits, metadata)
            timings.post_s = time.perf_counter() - t2
            return handle
        if num_sampling and self.samples:
            if masks is not None:
                self.masks.apply(masks, logits)
            sampled, out = self._sample(logits, inputs, metadata)
            self.buffers.device_synced()  # the sampled ids are on the host: the step has run
        else:
            sampled, out = None, ModelRunnerOutput([None] * len(inputs.rows))
        out.prompt_logprobs = prompt_logprobs
        if masks is not None:
            out.ended_grammars = masks.ended()
            if sampled is not None and masks.rows:
                self._to_accept = masks.tokens_to_accept(sampled)
        t3 = time.perf_counter()
        self.arrays.num_computed[inputs.rows] = inputs.ends
        if sampled is not None:
            self._record_sampled(inputs.sampling_rows, inputs.sampling_ends, sampled)
            self.last_sampled = sampled
        elif num_sampling:
            self._awaiting_ids = (inputs.sampling_rows, inputs.sampling_ends)
        t4 = time.perf_counter()
        timings.sync_s, timings.post_s = t3 - t2, t4 - t3
        return StepHandle(out)

    def _eager_forward(
        self, inputs: StepInputs, num_sampling: int, logits_ready: Future | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The eager forward's hidden states and the sampling rows' logits (None: no row samples);
        `logits_ready` (what the mask thread waits for) gets the logits, or the forward's error."""
        try:
            hidden = self.model(inputs.input_ids, inputs.positions, inputs.metadata, self.kv_caches)
            logits = None
            if num_sampling:
                sampling_hidden = hidden if inputs.logits_indices is None else hidden[inputs.logits_indices]
                logits = self.model.compute_logits(sampling_hidden)
        except BaseException as e:
            if logits_ready is not None:
                logits_ready.set_exception(e)  # the mask thread must not wait for them forever
            raise
        if logits_ready is not None:
            logits_ready.set_result(logits)
        return hidden, logits

    def collect(self, handle: StepHandle) -> ModelRunnerOutput:
        """The output of a step `enqueue` launched, waiting for its sampled ids if they are on their
        way (their wait is added to `last_timings.sync_s`)."""
        if handle.output is not None:
            return handle.output
        t0 = time.perf_counter()
        self._write_sampled(handle)
        tokens = handle.host_ids.tolist()
        self.last_timings.sync_s += time.perf_counter() - t0
        index = handle.inputs.sampling_index
        ended = handle.ended_grammars
        if index is None:  # every sequence sampled
            return ModelRunnerOutput(tokens, ended_grammars=ended)
        out = ModelRunnerOutput([None] * len(handle.inputs.rows), ended_grammars=ended)
        for i, token_id in zip(index, tokens, strict=True):
            out.sampled_token_ids[i] = token_id
        return out

    def _new_running_handle(self, inputs: StepInputs) -> StepHandle:
        """The handle of a step left running, its draw still to queue (`_draw`): the request arrays
        count its tokens now (their ids are written by `_write_sampled`)."""
        slot = self._id_slot = 1 - self._id_slot
        host_ids = self._host_ids[slot][: len(inputs.sampling_req_ids)]
        rows = inputs.sampling_rows
        handle = StepHandle(
            None, inputs, None, host_ids, self._ids_copied[slot], self._row_epochs[rows].copy()
        )
        self.arrays.num_computed[inputs.rows] = inputs.ends
        self.arrays.num_tokens[rows] = inputs.sampling_ends + 1
        self._running = handle
        return handle

    def _draw(self, handle: StepHandle, logits: torch.Tensor, metadata: SamplingMetadata | None) -> None:
        """Queue a running step's draw and the copy of its ids to the host (`handle.done` is recorded
        after it), on the current stream."""
        if metadata is None:
            sampled = self.sampler.argmax(logits)
        else:
            sampled = self.sampler.sample_on_device(logits, metadata)
        handle.host_ids.copy_(sampled, non_blocking=True)
        if handle.done is not None:
            handle.done.record()
        handle.sampled = sampled

    def _draw_later(
        self,
        inputs: StepInputs,
        to_accept: TokensToAccept | None,
        handle: StepHandle,
        metadata: SamplingMetadata | None,
        logits: torch.Tensor | Future,
    ) -> PendingMasks:
        """Start the step's grammar work with its draw at the end of it: the mask thread accepts the
        last step's tokens (waiting for them if they are on their way), fills and uploads this step's
        masks, then queues the apply, the draw and the ids' copy on this thread's current stream
        (`logits` may be a future the forward resolves). `handle.launch` resolves once that is queued:
        nothing may read the draw's ids, or queue work after it, before."""
        stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None

        def apply_and_draw(masked: MaskedRows) -> None:
            step_logits = logits.result() if isinstance(logits, Future) else logits
            with torch.inference_mode(), torch.cuda.stream(stream):
                self.masks.apply_filled(masked, step_logits)
                self._draw(handle, step_logits, metadata)

        masked = self._masked_rows(inputs) if self._num_constrained else _NO_MASKED_ROWS
        masks = self.masks.start(masked, to_accept, apply_and_draw)
        handle.launch = masks.done
        return masks

    def _wait_launched(self, handle: StepHandle) -> None:
        """Wait until a running step's draw is queued (the mask thread queues a constrained step's);
        its grammars' ended list then rides on the handle to `collect`."""
        if handle.launch is not None:
            handle.ended_grammars = handle.launch.result()
            handle.launch = None

    @staticmethod
    def _ids_on_host(handle: StepHandle) -> np.ndarray:
        """A running step's sampled ids once they reach the host (the mask thread's wait: it does not
        touch the request arrays, which are the main thread's)."""
        launch = handle.launch  # (the main thread may clear it meanwhile)
        if launch is not None:
            launch.result()  # queued by an earlier piece of the mask thread's work: done already
        if handle.done is not None:
            handle.done.synchronize()
        return handle.host_ids.numpy()

    def _write_sampled(self, handle: StepHandle) -> None:
        """Wait for a launched step's ids and write them into the rows still held by the requests
        that sampled them (a row may have been freed and taken by a new request since)."""
        if self._running is handle:
            self._running = None
        if handle.written:
            return
        self._wait_launched(handle)
        if handle.done is not None:
            handle.done.synchronize()
        inputs, ids = handle.inputs, handle.host_ids.numpy()
        rows, ends = inputs.sampling_rows, inputs.sampling_ends
        live = self._row_epochs[rows] == handle.row_epochs
        if np.count_nonzero(live) == len(rows):
            self.arrays.token_ids[rows, ends] = ids
        else:
            self.arrays.token_ids[rows[live], ends[live]] = ids[live]
        handle.written = True

    def _fill_ids_on_device(self, plan: SchedulerOutput, inputs: StepInputs, running: StepHandle) -> None:
        """Write the ids the running step samples into this step's uploaded input ids, where a
        sequence's next token is one of them (the host staged a stale value there). Queued after the
        upload and before the forward, so the graph or the eager forward reads them."""
        before = running.inputs
        num_seqs = len(inputs.rows)
        decode = plan.total_num_scheduled_tokens == num_seqs
        if decode and inputs.rows is before.rows and before.sampling_index is None:
            # The same batch in the same order, all of which sampled: the common steady decode.
            inputs.input_ids[:num_seqs].copy_(running.sampled)
            return
        position = self._row_positions
        position[before.sampling_rows] = np.arange(len(before.sampling_rows))
        source = position[inputs.rows]
        position[before.sampling_rows] = -1
        (entries,) = np.nonzero(source >= 0)
        source = source[entries]
        same_request = running.row_epochs[source] == self._row_epochs[inputs.rows[entries]]
        entries, source = entries[same_request], source[same_request]
        if not len(entries):
            return
        if not decode:  # a sequence's pending id is its one scheduled token: the first of its span
            lens = np.fromiter(plan.num_scheduled_tokens.values(), dtype=np.int64, count=num_seqs)
            entries = (np.cumsum(lens) - lens)[entries]
        self._ids_patch.write(inputs.input_ids, entries, running.sampled, source)

    def apply_sampled(self, token_ids: np.ndarray | None) -> None:
        """Give a rank that does not sample the ids rank 0 sampled in its last step (its
        `last_sampled`); None when that step sampled nothing."""
        if self._awaiting_ids is None:
            if token_ids is not None:
                raise RuntimeError(f"{len(token_ids)} sampled ids arrived for a step that sampled nothing")
            return
        rows, ends = self._awaiting_ids
        if token_ids is None or len(token_ids) != len(rows):
            got = 0 if token_ids is None else len(token_ids)
            raise RuntimeError(f"the last step sampled {len(rows)} sequences but {got} ids arrived")
        self._record_sampled(rows, ends, token_ids)
        self._awaiting_ids = None

    def _record_sampled(self, rows: np.ndarray, ends: np.ndarray, token_ids: np.ndarray) -> None:
        """Append each sampling sequence's new token to its request row."""
        self.arrays.token_ids[rows, ends] = token_ids
        self.arrays.num_tokens[rows] = ends + 1

    def _sampling_metadata(self, inputs: StepInputs) -> SamplingMetadata | None:
        """The sampler's inputs for a step that samples beyond plain greedy (None: plain greedy).

        Its columns and seeds came with the step's upload; built before the forward is queued, since
        the rare inputs made here (penalties' token ids, a request's first logit-bias tensors) are
        copies that wait for the stream, which is idle now."""
        if inputs.sampling is None:
            return None
        ids, requests = inputs.sampling_req_ids, self.requests
        return build_sampling_metadata(
            inputs.sampling,
            lambda i: requests[ids[i]],
            self.arrays,
            device=self.device,
            vocab_size=self.vocab_size,
            eos_token_ids=self.eos_token_ids,
        )

    def _sample(
        self, logits: torch.Tensor, inputs: StepInputs, metadata: SamplingMetadata | None
    ) -> tuple[np.ndarray, ModelRunnerOutput]:
        """The step's sampled tokens in sampling order, and the runner output (in batch order);
        `metadata` is `_sampling_metadata`'s (None: plain greedy)."""
        logprobs = None
        if metadata is None:
            # One kernel and one device->host copy: the common greedy batch needs nothing else.
            sampled = self.sampler.argmax(logits).cpu().numpy()
            tokens = sampled.tolist()
        else:
            result = self.sampler(logits, metadata)
            sampled, logprobs = result.sampled, result.logprobs
            tokens = sampled.tolist()
        index = inputs.sampling_index
        if index is None:  # every sequence samples
            return sampled, ModelRunnerOutput(tokens, logprobs)
        out = ModelRunnerOutput([None] * len(inputs.rows))
        for i, token_id in zip(index, tokens, strict=True):
            out.sampled_token_ids[i] = token_id
        if logprobs is not None:
            out.logprobs = [None] * len(inputs.rows)
            for i, logprob in zip(index, logprobs, strict=True):
                out.logprobs[i] = logprob
        return sampled, out

    def _start_masks(self, inputs: StepInputs, to_accept: TokensToAccept | None) -> PendingMasks | None:
        """Start this step's grammar work: accept the last step's constrained tokens, then fill the
        masks of this step's constrained sampling rows (None: neither is needed)."""
        masked = self._masked_rows(inputs) if self._num_constrained and self.samples else _NO_MASKED_ROWS
        if not masked.rows and to_accept is None:
            return None
        return self.masks.start(masked, to_accept)

    def _masked_rows(self, inputs: StepInputs) -> MaskedRows:
        """The constrained rows among this step's sampling ones (cached while the batch stays)."""
        every_row_samples = inputs.sampling_index is None
        cached = self._masked_batch
        if every_row_samples and cached is not None and cached[0] is self._last_batch:
            return cached[1]
        masked = MaskedRows(
            [
                (i, request_id, state.grammar)
                for i, request_id in enumerate(inputs.sampling_req_ids)
                if (state := self.requests[request_id]).grammar is not None
            ]
        )
        self._masked_batch = (self._last_batch, masked) if every_row_samples else None
        return masked

    def _score_prompts(
        self, plan: SchedulerOutput, rows: np.ndarray, starts: np.ndarray, hidden: torch.Tensor
    ) -> dict[str, list[TokenLogprobs]]:
        """Add this step's prompt positions to each scoring request's prompt logprobs; returns the
        complete lists of the requests whose prompt ends this step.

        Position p's logits score token p + 1, so a chunk of positions [start, start + n) scores
        tokens start + 1 .. min(start + n, num_prompt_tokens - 1); hidden: [num_tokens, hidden_size]
        in batch order."""
        done: dict[str, list[TokenLogprobs]] = {}
        offset = 0
        for (request_id, num_tokens), row, start in zip(
            plan.num_scheduled_tokens.items(), rows.tolist(), starts.tolist(), strict=True
        ):
            state = self.requests[request_id]
            if state.prompt_logprobs is not None:
                # One past the last position that scores a prompt token (the last one scores none).
                end = min(start + num_tokens, state.num_prompt_tokens - 1)
                for first in range(start, end, PROMPT_LOGPROBS_CHUNK):
                    last = min(first + PROMPT_LOGPROBS_CHUNK, end)
                    targets = self.arrays.token_ids[row, first + 1 : last + 1]
                    positions = hidden[offset + first - start : offset + last - start]
                    logits = self.model.compute_logits(positions)
                    num_top = state.sampling_params.prompt_logprobs
                    state.prompt_logprobs += _token_logprobs(logits, targets, num_top)
                if start + num_tokens >= state.num_prompt_tokens:
                    done[request_id], state.prompt_logprobs = state.prompt_logprobs, None
                    self._num_prompt_logprobs -= 1
            offset += num_tokens
        return done

    def _update_states(self, plan: SchedulerOutput) -> None:
        if plan.finished_req_ids or plan.scheduled_new_reqs:
            self._last_batch = ([], self._last_batch[1][:0], True)  # ids may now name other rows
        # Finished/preempted ids first: an id may be reused by a new request in the same plan.
        for request_id in plan.finished_req_ids:
            state = self.requests.pop(request_id, None)
            if state is not None:
                self.block_table.free_row(state.row)
                self._num_constrained -= state.grammar is not None
                self._num_penalized -= uses_penalties(state.sampling_params)
                self._num_prompt_logprobs -= state.prompt_logprobs is not None
        for new in plan.scheduled_new_reqs:
            row = self.block_table.add_row(new.block_ids)
            self.requests[new.request_id] = CachedRequestState(
                request_id=new.request_id,
                num_prompt_tokens=new.num_prompt_tokens,
                sampling_params=new.sampling_params,
                row=row,
                num_blocks=len(new.block_ids),
                grammar=new.grammar,
                prompt_logprobs=[] if new.wants_prompt_logprobs else None,
            )
            self._num_constrained += new.grammar is not None
            self._num_prompt_logprobs += new.wants_prompt_logprobs
            self._num_penalized += uses_penalties(new.sampling_params)
            self._row_epochs[row] += 1
            self.arrays.start(
                row, new.token_ids, new.num_computed_tokens, new.sampling_params, new.num_prompt_tokens
            )
        num_computed = self.arrays.num_computed
        for cached in plan.scheduled_cached_reqs:
            state = self.requests[cached.request_id]
            assert num_computed.item(state.row) == cached.num_computed_tokens, (
                f"runner and scheduler disagree on {cached.request_id}: "
                f"{num_computed[state.row]} != {cached.num_computed_tokens}"
            )
            self.block_table.append(state.row, state.num_blocks, cached.new_block_ids)
            state.num_blocks += len(cached.new_block_ids)

    def _batch_rows(self, req_ids: list[str]) -> tuple[np.ndarray, bool]:
        """Request-array rows of the batch, and whether all its requests are plain greedy; reused
        while the batch is the same requests in order."""
        last_ids, last_rows, last_greedy = self._last_batch
        if req_ids != last_ids:
            rows = np.fromiter((self.requests[r].row for r in req_ids), dtype=np.int64, count=len(req_ids))
            greedy = np.count_nonzero(self.arrays.plain_greedy[rows]) == len(rows)
            self._last_batch = (req_ids, rows, greedy)
            return rows, greedy
        return last_rows, last_greedy


_NO_MASKED_ROWS = MaskedRows([])


def _token_logprobs(logits: torch.Tensor, targets: np.ndarray, num_top: int) -> list[TokenLogprobs]:
    """Each row's log-probability of its target token, the target's rank and the top `num_top`
    alternatives, under the model's own distribution (log_softmax of the raw logits).

    logits: [n, vocab]; targets: [n] token ids."""
    logprobs = logits.float().log_softmax(dim=-1)
    target_ids = torch.from_numpy(targets.astype(np.int64)).to(logprobs.device)
    target_lp = logprobs.gather(1, target_ids.unsqueeze(1))
    ranks = ((logprobs > target_lp).sum(dim=-1) + 1).tolist()
    ids, lps = target_ids.tolist(), target_lp.squeeze(1).tolist()
    if num_top > 0:
        top_lp, top_ids = logprobs.topk(num_top, dim=-1)
        top_lp, top_ids = top_lp.tolist(), top_ids.tolist()
    out = []
    for i, (token_id, lp, rank) in enumerate(zip(ids, lps, ranks, strict=True)):
        if num_top > 0:
            out.append(TokenLogprobs([token_id, *top_ids[i]], [lp, *top_lp[i]], rank))
        else:
            out.append(TokenLogprobs([token_id], [lp], rank))
    return out
