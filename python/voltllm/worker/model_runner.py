"""Executes a scheduler plan on the model: flat input tensors -> forward -> logits -> sampled tokens.

The runner keeps the state of every request it is running (token ids, block table, progress) so a
plan only needs to carry diffs for them. A step's batch is the plan's requests in the order of
`num_scheduled_tokens`, each contributing its next `num_scheduled_tokens[id]` tokens back to back.
A request samples only when those tokens reach the end of its known tokens: a non-final prefill
chunk computes KV and samples nothing.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from voltllm.config import CacheConfig
from voltllm.core.sched_output import ModelRunnerOutput, SchedulerOutput
from voltllm.layers.attention.backend import AttentionMetadata
from voltllm.protocol import EngineSamplingParams
from voltllm.worker.cuda_graphs import DecodeGraphs, graph_batch_sizes
from voltllm.worker.sampler import Sampler, SamplingMetadata, seed_for_step
from voltllm.worker.step_inputs import PAD_SLOT, BlockTable, StepBuffers, StepLayout

logger = logging.getLogger(__name__)

DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30
# Block-table updates one step can stage with its inputs (more, rare, go in a copy of their own).
MAX_STAGED_BLOCK_UPDATES = 1 << 16
MAX_BATCHES_OF_KV = 4  # cap, in full batches of max_model_len sequences, on a memory-derived cache


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
class CachedRequestState:
    """What the runner keeps of a running request besides its row of `RequestArrays`."""

    request_id: str
    num_prompt_tokens: int
    sampling_params: EngineSamplingParams
    row: int  # this request's row of the block table and of the request arrays
    num_blocks: int
    generator: torch.Generator | None = None
    # Bias and stop ids as tensors, built once per request rather than every step.
    cache: dict[str, Any] = field(default_factory=dict)


class RequestArrays:
    """Per-request step state in arrays indexed by block-table row, so that a decode step of a few
    hundred requests is prepared and finished with a handful of numpy operations instead of Python
    loops over requests.

    `token_ids[row, :num_tokens[row]]` are the request's prompt and generated tokens (the runner writes
    what it samples), `num_computed[row]` how many of them are in the KV cache.
    """

    def __init__(self, num_rows: int, max_model_len: int) -> None:
        self.token_ids = np.zeros((num_rows + 1, max_model_len + 1), dtype=np.int32)
        self.num_tokens = np.zeros(num_rows + 1, dtype=np.int64)
        self.num_computed = np.zeros(num_rows + 1, dtype=np.int64)
        self.plain_greedy = np.zeros(num_rows + 1, dtype=bool)

    def start(self, row: int, token_ids: tuple[int, ...], num_computed: int, plain_greedy: bool) -> None:
        self.token_ids[row, : len(token_ids)] = token_ids
        self.num_tokens[row] = len(token_ids)
        self.num_computed[row] = num_computed
        self.plain_greedy[row] = plain_greedy

    def tokens(self, row: int) -> list[int]:
        return self.token_ids[row, : self.num_tokens[row]].tolist()


def is_plain_greedy(p: EngineSamplingParams) -> bool:
    """Greedy, and no logit bias, penalties, logprobs or min_tokens: the next token is the argmax."""
    return (
        p.temperature == 0
        and not p.logit_bias
        and p.logprobs is None
        and p.min_tokens == 0
        and p.presence_penalty == 0
        and p.frequency_penalty == 0
        and p.repetition_penalty == 1
    )


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
class _StepInputs:
    sampling_req_ids: list[str]
    sampling_index: list[int] | None  # batch positions of the sequences that sample; None: all do
    rows: np.ndarray  # request-array row of each sequence, in batch order
    ends: np.ndarray  # each sequence's computed tokens after this step
    sampling_rows: np.ndarray  # rows of the sequences that sample, in sampling order
    sampling_ends: np.ndarray  # their token counts (the column their sampled token goes to)
    plain_greedy: bool  # every sampling sequence is plain greedy (`is_plain_greedy`)
    graph_size: int | None = None  # a CUDA graph of this bucket runs the step (the rest is None)
    input_ids: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    metadata: AttentionMetadata | None = None
    logits_indices: torch.Tensor | None = None  # None: every row samples


class ModelRunner:
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
    ) -> None:
        """`enforce_eager=False` lets `capture_cuda_graphs` capture decode steps (CUDA only)."""
        self.model = model
        self.device = device
        self.dtype = dtype
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.requests: dict[str, CachedRequestState] = {}
        self.kv_caches: list[torch.Tensor] = []
        self.num_blocks = 0
        self.enforce_eager = enforce_eager
        self.block_table: BlockTable | None = None
        self.arrays: RequestArrays | None = None
        # The last step's batch: its request ids, their rows, whether all are plain greedy.
        self._last_batch: tuple[list[str], np.ndarray, bool] = ([], np.zeros(0, dtype=np.int64), True)
        self.buffers: StepBuffers | None = None
        self.graphs: DecodeGraphs | None = None
        self.last_timings = StepTimings()
        global_generator = torch.Generator(device=device)
        global_generator.manual_seed(seed)
        self.sampler = Sampler(global_generator)

    # ----- KV cache ------------------------------------------------------------------------------

    def kv_cache_bytes_per_block(self) -> int:
        shape = self.model.kv_cache_shape_per_layer(1, self.block_size)
        elem = torch.empty((), dtype=self.dtype).element_size()
        return int(np.prod(shape)) * elem * self.model.num_layers

    def determine_num_blocks(self, cache: CacheConfig) -> int:
        """KV blocks to allocate: explicit count, explicit bytes, or (on CUDA) what memory allows."""
        if cache.num_kv_blocks is not None:
            return cache.num_kv_blocks
        if cache.kv_cache_memory_bytes is not None:
            budget = cache.kv_cache_memory_bytes
        elif self.device.type == "cuda":
            budget = self._profile_free_cuda_memory(cache.gpu_memory_utilization)
        else:
            budget = DEFAULT_CPU_KV_CACHE_BYTES
        num_blocks = budget // self.kv_cache_bytes_per_block()
        if num_blocks < 1:
            raise RuntimeError(
                f"no memory left for the KV cache ({budget / 2**30:.2f} GiB available); "
                "lower max_num_batched_tokens or raise gpu_memory_utilization"
            )
        # A small model on a large GPU would get millions of blocks, each a Python object in the block
        # pool. Beyond a few full batches of full-length sequences they only feed the prefix cache.
        blocks_per_seq = -(-self.max_model_len // self.block_size)
        limit = MAX_BATCHES_OF_KV * self.max_num_seqs * blocks_per_seq
        if num_blocks > limit:
            logger.info("KV cache capped at %d blocks (memory allows %d)", limit, num_blocks)
        return int(min(num_blocks, limit))

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate the paged KV cache, the block table and the persistent step inputs."""
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
        self._arange = np.arange(max_tokens + 1, dtype=np.int64)  # query offsets, prefill positions
        # (graph bucket, sequences) of the last staged step if it was a graph step: its padding.
        self._padding: tuple[int, int] | None = None

    @torch.inference_mode()
    def _profile_free_cuda_memory(self, utilization: float) -> int:
        """Run the largest step the scheduler can produce (without a KV cache to write), measure its
        peak activation memory, and return what `utilization` of the GPU leaves for the KV cache
        (less a reserve for the CUDA graphs' logits and memory pool when graphs will be captured)."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        num_tokens = self.max_num_batched_tokens
        seq_lens = []
        while sum(seq_lens) < num_tokens:
            seq_lens.append(min(self.max_model_len, num_tokens - sum(seq_lens)))
        dummy_shape = self.model.kv_cache_shape_per_layer(1, self.block_size)
        dummy_caches = [
            torch.zeros(dummy_shape, dtype=self.dtype, device=self.device)
            for _ in range(self.model.num_layers)
        ]
        input_ids, positions, metadata = _prefill_without_cache(seq_lens, self.block_size, self.device)
        hidden = self.model(input_ids, positions, metadata, dummy_caches)
        num_rows = min(self.max_num_seqs, num_tokens)
        self.model.compute_logits(hidden[:num_rows])
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        del hidden, dummy_caches
        current = torch.cuda.memory_allocated(self.device)
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        graphs_reserve = 0
        if self._graphs_wanted():
            # The shared fp32 logits buffer plus the graph pool (about one fp16 logits batch).
            graphs_reserve = 6 * self.max_num_seqs * self.vocab_size + (256 << 20)
        # Everything now resident on the device (weights, other processes) plus the step's transient
        # peak must fit beside the KV cache inside the utilization cap.
        budget = int(total * utilization - (total - free) - (peak - current) - graphs_reserve)
        logger.info(
            "CUDA memory: total %.1f GiB, in use %.1f GiB, step peak %.2f GiB, graphs %.2f GiB, "
            "KV budget %.2f GiB",
            total / 2**30,
            (total - free) / 2**30,
            (peak - current) / 2**30,
            graphs_reserve / 2**30,
            budget / 2**30,
        )
        return max(budget, 0)

    # ----- CUDA graphs ---------------------------------------------------------------------------

    def _graphs_wanted(self) -> bool:
        backend = getattr(self.model, "attn_backend", None)
        return (
            self.device.type == "cuda"
            and not self.enforce_eager
            and bool(getattr(backend, "supports_cuda_graphs", False))
        )

    def capture_cuda_graphs(self) -> None:
        """Capture the decode step for each batch-size bucket (after `initialize_kv_cache`). A no-op
        on the CPU, with `enforce_eager`, or when the attention backend cannot be captured."""
        if not self._graphs_wanted():
            if self.device.type == "cuda" and not self.enforce_eager:
                logger.info("attention backend cannot run in CUDA graphs: decode runs eagerly")
            return
        sizes = graph_batch_sizes(self.max_num_seqs)
        self.graphs = DecodeGraphs(self.model, sizes, self.vocab_size, self.device)
        self.graphs.capture(self._padding_decode_inputs, self.kv_caches)

    def _padding_decode_inputs(
        self, size: int
    ) -> tuple[torch.Tensor, torch.Tensor, Callable[[], AttentionMetadata]]:
        """Buffers holding `size` padding decodes, and the metadata builder a graph of that size
        captures: its device work (the step's block-table updates, the gather of the batch's rows)
        replays with the graph, so a graph step launches nothing but the graph."""
        layout = self._stage_graph(size, 0)
        self.buffers.upload(layout, host_waits=False)
        ids, positions, slots, query_start_loc, seq_lens, rows = self.buffers.device_fields(layout)
        block_updates = self.buffers.device_block_updates(layout)
        table = self.block_table

        def build_metadata() -> AttentionMetadata:
            if table.has_device_copy:
                table.scatter(*block_updates)
            return AttentionMetadata(
                query_start_loc=query_start_loc,
                seq_lens=seq_lens,
                block_tables=table.on_device.index_select(0, rows),
                slot_mapping=slots,
                max_query_len=1,
                # The decode kernel sizes its context split for the longest possible sequence; each
                # sequence's real length comes from `seq_lens` on the device at replay.
                max_seq_len=self.max_model_len,
                query_lens_cpu=(1,) * size,
                seq_lens_cpu=(self.max_model_len,) * size,
            )

        return ids, positions, build_metadata

    def _stage_padding(self, layout: StepLayout, first: int) -> None:
        """Fill staged decode entries from `first` on with padding (and every query offset)."""
        layout.input_ids[first:] = 0
        layout.positions[first:] = 0
        layout.slots[first:] = PAD_SLOT
        layout.query_start_loc[:] = self._arange[: layout.num_seqs + 1]
        layout.seq_lens[first:] = 1
        layout.table_rows[first:] = self.block_table.pad_row

    def _stage_eager(self, num_tokens: int, num_seqs: int, num_logits: int) -> StepLayout:
        """The staging layout of an eager step, holding the block table's queued ids (written to the
        host table too: the step's slots need them; beyond the layout's room they go on their own)."""
        self._padding = None  # the step's fields may lie where a graph bucket's padding was
        table = self.block_table
        num_updates = table.num_pending
        if num_updates > self.buffers.max_block_updates:
            table.flush_unstaged()
            num_updates = 0
        layout = self.buffers.stage(num_tokens, num_seqs, num_updates, num_logits)
        if num_updates:
            table.write_pending(layout.block_index, layout.block_ids)
        return layout

    def _stage_graph(self, size: int, num_seqs: int) -> StepLayout:
        """The staging layout of `num_seqs` decodes replayed by the graph of bucket `size`: padding
        from entry `num_seqs` on, and exactly `size` block-table updates, which the graph scatters
        itself: the block table's queued ids, then writes of 0 into the all-zero pad row."""
        table = self.block_table
        num_updates = table.num_pending
        if num_updates > size:  # (a decode step gives each request at most one block)
            table.flush_unstaged()
            num_updates = 0
        layout = self.buffers.stage(size, size, size)
        if num_updates:
            table.write_pending(layout.block_index[:num_updates], layout.block_ids[:num_updates])
        layout.block_index[num_updates:] = table.pad_positions[: size - num_updates]
        layout.block_ids[num_updates:] = 0
        # The padding is left from the last step when it staged the same: a step writes only its own
        # entries (those before `num_seqs`), and the block updates lie after the fields.
        if (size, num_seqs) != self._padding:
            self._stage_padding(layout, num_seqs)
            self._padding = (size, num_seqs)
        return layout

    # ----- one step ------------------------------------------------------------------------------

    @torch.inference_mode()
    def execute_model(self, plan: SchedulerOutput) -> ModelRunnerOutput:
        """Run one scheduler plan: update request states, compute, sample. Timings in `last_timings`."""
        timings = self.last_timings = StepTimings()
        t0 = time.perf_counter()
        self._update_states(plan)
        if plan.is_empty:
            return ModelRunnerOutput()
        inputs = self._prepare_inputs(plan)
        t1 = time.perf_counter()
        num_sampling = len(inputs.sampling_req_ids)
        if inputs.graph_size is not None:
            logits = self.graphs.replay(inputs.graph_size)
            if num_sampling != inputs.graph_size:
                logits = logits[:num_sampling]
            timings.cuda_graph = True
        else:
            hidden = self.model(inputs.input_ids, inputs.positions, inputs.metadata, self.kv_caches)
            if num_sampling:
                rows = hidden if inputs.logits_indices is None else hidden[inputs.logits_indices]
                logits = self.model.compute_logits(rows)
        t2 = time.perf_counter()
        out = ModelRunnerOutput([None] * len(inputs.rows))
        sampled = None
        if num_sampling:
            sampled = self._sample(logits, inputs, out)
            self.buffers.device_synced()  # the sampled ids are on the host: the step has run
        t3 = time.perf_counter()
        arrays = self.arrays
        arrays.num_computed[inputs.rows] = inputs.ends
        if sampled is not None:
            rows, ends = inputs.sampling_rows, inputs.sampling_ends
            arrays.token_ids[rows, ends] = sampled
            arrays.num_tokens[rows] = ends + 1
        t4 = time.perf_counter()
        timings.prepare_s, timings.forward_s = t1 - t0, t2 - t1
        timings.sync_s, timings.post_s = t3 - t2, t4 - t3
        return out

    def _sample(self, logits: torch.Tensor, inputs: _StepInputs, out: ModelRunnerOutput) -> np.ndarray:
        """Sample the step's tokens into `out` (in batch order); returns them in sampling order."""
        req_ids = inputs.sampling_req_ids
        logprobs = None
        if inputs.plain_greedy:
            # One kernel and one device->host copy: the common greedy batch needs nothing else.
            sampled = logits.argmax(dim=-1).cpu().numpy()
            tokens = sampled.tolist()
        else:
            result = self.sampler(logits, self._sampling_metadata(req_ids))
            tokens = result.sampled_token_ids
            sampled = np.array(tokens, dtype=np.int64)
            if any(lp is not None for lp in result.logprobs):
                logprobs = result.logprobs
        index = inputs.sampling_index
        if index is None:  # every sequence samples
            out.sampled_token_ids = tokens
            out.logprobs = logprobs
        else:
            for i, token_id in zip(index, tokens, strict=True):
                out.sampled_token_ids[i] = token_id
            if logprobs is not None:
                out.logprobs = [None] * len(out.sampled_token_ids)
                for i, logprob in zip(index, logprobs, strict=True):
                    out.logprobs[i] = logprob
        return sampled

    def _update_states(self, plan: SchedulerOutput) -> None:
        if plan.finished_req_ids or plan.scheduled_new_reqs:
            self._last_batch = ([], self._last_batch[1][:0], True)  # ids may now name other rows
        # Finished/preempted ids first: an id may be reused by a new request in the same plan.
        for request_id in plan.finished_req_ids:
            state = self.requests.pop(request_id, None)
            if state is not None:
                self.block_table.free_row(state.row)
        for new in plan.scheduled_new_reqs:
            generator = None
            if new.sampling_params.seed is not None:
                generator = torch.Generator(device=self.device)
            row = self.block_table.add_row(new.block_ids)
            self.requests[new.request_id] = CachedRequestState(
                request_id=new.request_id,
                num_prompt_tokens=new.num_prompt_tokens,
                sampling_params=new.sampling_params,
                row=row,
                num_blocks=len(new.block_ids),
                generator=generator,
            )
            self.arrays.start(
                row, new.token_ids, new.num_computed_tokens, is_plain_greedy(new.sampling_params)
            )
        # About one running request in block_size gets a block each decode step: locals, not lookups.
        requests, num_computed, append = self.requests, self.arrays.num_computed, self.block_table.append
        for cached in plan.scheduled_cached_reqs:
            state = requests[cached.request_id]
            assert num_computed.item(state.row) == cached.num_computed_tokens, (
                f"runner and scheduler disagree on {cached.request_id}: "
                f"{num_computed[state.row]} != {cached.num_computed_tokens}"
            )
            new_block_ids = cached.new_block_ids
            append(state.row, state.num_blocks, new_block_ids)
            state.num_blocks += len(new_block_ids)

    def _batch_rows(self, req_ids: list[str]) -> tuple[np.ndarray, bool]:
        """Request-array rows of the batch, and whether all its requests are plain greedy; reused
        while the batch is the same requests in order."""
        last_ids, last_rows, last_greedy = self._last_batch
        if req_ids != last_ids:
            requests = self.requests
            rows = np.fromiter((requests[r].row for r in req_ids), dtype=np.int64, count=len(req_ids))
            greedy = np.count_nonzero(self.arrays.plain_greedy[rows]) == len(rows)
            self._last_batch = (req_ids, rows, greedy)
            return rows, greedy
        return last_rows, last_greedy

    def _prepare_inputs(self, plan: SchedulerOutput) -> _StepInputs:
        """Stage the step's flat inputs on the host, upload them in one copy, pick a CUDA graph if
        one fits (its inputs are then the buffers themselves) or build the eager step's metadata."""
        arrays = self.arrays
        req_ids = list(plan.num_scheduled_tokens)
        num_seqs = len(req_ids)
        num_tokens = plan.total_num_scheduled_tokens
        rows, plain_greedy = self._batch_rows(req_ids)
        starts = arrays.num_computed[rows]
        pure_decode = num_tokens == num_seqs  # every sequence has a token, so each has exactly one
        if pure_decode:
            ends = starts + 1
        else:
            lens = np.fromiter(plan.num_scheduled_tokens.values(), dtype=np.int64, count=num_seqs)
            ends = starts + lens
        samples = ends == arrays.num_tokens[rows]
        if np.count_nonzero(samples) == num_seqs:  # (several times cheaper than samples.all())
            step = _StepInputs(req_ids, None, rows, ends, rows, ends, plain_greedy)
        else:
            chosen = np.flatnonzero(samples)
            sampling_rows = rows[chosen]
            greedy = plain_greedy or np.count_nonzero(arrays.plain_greedy[sampling_rows]) == len(chosen)
            index = chosen.tolist()
            sampling_req_ids = [req_ids[i] for i in index]
            step = _StepInputs(sampling_req_ids, index, rows, ends, sampling_rows, ends[chosen], greedy)
        num_sampling = len(step.sampling_req_ids)
        if pure_decode and self.graphs is not None and num_sampling == num_seqs:
            step.graph_size = self.graphs.bucket_for(num_seqs)
        graph_size = step.graph_size
        num_logits = 0
        if graph_size is not None:
            layout = self._stage_graph(graph_size, num_seqs)
        else:
            num_logits = num_sampling if num_sampling != num_tokens else 0
            layout = self._stage_eager(num_tokens, num_seqs, num_logits)
        ids, positions, query_start_loc = layout.input_ids, layout.positions, layout.query_start_loc
        if pure_decode:
            ids[:num_tokens] = arrays.token_ids[rows, starts]
            positions[:num_tokens] = starts
            token_rows = rows
            if graph_size is None:
                query_start_loc[:] = self._arange[: num_seqs + 1]
        else:
            query_start_loc[0] = 0
            np.cumsum(lens, out=query_start_loc[1:])
            offsets = np.repeat(query_start_loc[:num_seqs] - starts, lens)
            positions[:] = self._arange[:num_tokens] - offsets
            token_rows = np.repeat(rows, lens)
            ids[:] = arrays.token_ids[token_rows, positions]
        layout.table_rows[:num_seqs] = rows
        pos = positions[:num_tokens]
        blocks = self.block_table.host[token_rows, pos // self.block_size]
        layout.slots[:num_tokens] = blocks * self.block_size + pos % self.block_size
        layout.seq_lens[:num_seqs] = ends
        if num_logits:
            layout.logits_indices[:] = query_start_loc[1:][samples] - 1
        # A step that samples waits for its tokens, so the next step needs no event to reuse the buffer.
        self.buffers.upload(layout, host_waits=num_sampling > 0)
        if graph_size is not None:
            return step  # the graph scatters the block-table updates itself
        if layout.num_block_updates and self.block_table.has_device_copy:
            self.block_table.scatter(*self.buffers.device_block_updates(layout))
        max_seq_len = int(ends.max())
        ids_d, positions_d, slots_d, qsl_d, seq_lens_d, rows_d = self.buffers.device_fields(layout)
        width = -(-max_seq_len // self.block_size)
        step.input_ids, step.positions = ids_d, positions_d
        step.metadata = AttentionMetadata(
            query_start_loc=qsl_d,
            seq_lens=seq_lens_d,
            block_tables=self.block_table.on_device[:, :width].index_select(0, rows_d),
            slot_mapping=slots_d,
            max_query_len=1 if pure_decode else int(lens.max()),
            max_seq_len=max_seq_len,
            query_lens_cpu=(1,) * num_seqs if pure_decode else tuple(lens.tolist()),
            seq_lens_cpu=tuple(ends.tolist()),
        )
        if num_logits:
            step.logits_indices = self.buffers.device_logits_indices(layout)
        return step

    # ----- sampling metadata ---------------------------------------------------------------------

    def _sampling_metadata(self, req_ids: list[str]) -> SamplingMetadata:
        states = [self.requests[r] for r in req_ids]
        params = [s.sampling_params for s in states]
        dev = self.device

        def col(values: list[float], dtype: torch.dtype = torch.float32) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=dev)

        md = SamplingMetadata(
            temperature=col([p.temperature for p in params]),
            all_greedy=all(p.temperature == 0 for p in params),
            num_logprobs=[p.logprobs for p in params],
        )
        if any(p.top_k > 0 for p in params):
            md.top_k = col([p.top_k if p.top_k > 0 else self.vocab_size for p in params], torch.int64)
        if any(p.top_p < 1.0 for p in params):
            md.top_p = col([p.top_p for p in params])
        if any(p.min_p > 0.0 for p in params):
            md.min_p = col([p.min_p for p in params])
        for row, state in enumerate(states):
            num_output_tokens = int(self.arrays.num_tokens[state.row]) - state.num_prompt_tokens
            if state.generator is not None:
                seed = seed_for_step(state.sampling_params.seed, num_output_tokens)
                state.generator.manual_seed(seed)
                md.generators[row] = state.generator
            p = state.sampling_params
            if p.logit_bias:
                if "bias" not in state.cache:
                    ids = col(list(p.logit_bias.keys()), torch.int64)
                    state.cache["bias"] = (ids, col(list(p.logit_bias.values())))
                md.logit_bias.append((row, *state.cache["bias"]))
            if num_output_tokens < p.min_tokens:
                if "stop_ids" not in state.cache:
                    eos = () if p.ignore_eos else self.eos_token_ids
                    state.cache["stop_ids"] = col(sorted({*eos, *p.stop_token_ids}), torch.int64)
                if state.cache["stop_ids"].numel():
                    md.banned_token_ids.append((row, state.cache["stop_ids"]))
        if any(
            p.presence_penalty != 0 or p.frequency_penalty != 0 or p.repetition_penalty != 1 for p in params
        ):
            self._add_penalty_inputs(md, states, col)
        return md

    def _add_penalty_inputs(self, md: SamplingMetadata, states: list[CachedRequestState], col) -> None:
        def padded(rows: list[list[int]]) -> torch.Tensor:
            width = max(1, max(len(r) for r in rows))
            out = np.full((len(rows), width), self.vocab_size, dtype=np.int64)
            for i, r in enumerate(rows):
                out[i, : len(r)] = r
            return torch.from_numpy(out).to(self.device)

        tokens = [self.arrays.tokens(s.row) for s in states]
        md.prompt_token_ids = padded([t[: s.num_prompt_tokens] for t, s in zip(tokens, states, strict=True)])
        md.output_token_ids = padded([t[s.num_prompt_tokens :] for t, s in zip(tokens, states, strict=True)])
        md.presence_penalty = col([s.sampling_params.presence_penalty for s in states])
        md.frequency_penalty = col([s.sampling_params.frequency_penalty for s in states])
        md.repetition_penalty = col([s.sampling_params.repetition_penalty for s in states])


def _prefill_without_cache(
    seq_lens: list[int], block_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Inputs of a prefill of whole sequences that writes no KV (slots -1): the profiling step."""
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    num_tokens = int(lens.sum())
    query_start_loc = torch.zeros(len(seq_lens) + 1, dtype=torch.int32)
    query_start_loc[1:] = lens.cumsum(0)
    positions = torch.cat([torch.arange(n) for n in seq_lens])
    metadata = AttentionMetadata(
        query_start_loc=query_start_loc.to(device),
        seq_lens=lens.to(device),
        block_tables=torch.zeros(
            (len(seq_lens), -(-max(seq_lens) // block_size)), dtype=torch.int32, device=device
        ),
        slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64, device=device),
        max_query_len=max(seq_lens),
        max_seq_len=max(seq_lens),
        query_lens_cpu=tuple(seq_lens),
        seq_lens_cpu=tuple(seq_lens),
    )
    return torch.zeros(num_tokens, dtype=torch.int64, device=device), positions.to(device), metadata
