"""Persistent per-step input tensors and the device-resident block table.

Every step the model reads the same device tensors (token ids, positions, cache slots, sequence
lengths, block tables), refilled in place: fixed addresses are what lets a captured CUDA graph replay
with new inputs, and reusing buffers keeps allocation off the step's critical path.

Everything a step sends to the device travels in one asynchronous copy from one pinned host buffer
(`StepBuffers`): the step's fields, then the block-table entries that are new since the last step,
then (an eager step where not every sequence samples) the rows of the hidden states to compute logits
for, then (a step that samples beyond plain greedy) the sampling rows' settings and noise seeds
(`sampling_metadata.SamplingStager` fills them). Every torch call costs host time (10-20 us each on
the H200 machine), so a decode step replayed from a CUDA graph makes only that copy, the replay and
the argmax (or the sampler) with its copy back. No event is recorded when the step ends by waiting
for its sampled tokens anyway (see `StepBuffers.upload`).

The block table lives on the device for the whole life of a request, one row per running request
(`BlockTable`). An eager step scatters its new block ids into it with one kernel and gathers its
requests' rows with another; a graph step's graph does both (the runner stages a fixed number of
updates per bucket for it, padded with harmless writes into the all-zero pad row).
"""

from __future__ import annotations

import enum

import numpy as np
import torch

PAD_SLOT = -1  # slot_mapping value the kernels skip (padding tokens write no KV)
# Float32 settings staged per sampling row, in this order (`sampling_metadata.SamplingColumns`):
# temperature, top-p, min-p, presence, frequency and repetition penalty.
SAMPLING_FLOATS = 6
SAMPLING_ROW_BYTES = 8 + 4 * SAMPLING_FLOATS + 4  # seed, the floats, top-k


