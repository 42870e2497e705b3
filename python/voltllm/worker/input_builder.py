"""A plan's flat model inputs, staged in the persistent step buffers (`step_inputs.StepBuffers`).

The batch is the plan's requests in the order of `num_scheduled_tokens`, each contributing its next
`num_scheduled_tokens[id]` tokens back to back. Two kinds of step, staged apart:

- **decode** (one token per sequence): when every sequence samples and a captured CUDA graph bucket
  holds them, the step is staged for the graph (`_stage_graph`: padded to the bucket, with exactly one
  block-table update per entry, which the graph scatters itself) and its inputs are the buffers the
  graph was captured on; otherwise it runs eagerly.
- **mixed** (prefill chunks, possibly beside decodes): always eager, with query offsets, per-token
  positions, and the rows of the hidden states to compute logits for.

An eager step's inputs are views of the uploaded buffers plus an `AttentionMetadata` built here; the
block-table ids queued since the last step travel in the same upload (`_stage_eager`). Either way a
sequence samples only when its scheduled tokens reach its last known token, and a step whose sampling
rows are not all plain greedy carries their settings and noise seeds in the same upload too
(`sampling_metadata.SamplingStager`; `StepInputs.sampling`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from voltllm.core.sched_output import SchedulerOutput
from voltllm.layers.attention.backend import AttentionMetadata
from voltllm.worker.cuda_graphs import DecodeGraphs
from voltllm.worker.request_state import RequestArrays
from voltllm.worker.sampling_metadata import SamplingStager, StagedSampling
from voltllm.worker.step_inputs import PAD_SLOT, BlockTable, StepBuffers, StepLayout


@dataclass(slots=True)
class StepInputs:
    """One step's batch as the runner executes it."""

    sampling_req_ids: list[str]
    sampling_index: list[int] | None  # batch positions of the sequences that sample; None: all do
    rows: np.ndarray  # request-array row of each sequence, in batch order
    ends: np.ndarray  # each sequence's computed tokens after this step
    sampling_rows: np.ndarray  # rows of the sequences that sample, in sampling order
    sampling_ends: np.ndarray  # their token counts (the column their sampled token goes to)
    plain_greedy: bool  # every sampling sequence is plain greedy (`is_plain_greedy`)
    graph_size: int | None = None  # a CUDA graph of this bucket runs the step (then only input_ids is set)
    input_ids: torch.Tensor | None = None  # (a graph step: the bucket's buffer the graph reads)
    positions: torch.Tensor | None = None
    metadata: AttentionMetadata | None = None
    logits_indices: torch.Tensor | None = None  # None: every row samples
    sampling: StagedSampling | None = None  # the sampling rows' staged settings; None: plain greedy
    layout: StepLayout | None = None  # where the step lies in the staging buffers


