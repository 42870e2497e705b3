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
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from voltllm.config import CacheConfig
from voltllm.core.sched_output import ModelRunnerOutput, SchedulerOutput
from voltllm.layers.attention.backend import AttentionMetadata
from voltllm.protocol import TokenLogprobs
from voltllm.structured_output import TokenMasks
from voltllm.structured_output.masks import MaskedRows, PendingMasks
from voltllm.worker import kv_cache_sizing
from voltllm.worker.cuda_graphs import DecodeGraphs, graph_batch_sizes, graph_memory_reserve
from voltllm.worker.input_builder import InputBuilder, StepInputs
from voltllm.worker.request_state import CachedRequestState, RequestArrays
from voltllm.worker.sampler import Sampler, SamplingMetadata
from voltllm.worker.sampling_metadata import build_sampling_metadata, is_plain_greedy
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
        self.masks: TokenMasks | None = None
        # The grammar work the last step started once its tokens were known: accepting them, then
        # filling the masks of the same constrained rows, for this step (None: none started).
        self._ahead: PendingMasks | None = None
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
        global_generator = torch.Generator(device=device)
        global_generator.manual_seed(seed)
        self.sampler = Sampler(global_generator)

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
        self.inputs = InputBuilder(
            self.arrays,
            self.block_table,
            self.buffers,
            block_size=self.block_size,
            max_model_len=self.max_model_len,
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
        timings = self.last_timings = StepTimings()
        t0 = time.perf_counter()
        self.last_sampled = None
        if self._awaiting_ids is not None:
            raise RuntimeError("a rank that does not sample needs the last step's ids (apply_sampled) first")
        self._update_states(plan)
        ahead, self._ahead = self._ahead, None
        if plan.is_empty:
            return ModelRunnerOutput(ended_grammars=ahead.ended() if ahead else [])
        req_ids = list(plan.num_scheduled_tokens)
        rows, plain_greedy = self._batch_rows(req_ids)
        scoring_prompt = self._num_prompt_logprobs > 0 and any(
            self.requests[r].prompt_logprobs is not None for r in req_ids
        )
        graphs = None if scoring_prompt else self.graphs  # prompt logprobs need every position's hidden
        inputs = self.inputs.prepare(plan, req_ids, rows, plain_greedy, graphs)
        # The grammars advance and the masks are filled on the host while the device runs the forward.
        wants_masks = self._num_constrained and self.samples  # a rank that samples nothing masks nothing
        masks = self._start_masks(inputs, ahead) if wants_masks or ahead else None
        prompt_starts = self.arrays.num_computed[rows].copy() if scoring_prompt else None
        metadata = self._sampling_metadata(inputs) if self.samples else None
        t1 = time.perf_counter()
        num_sampling = len(inputs.sampling_req_ids)
        prompt_logprobs: dict[str, list[TokenLogprobs]] = {}
        if inputs.graph_size is not None:
            logits = self.graphs.replay(inputs.graph_size)
            if num_sampling != inputs.graph_size:
                logits = logits[:num_sampling]
            timings.cuda_graph = True
        else:
            hidden = self.model(inputs.input_ids, inputs.positions, inputs.metadata, self.kv_caches)
            if num_sampling:
                sampling_hidden = hidden if inputs.logits_indices is None else hidden[inputs.logits_indices]
                logits = self.model.compute_logits(sampling_hidden)
            if scoring_prompt:
                prompt_logprobs = self._score_prompts(plan, rows, prompt_starts, hidden)
        t2 = time.perf_counter()
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
                # The next step's masks, for these rows if the batch stays: started now, so that
                # they fill while this step's tokens are processed and the next step is staged.
                self._ahead = self.masks.start(masks.masked, masks.tokens_to_accept(sampled))
        t3 = time.perf_counter()
        self.arrays.num_computed[inputs.rows] = inputs.ends
        if sampled is not None:
            self._record_sampled(inputs.sampling_rows, inputs.sampling_ends, sampled)
            self.last_sampled = sampled
        elif num_sampling:
            self._awaiting_ids = (inputs.sampling_rows, inputs.sampling_ends)
        t4 = time.perf_counter()
        timings.prepare_s, timings.forward_s = t1 - t0, t2 - t1
        timings.sync_s, timings.post_s = t3 - t2, t4 - t3
        return out

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
        """The sampler's inputs for a step that samples beyond plain greedy, with its seeds on the device.

        Built before the forward is queued: a host-to-device copy of a host list waits for the stream,
        which is idle here, while after the forward it would wait for the whole forward and leave the
        device idle while the host then queues the draw."""
        if not inputs.sampling_req_ids or inputs.plain_greedy:
            return None
        metadata = build_sampling_metadata(
            [self.requests[r] for r in inputs.sampling_req_ids],
            self.arrays,
            device=self.device,
            vocab_size=self.vocab_size,
            eos_token_ids=self.eos_token_ids,
        )
        rows = len(inputs.sampling_req_ids)
        metadata.seed_tensor = self.sampler.seed_tensor(metadata, rows, self.device)
        return metadata

    def _sample(
        self, logits: torch.Tensor, inputs: StepInputs, metadata: SamplingMetadata | None
    ) -> tuple[np.ndarray, ModelRunnerOutput]:
        """The step's sampled tokens in sampling order, and the runner output (in batch order);
        `metadata` is `_sampling_metadata`'s (None: plain greedy)."""
        logprobs = None
        if metadata is None:
            # One kernel and one device->host copy: the common greedy batch needs nothing else.
            sampled = logits.argmax(dim=-1).cpu().numpy()
            tokens = sampled.tolist()
        else:
            result = self.sampler(logits, metadata)
            tokens = result.sampled_token_ids
            sampled = np.array(tokens, dtype=np.int64)
            if any(lp is not None for lp in result.logprobs):
                logprobs = result.logprobs
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

    def _start_masks(self, inputs: StepInputs, ahead: PendingMasks | None) -> PendingMasks | None:
        """This step's grammar work: the work the last step started when it filled this batch's rows
        (the batch stayed), else a fill of this step's constrained rows after that work (None: no
        work started and no constrained request samples)."""
        masked = self._masked_rows(inputs) if self._num_constrained else _NO_MASKED_ROWS
        if ahead is not None and ahead.masked is masked:
            return ahead
        if not masked.rows and ahead is None:
            return None
        return self.masks.start(masked, after=ahead)

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
            self.arrays.start(
                row, new.token_ids, new.num_computed_tokens, is_plain_greedy(new.sampling_params)
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
