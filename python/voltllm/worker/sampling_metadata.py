"""The sampler's per-step inputs (`SamplingMetadata`), staged from the runner's request arrays.

Each running request's settings live in the row-indexed `SamplingColumns` of the request arrays,
written once when it starts. A step that samples beyond plain greedy gathers its sampling rows'
columns and its noise seeds straight into the step's staging buffer (`SamplingStager.stage`), so they
reach the device in the step's one upload: no per-request Python and no synchronous copy per step. The
metadata's tensors are views of that upload (`build_sampling_metadata`).

What depends on the batch but not on the step (which filters any row uses, which rows are seeded, the
logit-bias tensors) is worked out once per batch (`BatchSampling`) and kept while the batch stays.
Tensors that only change with the request (logit bias, the stop ids that min_tokens masks) are built
once per request and kept on its `CachedRequestState`. A seeded request's noise seed is derived every
step from its seed and the number of tokens it has generated (`seeds_for_step`), which is what makes
its tokens independent of the batch; the other rows get fresh seeds from the stager's generator.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from voltllm.worker.request_state import CachedRequestState, RequestArrays, SamplingColumns
from voltllm.worker.sampler import SamplingMetadata, seeds_for_step
from voltllm.worker.step_inputs import StepBuffers, StepLayout


@dataclass(slots=True)
class BatchSampling:
    """What a batch's sampling rows need beyond their columns, computed once while the batch stays.

    Positions are indices into the batch's sampling order."""

    rows: np.ndarray  # the request-array rows it describes (compared by identity)
    all_greedy: bool
    uses_top_k: bool
    min_top_p: float  # the smallest top-p of the rows (1: none filters by it)
    uses_min_p: bool
    uses_penalties: bool
    seeded: np.ndarray  # positions of the seeded rows
    seeds: np.ndarray  # their user seeds (uint64)
    seeded_prompt: np.ndarray  # their prompt lengths
    min_tokens: np.ndarray  # positions of the rows with a min_tokens
    logit_bias: np.ndarray  # positions of the rows with a logit bias
    num_logprobs: list[int | None]  # per row; empty: no row wants logprobs
    # (position, token ids, bias) per logit-bias row, from the request states on first use.
    bias_entries: list[tuple[int, torch.Tensor, torch.Tensor]] | None = None

    @property
    def uses_top_p(self) -> bool:
        """Some row filters by top-p."""
        return self.min_top_p < 1


@dataclass(slots=True)
class StagedSampling:
    """A step's staged sampling section: the batch's facts, the rows' token counts, the device views."""

    batch: BatchSampling
    ends: np.ndarray  # each sampling row's token count (the column its sampled token goes to)
    seeds: torch.Tensor  # [m] int64
    floats: tuple[torch.Tensor, ...]  # [m] float32 each, in `SamplingColumns`' order
    top_k: torch.Tensor  # [m] int32
    # The metadata built from it when nothing in it changes per step but the seeds (which it reads
    # from `seeds` on the device): reused with the staged section.
    metadata: SamplingMetadata | None = None