class InputBuilder:
    """Stages each step's inputs into `buffers` and uploads them; owns no request state."""

    def __init__(
        self,
        arrays: RequestArrays,
        block_table: BlockTable,
        buffers: StepBuffers,
        *,
        block_size: int,
        max_model_len: int,
        sampling: SamplingStager | None = None,
    ) -> None:
        """`sampling`: stages the sampling rows' settings (None: a runner that samples nothing)."""
        self.arrays = arrays
        self.block_table = block_table
        self.buffers = buffers
        self.sampling = sampling
        self.block_size = block_size
        self.max_model_len = max_model_len
        self._arange = np.arange(buffers.max_tokens + 1, dtype=np.int64)  # query offsets, positions
        # A step that samples ends with the host waiting for its tokens, so its upload needs no event
        # (`StepBuffers.upload`); asynchronous scheduling stages the next step before that wait and
        # turns this off.
        self.host_waits_for_samples = True
        # (graph bucket, sequences) of the last staged step if it was a graph step: its padding.
        self._padding: tuple[int, int] | None = None

    def prepare(
        self,
        plan: SchedulerOutput,
        req_ids: list[str],
        rows: np.ndarray,
        plain_greedy: bool,
        graphs: DecodeGraphs | None,
    ) -> StepInputs:
        """Stage and upload the step of `plan`, whose sequences `req_ids` (its batch order) are
        request-array `rows` (`plain_greedy`: all of them are)."""
        if plan.total_num_scheduled_tokens == len(req_ids):  # each sequence has a token: exactly one
            return self._prepare_decode(req_ids, rows, plain_greedy, graphs)
        return self._prepare_mixed(plan, req_ids, rows, plain_greedy)

    def _prepare_decode(
        self, req_ids: list[str], rows: np.ndarray, plain_greedy: bool, graphs: DecodeGraphs | None
    ) -> StepInputs:
        arrays = self.arrays
        num_seqs = len(req_ids)
        starts = arrays.num_computed[rows]
        step, samples = self._sampling(req_ids, rows, starts + 1, plain_greedy)
        num_sampling = len(step.sampling_req_ids)
        if graphs is not None and num_sampling == num_seqs:
            step.graph_size = graphs.bucket_for(num_seqs)
        num_logits = 0
        staged_rows = self._num_staged_sampling(step)
        if step.graph_size is not None:
            layout = self._stage_graph(step.graph_size, num_seqs, staged_rows)
        else:
            num_logits = num_sampling if num_sampling != num_seqs else 0
            layout = self._stage_eager(num_seqs, num_seqs, num_logits, staged_rows)
            layout.query_start_loc[:] = self._arange[: num_seqs + 1]
        layout.input_ids[:num_seqs] = arrays.token_ids[rows, starts]
        layout.positions[:num_seqs] = starts
        self._stage_common(layout, step, rows, samples, num_logits)
        if step.graph_size is not None:
            # The graph scatters the block-table updates itself; the ids buffer is where an
            # asynchronous step writes the ids still on the device.
            step.input_ids = (layout.field_views or self.buffers.device_fields(layout))[0]
            return step
        return self._eager_inputs(step, layout, 1, (1,) * num_seqs, num_logits)

    def _prepare_mixed(
        self, plan: SchedulerOutput, req_ids: list[str], rows: np.ndarray, plain_greedy: bool
    ) -> StepInputs:
        arrays = self.arrays
        num_seqs, num_tokens = len(req_ids), plan.total_num_scheduled_tokens
        starts = arrays.num_computed[rows]
        lens = np.fromiter(plan.num_scheduled_tokens.values(), dtype=np.int64, count=num_seqs)
        step, samples = self._sampling(req_ids, rows, starts + lens, plain_greedy)
        # More tokens than sequences: the rows that sample are always picked out for the logits.
        num_logits = len(step.sampling_req_ids)
        layout = self._stage_eager(num_tokens, num_seqs, num_logits, self._num_staged_sampling(step))
        query_start_loc, positions = layout.query_start_loc, layout.positions
        query_start_loc[0] = 0
        np.cumsum(lens, out=query_start_loc[1:])
        offsets = np.repeat(query_start_loc[:num_seqs] - starts, lens)
        positions[:] = self._arange[:num_tokens] - offsets
        token_rows = np.repeat(rows, lens)
        layout.input_ids[:] = arrays.token_ids[token_rows, positions]
        self._stage_common(layout, step, token_rows, samples, num_logits)
        return self._eager_inputs(step, layout, int(lens.max()), tuple(lens.tolist()), num_logits)

    def _sampling(
        self, req_ids: list[str], rows: np.ndarray, ends: np.ndarray, plain_greedy: bool
    ) -> tuple[StepInputs, np.ndarray]:
        """The step with its sampling sequences picked (those whose tokens reach their end), and the
        mask of them in batch order."""
        samples = ends == self.arrays.num_tokens[rows]
        if np.count_nonzero(samples) == len(req_ids):  # (several times cheaper than samples.all())
            return StepInputs(req_ids, None, rows, ends, rows, ends, plain_greedy), samples
        chosen = np.flatnonzero(samples)
        sampling_rows = rows[chosen]
        greedy = plain_greedy or np.count_nonzero(self.arrays.plain_greedy[sampling_rows]) == len(chosen)
        index = chosen.tolist()
        sampling_req_ids = [req_ids[i] for i in index]
        return StepInputs(sampling_req_ids, index, rows, ends, sampling_rows, ends[chosen], greedy), samples

    def _num_staged_sampling(self, step: StepInputs) -> int:
        """Rows whose sampling settings the step stages: its sampling rows unless they are all plain
        greedy (or this runner samples nothing)."""
        if self.sampling is None or step.plain_greedy:
            return 0
        return len(step.sampling_req_ids)

    def _stage_common(
        self,
        layout: StepLayout,
        step: StepInputs,
        token_rows: np.ndarray,
        samples: np.ndarray,
        num_logits: int,
    ) -> None:
        """The fields both kinds fill the same way once ids and positions are staged, then the upload."""
        num_seqs, num_tokens = len(step.rows), len(token_rows)
        step.layout = layout
        layout.table_rows[:num_seqs] = step.rows
        pos = layout.positions[:num_tokens]
        blocks = self.block_table.host[token_rows, pos // self.block_size]
        layout.slots[:num_tokens] = blocks * self.block_size + pos % self.block_size
        layout.seq_lens[:num_seqs] = step.ends
        if num_logits:
            layout.logits_indices[:] = layout.query_start_loc[1:][samples] - 1
        if layout.num_sampling:
            step.sampling = self.sampling.stage(layout, step.sampling_rows, step.sampling_ends)
        # A step that samples waits for its tokens, so the next step needs no event to reuse the buffer.
        self.buffers.upload(layout, host_waits=self.host_waits_for_samples and bool(step.sampling_req_ids))

    def _eager_inputs(
        self,
        step: StepInputs,
        layout: StepLayout,
        max_query_len: int,
        query_lens_cpu: tuple[int, ...],
        num_logits: int,
    ) -> StepInputs:
        """An eager step's device inputs: the uploaded fields, its block-table rows, its metadata."""
        table = self.block_table
        if layout.num_block_updates and table.has_device_copy:
            table.scatter(*self.buffers.device_block_updates(layout))
        max_seq_len = int(step.ends.max())
        ids, positions, slots, query_start_loc, seq_lens, rows = self.buffers.device_fields(layout)
        width = -(-max_seq_len // self.block_size)
        step.input_ids, step.positions = ids, positions
        step.metadata = AttentionMetadata(
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            block_tables=table.on_device[:, :width].index_select(0, rows),
            slot_mapping=slots,
            max_query_len=max_query_len,
            max_seq_len=max_seq_len,
            query_lens_cpu=query_lens_cpu,
            seq_lens_cpu=tuple(step.ends.tolist()),
        )
        if num_logits:
            step.logits_indices = self.buffers.device_logits_indices(layout)
        return step

    # ----- staging -------------------------------------------------------------------------------

    def _stage_eager(self, num_tokens: int, num_seqs: int, num_logits: int, num_sampling: int) -> StepLayout:
        """The staging layout of an eager step, holding the block table's queued ids (written to the
        host table too: the step's slots need them; beyond the layout's room they go on their own)."""
        self._padding = None  # the step's fields may lie where a graph bucket's padding was
        table = self.block_table
        num_updates = table.num_pending
        if num_updates > self.buffers.max_block_updates:
            table.flush_unstaged()
            num_updates = 0
        layout = self.buffers.stage(num_tokens, num_seqs, num_updates, num_logits, num_sampling)
        if num_updates:
            table.write_pending(layout.block_index, layout.block_ids)
        return layout

    def _stage_graph(self, size: int, num_seqs: int, num_sampling: int = 0) -> StepLayout:
        """The staging layout of `num_seqs` decodes replayed by the graph of bucket `size`: padding
        from entry `num_seqs` on, and exactly `size` block-table updates, which the graph scatters
        itself: the block table's queued ids, then writes of 0 into the all-zero pad row (the
        `num_sampling` rows' settings lie after all of these: the graph's inputs stay in place)."""
        table = self.block_table
        num_updates = table.num_pending
        if num_updates > size:  # (a decode step gives each request at most one block)
            table.flush_unstaged()
            num_updates = 0
        layout = self.buffers.stage(size, size, size, 0, num_sampling)
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

    def _stage_padding(self, layout: StepLayout, first: int) -> None:
        """Fill staged decode entries from `first` on with padding (and every query offset)."""
        layout.input_ids[first:] = 0
        layout.positions[first:] = 0
        layout.slots[first:] = PAD_SLOT
        layout.query_start_loc[:] = self._arange[: layout.num_seqs + 1]
        layout.seq_lens[first:] = 1
        layout.table_rows[first:] = self.block_table.pad_row

    def padding_decode_inputs(
        self, size: int
    ) -> tuple[torch.Tensor, torch.Tensor, Callable[[], AttentionMetadata]]:
        """Buffers holding `size` padding decodes, and the metadata builder a graph of that size
        captures (`cuda_graphs.DecodeInputs`): its device work (the step's block-table updates, the
        gather of the batch's rows) replays with the graph, so a graph step launches nothing but the
        graph."""
        layout = self._stage_graph(size, 0)
        self.buffers.upload(layout, host_waits=False)
        ids, positions, slots, query_start_loc, seq_lens, rows = self.buffers.device_fields(layout)
        block_updates = self.buffers.device_block_updates(layout)
        table, max_model_len = self.block_table, self.max_model_len

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
                max_seq_len=max_model_len,
                query_lens_cpu=(1,) * size,
                seq_lens_cpu=(max_model_len,) * size,
            )

        return ids, positions, build_metadata
