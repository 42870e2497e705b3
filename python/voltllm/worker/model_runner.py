"""Executes a scheduler plan on the model: flat input tensors -> forward -> logits -> sampled tokens.

The runner keeps the state of every request it is running (token ids, block table, progress) so a
plan only needs to carry diffs for them. A step's batch is the plan's requests in the order of
`num_scheduled_tokens`, each contributing its next `num_scheduled_tokens[id]` tokens back to back.
A request samples only when those tokens reach the end of its known tokens: a non-final prefill
chunk computes KV and samples nothing.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from voltllm.config import CacheConfig
from voltllm.core.sched_output import ModelRunnerOutput, SchedulerOutput
from voltllm.engine.protocol import SamplingParams
from voltllm.layers.attention.backend import AttentionMetadata
from voltllm.worker.sampler import Sampler, SamplingMetadata, seed_for_step

logger = logging.getLogger(__name__)

DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30
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

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...

    def kv_cache_shape_per_layer(self, num_blocks: int, block_size: int) -> tuple[int, ...]: ...


@dataclass
class CachedRequestState:
    request_id: str
    token_ids: list[int]  # prompt + generated so far (the runner appends what it samples)
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    generator: torch.Generator | None = None
    # Bias and stop ids as tensors, built once per request rather than every step.
    cache: dict[str, Any] = field(default_factory=dict)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


@dataclass
class _StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    metadata: AttentionMetadata
    logits_indices: torch.Tensor
    sampling_req_ids: list[str]


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
    ) -> None:
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

    @torch.inference_mode()
    def _profile_free_cuda_memory(self, utilization: float) -> int:
        """Run the largest step the scheduler can produce (without a KV cache to write), measure its
        peak activation memory, and return what `utilization` of the GPU leaves for the KV cache."""
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
        starts = np.zeros(len(seq_lens), dtype=np.int64)
        lens = np.array(seq_lens, dtype=np.int64)
        block_tables = np.zeros((len(seq_lens), -(-max(seq_lens) // self.block_size)), dtype=np.int32)
        inputs = self._build_inputs(starts, lens, block_tables, [0] * num_tokens, write_kv=False)
        hidden = self.model(inputs.input_ids, inputs.positions, inputs.metadata, dummy_caches)
        num_rows = min(self.max_num_seqs, num_tokens)
        self.model.compute_logits(hidden[:num_rows])
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        del hidden, dummy_caches
        current = torch.cuda.memory_allocated(self.device)
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        # Everything now resident on the device (weights, other processes) plus the step's transient
        # peak must fit beside the KV cache inside the utilization cap.
        budget = int(total * utilization - (total - free) - (peak - current))
        logger.info(
            "CUDA memory: total %.1f GiB, in use %.1f GiB, step peak %.2f GiB, KV budget %.2f GiB",
            total / 2**30,
            (total - free) / 2**30,
            (peak - current) / 2**30,
            budget / 2**30,
        )
        return max(budget, 0)

    # ----- one step ------------------------------------------------------------------------------

    @torch.inference_mode()
    def execute_model(self, plan: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(plan)
        if plan.is_empty:
            return ModelRunnerOutput()
        inputs = self._prepare_inputs(plan)
        hidden = self.model(inputs.input_ids, inputs.positions, inputs.metadata, self.kv_caches)
        out = ModelRunnerOutput()
        if inputs.sampling_req_ids:
            logits = self.model.compute_logits(hidden[inputs.logits_indices])
            sampled = self.sampler(logits, self._sampling_metadata(inputs.sampling_req_ids))
            for i, request_id in enumerate(inputs.sampling_req_ids):
                out.sampled_token_ids[request_id] = sampled.sampled_token_ids[i]
                if sampled.logprobs[i] is not None:
                    out.logprobs[request_id] = sampled.logprobs[i]
        for request_id, num_tokens in plan.num_scheduled_tokens.items():
            state = self.requests[request_id]
            state.num_computed_tokens += num_tokens
            if request_id in out.sampled_token_ids:
                state.token_ids.append(out.sampled_token_ids[request_id])
        return out

    def _update_states(self, plan: SchedulerOutput) -> None:
        # Finished/preempted ids first: an id may be reused by a new request in the same plan.
        for request_id in plan.finished_req_ids:
            self.requests.pop(request_id, None)
        for new in plan.scheduled_new_reqs:
            generator = None
            if new.sampling_params.seed is not None:
                generator = torch.Generator(device=self.device)
            self.requests[new.request_id] = CachedRequestState(
                request_id=new.request_id,
                token_ids=list(new.token_ids),
                num_prompt_tokens=new.num_prompt_tokens,
                sampling_params=new.sampling_params,
                block_ids=list(new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
                generator=generator,
            )
        for cached in plan.scheduled_cached_reqs:
            state = self.requests[cached.request_id]
            assert state.num_computed_tokens == cached.num_computed_tokens, (
                f"runner and scheduler disagree on {cached.request_id}: "
                f"{state.num_computed_tokens} != {cached.num_computed_tokens}"
            )
            state.block_ids.extend(cached.new_block_ids)

    def _prepare_inputs(self, plan: SchedulerOutput) -> _StepInputs:
        req_ids = list(plan.num_scheduled_tokens)
        states = [self.requests[r] for r in req_ids]
        starts = np.array([s.num_computed_tokens for s in states], dtype=np.int64)
        lens = np.array([plan.num_scheduled_tokens[r] for r in req_ids], dtype=np.int64)
        block_tables = np.zeros((len(states), max(len(s.block_ids) for s in states)), dtype=np.int32)
        token_ids: list[int] = []
        for i, (state, start, n) in enumerate(zip(states, starts.tolist(), lens.tolist(), strict=True)):
            block_tables[i, : len(state.block_ids)] = state.block_ids
            token_ids += state.token_ids[start : start + n]
        inputs = self._build_inputs(starts, lens, block_tables, token_ids, write_kv=True)
        ends = (starts + lens).tolist()
        sampling = [i for i, (s, end) in enumerate(zip(states, ends, strict=True)) if end == len(s.token_ids)]
        qsl = np.concatenate([[0], np.cumsum(lens)])
        inputs.logits_indices = torch.from_numpy(qsl[1:][sampling] - 1).to(self.device)
        inputs.sampling_req_ids = [req_ids[i] for i in sampling]
        return inputs

    def _build_inputs(
        self,
        starts: np.ndarray,
        lens: np.ndarray,
        block_tables: np.ndarray,
        token_ids: list[int],
        write_kv: bool,
    ) -> _StepInputs:
        """Flat tensors for sequences whose tokens [start, start + len) are computed this step."""
        query_start_loc = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        num_tokens = int(query_start_loc[-1])
        seq_index = np.repeat(np.arange(len(lens)), lens)
        positions = np.arange(num_tokens, dtype=np.int64) - np.repeat(query_start_loc[:-1] - starts, lens)
        if write_kv:
            blocks = block_tables[seq_index, positions // self.block_size].astype(np.int64)
            slot_mapping = blocks * self.block_size + positions % self.block_size
        else:
            slot_mapping = np.full(num_tokens, -1, dtype=np.int64)
        seq_lens = (starts + lens).astype(np.int32)
        dev = self.device
        metadata = AttentionMetadata(
            query_start_loc=torch.from_numpy(query_start_loc).to(dev),
            seq_lens=torch.from_numpy(seq_lens).to(dev),
            block_tables=torch.from_numpy(block_tables).to(dev),
            slot_mapping=torch.from_numpy(slot_mapping).to(dev),
            max_query_len=int(lens.max()),
            max_seq_len=int(seq_lens.max()),
            query_lens_cpu=tuple(lens.tolist()),
            seq_lens_cpu=tuple(seq_lens.tolist()),
        )
        return _StepInputs(
            input_ids=torch.tensor(token_ids, dtype=torch.int64).to(dev),
            positions=torch.from_numpy(positions).to(dev),
            metadata=metadata,
            logits_indices=torch.empty(0, dtype=torch.int64),
            sampling_req_ids=[],
        )

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
            if state.generator is not None:
                seed = seed_for_step(state.sampling_params.seed, state.num_output_tokens)
                state.generator.manual_seed(seed)
                md.generators[row] = state.generator
            p = state.sampling_params
            if p.logit_bias:
                if "bias" not in state.cache:
                    ids = col(list(p.logit_bias.keys()), torch.int64)
                    state.cache["bias"] = (ids, col(list(p.logit_bias.values())))
                md.logit_bias.append((row, *state.cache["bias"]))
            if state.num_output_tokens < p.min_tokens:
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

        md.prompt_token_ids = padded([s.token_ids[: s.num_prompt_tokens] for s in states])
        md.output_token_ids = padded([s.token_ids[s.num_prompt_tokens :] for s in states])
        md.presence_penalty = col([s.sampling_params.presence_penalty for s in states])
        md.frequency_penalty = col([s.sampling_params.frequency_penalty for s in states])
        md.repetition_penalty = col([s.sampling_params.repetition_penalty for s in states])