class SamplingStager:
    """Writes a step's sampling rows' settings and noise seeds into its staging layout."""

    def __init__(self, columns: SamplingColumns, buffers: StepBuffers, seed: int) -> None:
        self.columns = columns
        self.buffers = buffers
        self._rng = np.random.Generator(np.random.PCG64(seed))  # seeds of the unseeded rows
        self._batch: BatchSampling | None = None
        # The last section staged and the buffer's `num_staged` then: while the same batch is staged
        # into the same layout step after step, its settings are still in the host buffer.
        self._last: tuple[StagedSampling, StepLayout, int] | None = None

    def stage(self, layout: StepLayout, rows: np.ndarray, ends: np.ndarray) -> StagedSampling:
        """Fill `layout`'s sampling section (`layout.num_sampling == len(rows)`) for sampling rows
        `rows` whose token counts are `ends`; returns the device views of it."""
        batch = self._batch_of(rows)
        last = self._last
        if (
            last is not None
            and last[0].batch is batch
            and last[1] is layout
            and last[2] + 1 == self.buffers.num_staged
        ):
            # The same settings and views: only the seeds (written below) and the counts are new.
            previous = last[0]
            staged = StagedSampling(
                batch, ends, previous.seeds, previous.floats, previous.top_k, previous.metadata
            )
        else:
            layout.sampling_floats[:] = self.columns.floats[:, rows]
            layout.top_k[:] = self.columns.top_k[rows]
            staged = StagedSampling(batch, ends, *self.buffers.device_sampling(layout))
        self._last = (staged, layout, self.buffers.num_staged)
        seeds = layout.seeds
        seeds[:] = self._rng.bit_generator.random_raw(len(rows))
        if batch.seeded.size:
            generated = ends[batch.seeded] - batch.seeded_prompt
            seeds[batch.seeded] = seeds_for_step(batch.seeds, generated)
        return staged

    def _batch_of(self, rows: np.ndarray) -> BatchSampling:
        """The batch facts of `rows`: the last ones while the batch is the same rows object (the
        runner keeps one while its batch is unchanged)."""
        cached = self._batch
        if cached is not None and cached.rows is rows:
            return cached
        c = self.columns
        floats = c.floats[:, rows]
        seeded = np.flatnonzero(c.seeded[rows])
        num_logprobs = c.num_logprobs[rows]
        self._batch = batch = BatchSampling(
            rows=rows,
            all_greedy=not np.count_nonzero(floats[SamplingColumns.TEMPERATURE]),
            uses_top_k=bool(np.count_nonzero(c.top_k[rows] > 0)),
            min_top_p=float(floats[SamplingColumns.TOP_P].min(initial=1.0)),
            uses_min_p=bool(np.count_nonzero(floats[SamplingColumns.MIN_P] > 0)),
            uses_penalties=bool(
                np.count_nonzero(floats[SamplingColumns.PRESENCE])
                or np.count_nonzero(floats[SamplingColumns.FREQUENCY])
                or np.count_nonzero(floats[SamplingColumns.REPETITION] != 1)
            ),
            seeded=seeded,
            seeds=c.seed[rows[seeded]],
            seeded_prompt=c.num_prompt[rows[seeded]],
            min_tokens=np.flatnonzero(c.min_tokens[rows]),
            logit_bias=np.flatnonzero(c.has_logit_bias[rows]),
            num_logprobs=[n if n >= 0 else None for n in num_logprobs.tolist()]
            if np.count_nonzero(num_logprobs >= 0)
            else [],
        )
        return batch


def build_sampling_metadata(
    staged: StagedSampling,
    state_at: Callable[[int], CachedRequestState],
    arrays: RequestArrays,
    *,
    device: torch.device,
    vocab_size: int,
    eos_token_ids: tuple[int, ...],
) -> SamplingMetadata:
    """The metadata of a step whose sampling section is `staged`; `state_at(i)` is the state of its
    i-th sampling row (asked only for rows with a logit bias or a min_tokens still to reach)."""
    if staged.metadata is not None:
        return staged.metadata
    batch, floats = staged.batch, staged.floats
    md = SamplingMetadata(
        temperature=floats[SamplingColumns.TEMPERATURE],
        all_greedy=batch.all_greedy,
        num_logprobs=batch.num_logprobs,
        seeds=staged.seeds,
    )
    if batch.uses_top_k:
        md.top_k = staged.top_k
    if batch.uses_top_p:
        md.top_p, md.min_top_p = floats[SamplingColumns.TOP_P], batch.min_top_p
    if batch.uses_min_p:
        md.min_p = floats[SamplingColumns.MIN_P]
    if batch.logit_bias.size:
        if batch.bias_entries is None:
            batch.bias_entries = [(i, *_logit_bias(state_at(i), device)) for i in batch.logit_bias.tolist()]
        md.logit_bias = batch.bias_entries
    if batch.min_tokens.size:
        md.banned_token_ids = _min_tokens_bans(staged, state_at, arrays, device, eos_token_ids)
    if batch.uses_penalties:
        _add_penalty_inputs(md, staged, arrays, vocab_size, device)
    if not batch.min_tokens.size and not batch.uses_penalties:
        staged.metadata = md  # nothing in it but the seeds changes per step
    return md