def _align8(nbytes: int) -> int:
    return -(-nbytes // 8) * 8


class StepLayout:
    """Where one step's fields lie in the staging buffer, and numpy views of them on the host.

    Byte layout, back to back: per token (int64) input ids, positions, cache slots; per sequence
    (int32) query start offsets (one more entry), sequence lengths, block-table rows; then (8-aligned)
    the flat block-table positions of the new block ids (int64), the logits rows (int64), and the new
    block ids (int32, the device table's type: no conversion kernel); then (8-aligned) per sampling
    row its noise seed (int64), its `SAMPLING_FLOATS` settings (float32, one column after the other)
    and its top-k (int32). The fields' offsets depend on the token and sequence counts only, never on
    what follows them, so a CUDA graph captured for one size finds its inputs at the same device
    addresses on every replay of that size; the sampling section's depend on every count before it.
    """

    __slots__ = (
        "num_tokens",
        "num_seqs",
        "num_block_updates",
        "num_logits",
        "num_sampling",
        "nbytes",
        "input_ids",
        "positions",
        "slots",
        "query_start_loc",
        "seq_lens",
        "table_rows",
        "block_index",
        "logits_indices",
        "block_ids",
        "seeds",
        "sampling_floats",
        "top_k",
        "extra_at",
        "ids_at",
        "sampling_at",
        "copy_views",
        "field_views",
        "update_views",
        "logits_view",
        "sampling_views",
    )

    def __init__(
        self,
        host: np.ndarray,
        num_tokens: int,
        num_seqs: int,
        num_block_updates: int,
        num_logits: int,
        num_sampling: int,
    ):
        t, s, c, n, m = num_tokens, num_seqs, num_block_updates, num_logits, num_sampling
        self.num_tokens, self.num_seqs, self.num_block_updates, self.num_logits = t, s, c, n
        self.num_sampling = m
        tok = host[: 24 * t].view(np.int64)
        self.input_ids, self.positions, self.slots = tok[:t], tok[t : 2 * t], tok[2 * t :]
        seq = host[24 * t : 24 * t + 4 * (3 * s + 1)].view(np.int32)
        self.query_start_loc, self.seq_lens, self.table_rows = (
            seq[: s + 1],
            seq[s + 1 : 2 * s + 1],
            seq[2 * s + 1 :],
        )
        self.extra_at = extra = _align8(24 * t + 4 * (3 * s + 1))
        self.block_index = host[extra : extra + 8 * c].view(np.int64)
        self.logits_indices = host[extra + 8 * c : extra + 8 * (c + n)].view(np.int64)
        self.ids_at = ids_at = extra + 8 * (c + n)
        self.block_ids = host[ids_at : ids_at + 4 * c].view(np.int32)
        self.sampling_at = at = _align8(ids_at + 4 * c)
        # Seeds are written as the uint64 they are (the device reads the same bits as int64).
        self.seeds = host[at : at + 8 * m].view(np.uint64)
        floats_at = at + 8 * m
        self.sampling_floats = host[floats_at : floats_at + 4 * SAMPLING_FLOATS * m].view(np.float32)
        self.sampling_floats = self.sampling_floats.reshape(SAMPLING_FLOATS, m)
        top_k_at = floats_at + 4 * SAMPLING_FLOATS * m
        self.top_k = host[top_k_at : top_k_at + 4 * m].view(np.int32)
        self.nbytes = top_k_at + 4 * m if m else ids_at + 4 * c
        # Torch views, each group made on first use (a torch view costs microseconds): the copy's
        # destination and source, the six fields on the device (an eager step's), the block updates
        # on the device, the logits rows on the device.
        self.copy_views: tuple[torch.Tensor, torch.Tensor] | None = None
        self.field_views: tuple[torch.Tensor, ...] | None = None
        self.update_views: tuple[torch.Tensor, torch.Tensor] | None = None
        self.logits_view: torch.Tensor | None = None
        self.sampling_views: tuple[torch.Tensor, tuple[torch.Tensor, ...], torch.Tensor] | None = None


class _Upload(enum.Enum):
    NONE = 0  # nothing in flight: the host buffer may be written
    FENCED = 1  # an event was recorded after the last copy
    HOST_WAITS = 2  # the caller promised to wait for the device and call `device_synced`


class StepBuffers:
    """One pinned host buffer and its device twin: each step's inputs, sent in one copy.

    On the CPU the two are one tensor and nothing is copied.
    """

    def __init__(self, max_tokens: int, max_seqs: int, max_block_updates: int, device: torch.device):
        self.device = device
        self.max_tokens, self.max_seqs, self.max_block_updates = max_tokens, max_seqs, max_block_updates
        nbytes = _align8(24 * max_tokens + 4 * (3 * max_seqs + 1)) + 12 * max_block_updates + 8 * max_seqs
        nbytes = _align8(nbytes) + SAMPLING_ROW_BYTES * max_seqs
        on_gpu = device.type != "cpu"
        self._host = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=on_gpu)
        self._host_np = self._host.numpy()
        self._dev = torch.zeros_like(self._host, device=device) if on_gpu else self._host
        self._on_gpu = on_gpu
        self._uploaded = torch.cuda.Event() if device.type == "cuda" else None
        self._in_flight = _Upload.NONE
        # A step's sampling section copied out of the device buffer (`copy_sampling`), and the views
        # of it per sampling-row count.
        self._sampling_copy = torch.zeros(SAMPLING_ROW_BYTES * max_seqs, dtype=torch.uint8, device=device)
        self._sampling_copy_views: dict[int, tuple[torch.Tensor, tuple[torch.Tensor, ...], torch.Tensor]] = {}
        # Layouts handed out so far: a caller that staged `num_staged == n` and sees `n + 1` at its next
        # stage of the same layout knows no other layout has written the host buffer in between.
        self.num_staged = 0
        self._layouts: dict[tuple[int, int, int, int, int], StepLayout] = {}
        self._field_views: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}

    def stage(
        self,
        num_tokens: int,
        num_seqs: int,
        num_block_updates: int = 0,
        num_logits: int = 0,
        num_sampling: int = 0,
    ) -> StepLayout:
        """The layout of a step of these sizes, its host views writable (the last copy has read them).

        `num_sampling`: rows whose sampling settings travel with the step (0: a plain greedy step)."""
        if (
            num_tokens > self.max_tokens
            or num_seqs > self.max_seqs
            or num_block_updates > self.max_block_updates
            or num_logits > self.max_seqs
            or num_sampling > self.max_seqs
        ):
            raise ValueError(
                f"a step of {num_tokens} tokens, {num_seqs} sequences, {num_block_updates} block-table "
                f"updates, {num_logits} logits rows and {num_sampling} sampling rows exceeds the staging "
                f"buffer's {self.max_tokens} / {self.max_seqs} / {self.max_block_updates} / "
                f"{self.max_seqs} / {self.max_seqs}"
            )
        if self._in_flight is not _Upload.NONE:
            self._wait_for_upload()
        key = (num_tokens, num_seqs, num_block_updates, num_logits, num_sampling)
        layout = self._layouts.get(key)
        if layout is None:
            if len(self._layouts) > 512:  # prefill sizes vary without end; decode sizes repeat
                self._layouts.clear()
            layout = self._layouts[key] = StepLayout(self._host_np, *key)
        self.num_staged += 1
        return layout

    def upload(self, layout: StepLayout, *, host_waits: bool) -> None:
        """Send what the host wrote into `layout`, asynchronously.

        `host_waits`: the caller will block until the device has run this step (it copies the sampled
        tokens back) and then call `device_synced()`: the copy is then known to be done without an
        event (one CUDA call fewer). Otherwise an event marks the copy's end for the next `stage`.
        """
        if not self._on_gpu:
            return
        if layout.copy_views is None:
            layout.copy_views = (self._dev[: layout.nbytes], self._host[: layout.nbytes])
        dst, src = layout.copy_views
        dst.copy_(src, non_blocking=True)
        if host_waits:
            self._in_flight = _Upload.HOST_WAITS
        else:
            self._uploaded.record()
            self._in_flight = _Upload.FENCED

    def device_synced(self) -> None:
        """The host has waited for everything enqueued so far (the last upload included)."""
        self._in_flight = _Upload.NONE

    def device_fields(self, layout: StepLayout) -> tuple[torch.Tensor, ...]:
        """Device views of input_ids, positions, slots, query_start_loc, seq_lens, table_rows.

        The positions tensor is a new object every call: the torch rotary path caches cos/sin per
        positions object, and the buffer behind it is refilled every step.
        """
        if layout.field_views is None:
            layout.field_views = self._fields_of_sizes(layout.num_tokens, layout.num_seqs)
        ids, positions, *rest = layout.field_views
        return (ids, positions.view(positions.shape), *rest)

    def _fields_of_sizes(self, t: int, s: int) -> tuple[torch.Tensor, ...]:
        # Shared by the layouts of one (tokens, sequences) size: the fields lie at the same place.
        views = self._field_views.get((t, s))
        if views is None:
            if len(self._field_views) > 512:
                self._field_views.clear()
            tok = self._dev[: 24 * t].view(torch.int64)
            seq = self._dev[24 * t : 24 * t + 4 * (3 * s + 1)].view(torch.int32)
            views = (
                tok[:t],
                tok[t : 2 * t],
                tok[2 * t :],
                seq[: s + 1],
                seq[s + 1 : 2 * s + 1],
                seq[2 * s + 1 :],
            )
            self._field_views[(t, s)] = views
        return views

    def device_block_updates(self, layout: StepLayout) -> tuple[torch.Tensor, torch.Tensor]:
        """Device views of the staged flat block-table positions (int64) and block ids (int32)."""
        if layout.update_views is None:
            extra, ids_at, c = layout.extra_at, layout.ids_at, layout.num_block_updates
            layout.update_views = (
                self._dev[extra : extra + 8 * c].view(torch.int64),
                self._dev[ids_at : ids_at + 4 * c].view(torch.int32),
            )
        return layout.update_views

    def device_logits_indices(self, layout: StepLayout) -> torch.Tensor:
        """Device view of the staged logits rows (int64)."""
        if layout.logits_view is None:
            start = layout.extra_at + 8 * layout.num_block_updates
            layout.logits_view = self._dev[start : layout.ids_at].view(torch.int64)
        return layout.logits_view

    def device_sampling(
        self, layout: StepLayout
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...], torch.Tensor]:
        """Device views of the staged sampling section: seeds `[m]` int64, the `SAMPLING_FLOATS`
        settings (one contiguous `[m]` float32 view each), top-k `[m]` int32. Made once per layout:
        a step's sampler inputs then cost no torch call."""
        if layout.sampling_views is None:
            layout.sampling_views = _sampling_views(self._dev, layout.sampling_at, layout.num_sampling)
        return layout.sampling_views

    def copy_sampling(
        self, layout: StepLayout
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...], torch.Tensor]:
        """`device_sampling`'s views of a copy of the uploaded sampling section, in a buffer of its own,
        queued on the current stream: the next step's upload rewrites the section, and an
        asynchronous constrained step's draw is queued (by the mask thread) after that upload. The
        copy itself is rewritten by the next call, which the runner makes only once the draw that
        reads this one is queued."""
        m, at = layout.num_sampling, layout.sampling_at
        nbytes = SAMPLING_ROW_BYTES * m
        self._sampling_copy[:nbytes].copy_(self._dev[at : at + nbytes], non_blocking=True)
        views = self._sampling_copy_views.get(m)
        if views is None:
            if len(self._sampling_copy_views) > 512:
                self._sampling_copy_views.clear()
            views = self._sampling_copy_views[m] = _sampling_views(self._sampling_copy, 0, m)
        return views

    def _wait_for_upload(self) -> None:
        if self._in_flight is _Upload.FENCED:
            self._uploaded.synchronize()
        else:
            # The caller said it would wait and did not (an exception cut its step short).
            torch.cuda.current_stream(self.device).synchronize()
        self._in_flight = _Upload.NONE