def _logit_bias(state: CachedRequestState, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A request's (token ids, bias) on the device, built on first use."""
    if state.logit_bias is None:
        bias = state.sampling_params.logit_bias
        state.logit_bias = (
            torch.tensor(list(bias), dtype=torch.int64, device=device),
            torch.tensor(list(bias.values()), dtype=torch.float32, device=device),
        )
    return state.logit_bias


def _min_tokens_bans(
    staged: StagedSampling,
    state_at: Callable[[int], CachedRequestState],
    arrays: RequestArrays,
    device: torch.device,
    eos_token_ids: tuple[int, ...],
) -> list[tuple[int, torch.Tensor]]:
    """(position, stop ids) for each row that has not generated its min_tokens yet."""
    positions = staged.batch.min_tokens
    rows = staged.batch.rows[positions]
    generated = staged.ends[positions] - arrays.sampling.num_prompt[rows]
    bans = []
    for i in positions[generated < arrays.sampling.min_tokens[rows]].tolist():
        state = state_at(i)
        if state.min_tokens_stop_ids is None:
            p = state.sampling_params
            eos = () if p.ignore_eos else eos_token_ids
            ids = sorted({*eos, *p.stop_token_ids})
            state.min_tokens_stop_ids = torch.tensor(ids, dtype=torch.int64, device=device)
        if state.min_tokens_stop_ids.numel():
            bans.append((i, state.min_tokens_stop_ids))
    return bans


def _add_penalty_inputs(
    md: SamplingMetadata,
    staged: StagedSampling,
    arrays: RequestArrays,
    vocab_size: int,
    device: torch.device,
) -> None:
    """Prompt and output token ids per row (other positions hold `vocab_size`) and the penalty columns.

    The id matrices are as wide as the longest row and copied to the device per step (penalised
    batches only; the copy is made before the forward is queued, while the device is idle)."""
    rows = staged.batch.rows
    width = max(1, int(staged.ends.max()))
    tokens = arrays.token_ids[rows, :width]
    positions = np.arange(width)
    num_prompt = arrays.sampling.num_prompt[rows][:, None]
    in_prompt = positions < num_prompt
    in_output = ~in_prompt & (positions < staged.ends[:, None])
    md.prompt_token_ids = _ids_where(in_prompt, tokens, vocab_size, device)
    md.output_token_ids = _ids_where(in_output, tokens, vocab_size, device)
    floats = staged.floats
    md.presence_penalty = floats[SamplingColumns.PRESENCE]
    md.frequency_penalty = floats[SamplingColumns.FREQUENCY]
    md.repetition_penalty = floats[SamplingColumns.REPETITION]


def _ids_where(mask: np.ndarray, tokens: np.ndarray, pad: int, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.where(mask, tokens, pad).astype(np.int64)).to(device)


def with_section(
    md: SamplingMetadata,
    staged: StagedSampling,
    section: tuple[torch.Tensor, tuple[torch.Tensor, ...], torch.Tensor],
) -> SamplingMetadata:
    """`md` (built from `staged`) reading the staged section's twins in `section` instead (seeds,
    floats, top-k: `StepBuffers.copy_sampling`'s views of a copy of it); its other inputs are shared."""
    seeds, floats, top_k = section
    twins = {id(staged.seeds): seeds, id(staged.top_k): top_k}
    twins.update((id(a), b) for a, b in zip(staged.floats, floats, strict=True))
    changes = {}
    for f in dataclasses.fields(md):
        twin = twins.get(id(getattr(md, f.name)))
        if twin is not None:
            changes[f.name] = twin
    return dataclasses.replace(md, **changes)