def _sampling_views(
    buffer: torch.Tensor, at: int, m: int
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...], torch.Tensor]:
    """Views of a sampling section of `m` rows starting at byte `at` of `buffer`: seeds `[m]` int64,
    the `SAMPLING_FLOATS` settings (`[m]` float32 each), top-k `[m]` int32."""
    floats_at = at + 8 * m
    top_k_at = floats_at + 4 * SAMPLING_FLOATS * m
    floats = buffer[floats_at:top_k_at].view(torch.float32).view(SAMPLING_FLOATS, m)
    return (
        buffer[at:floats_at].view(torch.int64),
        tuple(floats.unbind(0)),
        buffer[top_k_at : top_k_at + 4 * m].view(torch.int32),
    )


class BlockTable:
    """Block ids of every running request, one row each, on the host and (on a GPU) the device.

    The host copy serves the slot computation of the step's new tokens; the device copy serves the
    attention kernels. Row `pad_row` stays all zeros: padded batch entries of a CUDA graph point at it.
    New ids are queued as they arrive; a step writes them into the host table and its staging buffer
    (`write_pending`), and after the upload into the device table with one scatter (`scatter`, which
    a CUDA graph step runs inside the graph).
    """

    def __init__(self, num_rows: int, max_blocks_per_seq: int, device: torch.device) -> None:
        self.num_rows = num_rows
        self.max_blocks_per_seq = max_blocks_per_seq
        self.device = device
        self.host = np.zeros((num_rows + 1, max_blocks_per_seq), dtype=np.int32)
        host_tensor = torch.from_numpy(self.host)
        # On the CPU the device table is the host table; elsewhere `scatter` keeps a copy in step.
        self.has_device_copy = device.type != "cpu"
        self.on_device = torch.zeros_like(host_tensor, device=device) if self.has_device_copy else host_tensor
        # One position in the pad row per possible batch entry (repeating past its width): where a
        # graph step's unused block-table updates write their 0.
        self.pad_positions = num_rows * max_blocks_per_seq + np.arange(num_rows) % max_blocks_per_seq
        self._flat_host = self.host.reshape(-1)  # views: the same memory
        self._flat_device = self.on_device.view(-1)
        self._free_rows = list(range(num_rows - 1, -1, -1))
        self._pending_index: list[int] = []  # flat positions (row * max_blocks_per_seq + column)
        self._pending_ids: list[int] = []

    @property
    def pad_row(self) -> int:
        return self.num_rows

    @property
    def num_pending(self) -> int:
        """Block ids queued since the last write."""
        return len(self._pending_ids)

    def add_row(self, block_ids: list[int] | tuple[int, ...]) -> int:
        """Take a free row for a new request and fill it with its block ids."""
        if not self._free_rows:
            raise RuntimeError(f"more than {self.num_rows} running requests in the model runner")
        row = self._free_rows.pop()
        self.append(row, 0, block_ids)
        return row

    def append(self, row: int, first_column: int, block_ids: list[int] | tuple[int, ...]) -> None:
        """Queue `block_ids` for `row` from `first_column` on (written by the next step)."""
        end = first_column + len(block_ids)
        if end > self.max_blocks_per_seq:
            raise ValueError(f"a request needs {end} blocks; the table holds {self.max_blocks_per_seq}")
        start = row * self.max_blocks_per_seq
        self._pending_index.extend(range(start + first_column, start + end))
        self._pending_ids.extend(block_ids)

    def free_row(self, row: int) -> None:
        # Stale ids stay in the row: a request only reads the columns it has written itself.
        self._free_rows.append(row)

    def write_pending(self, index_out: np.ndarray, ids_out: np.ndarray) -> None:
        """Write the queued ids into the host table, and their flat positions and values into
        `index_out` / `ids_out` (staging views of exactly `num_pending` entries) for `scatter`."""
        index_out[:] = self._pending_index
        ids_out[:] = self._pending_ids
        self._pending_index.clear()
        self._pending_ids.clear()
        self._flat_host[index_out] = ids_out

    def scatter(self, index: torch.Tensor, ids: torch.Tensor) -> None:
        """Write uploaded (`write_pending`) entries into the device copy of the table: one kernel."""
        self._flat_device.index_copy_(0, index, ids)

    def flush_unstaged(self) -> None:
        """Write the queued ids into both tables on their own (for more than a staging buffer holds:
        a blocking copy, rare)."""
        index = np.array(self._pending_index, dtype=np.int64)
        ids = np.array(self._pending_ids, dtype=np.int32)
        self._pending_index.clear()
        self._pending_ids.clear()
        self._flat_host[index] = ids
        if self.has_device_copy:
            self._flat_device.index_copy_(
                0, torch.from_numpy(index).to(self.device), torch.from_numpy(ids).to(self.device)
            )
