"""Persistent per-step input tensors and the device-resident block table.

Every step the model reads the same device tensors (token ids, positions, cache slots, sequence
lengths, block tables), refilled in place: fixed addresses are what lets a captured CUDA graph replay
with new inputs, and reusing buffers keeps allocation off the step's critical path. The host side
writes numpy views of pinned staging buffers and each group goes to the device in one asynchronous copy.

The block table lives on the device for the whole life of a request, one row per running request
(`BlockTable`): a step uploads only the block ids that are new since the last step, and gathers the
rows of the requests it runs into the step's `block_tables` buffer with one device-side index.
"""

from __future__ import annotations

import numpy as np
import torch

PAD_SLOT = -1  # slot_mapping value the kernels skip (padding tokens write no KV)


class _Staged:
    """A flat pinned host buffer and its device twin; a step packs its fields back to back at the start
    of the host buffer and uploads them with one contiguous asynchronous copy.

    The layout depends only on the packed sizes, so a CUDA graph captured for one size finds its
    inputs at the same device addresses on every replay of that size. Slices are cached per size:
    creating tensor views costs microseconds, and a decode step's host budget is tens of them.
    """

    def __init__(self, capacity: int, dtype: torch.dtype, device: torch.device) -> None:
        self.device = device
        self.dtype = dtype
        self._uploaded = torch.cuda.Event() if device.type == "cuda" else None
        self._upload_in_flight = False
        self._resize(capacity)

    def _resize(self, capacity: int) -> None:
        self.capacity = capacity
        self._host = torch.zeros(capacity, dtype=self.dtype, pin_memory=self.device.type == "cuda")
        self.host = self._host.numpy()
        self.dev = (
            self._host if self.device.type == "cpu" else torch.zeros_like(self._host, device=self.device)
        )
        self._slices: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def writable(self, size: int) -> np.ndarray:
        """The host buffer, once the previous upload has read it (usually long done), grown to `size`."""
        if self._upload_in_flight:
            self._uploaded.synchronize()
            self._upload_in_flight = False
        if size > self.capacity:
            self._resize(max(size, 2 * self.capacity))
        return self.host

    def upload(self, size: int) -> torch.Tensor:
        """Send the first `size` elements to the device; returns their device view."""
        slices = self._slices.get(size)
        if slices is None:
            if len(self._slices) > 256:
                self._slices.clear()
            slices = self._slices[size] = (self.dev[:size], self._host[:size])
        dev, host = slices
        if self.device.type != "cpu":
            dev.copy_(host, non_blocking=True)
            self._uploaded.record()
            self._upload_in_flight = True
        return dev


class BlockTable:
    """Block ids of every running request, one row each, on the host and (on a GPU) the device.

    The host copy serves the slot computation of the step's new tokens; the device copy serves the
    attention kernels. Row `pad_row` stays all zeros: padded batch entries of a CUDA graph point at it.
    New ids are collected as they arrive and written by `flush` in one scatter on each side, however
    many requests got blocks in the step.
    """

    def __init__(self, num_rows: int, max_blocks_per_seq: int, device: torch.device) -> None:
        self.num_rows = num_rows
        self.max_blocks_per_seq = max_blocks_per_seq
        self.device = device
        self.host = np.zeros((num_rows + 1, max_blocks_per_seq), dtype=np.int32)
        host_tensor = torch.from_numpy(self.host)
        self.on_device = host_tensor if device.type == "cpu" else torch.zeros_like(host_tensor, device=device)
        self._free_rows = list(range(num_rows - 1, -1, -1))
        self._pending_index: list[int] = []  # flat positions (row * max_blocks_per_seq + column)
        self._pending_ids: list[int] = []
        self._upload = _Staged(2048, torch.int64, device)

    @property
    def pad_row(self) -> int:
        return self.num_rows

    def add_row(self, block_ids: list[int] | tuple[int, ...]) -> int:
        """Take a free row for a new request and fill it with its block ids."""
        if not self._free_rows:
            raise RuntimeError(f"more than {self.num_rows} running requests in the model runner")
        row = self._free_rows.pop()
        self.append(row, 0, block_ids)
        return row

    def append(self, row: int, first_column: int, block_ids: list[int] | tuple[int, ...]) -> None:
        """Queue `block_ids` for `row` from `first_column` on (written by the next `flush`)."""
        end = first_column + len(block_ids)
        if end > self.max_blocks_per_seq:
            raise ValueError(f"a request needs {end} blocks; the table holds {self.max_blocks_per_seq}")
        start = row * self.max_blocks_per_seq
        self._pending_index.extend(range(start + first_column, start + end))
        self._pending_ids.extend(block_ids)

    def free_row(self, row: int) -> None:
        # Stale ids stay in the row: a request only reads the columns it has written itself.
        self._free_rows.append(row)

    def flush(self) -> None:
        """Write the queued ids into the host table and (one copy, one scatter) the device table."""
        count = len(self._pending_ids)
        if not count:
            return
        staged = self._upload.writable(2 * count)
        staged[:count] = self._pending_index
        staged[count : 2 * count] = self._pending_ids
        self._pending_index.clear()
        self._pending_ids.clear()
        self.host.ravel()[staged[:count]] = staged[count : 2 * count]
        if self.device.type == "cpu":
            return
        upload = self._upload.upload(2 * count)
        self.on_device.view(-1).index_copy_(0, upload[:count], upload[count:].to(torch.int32))


class StepBuffers:
    """The device tensors the model reads every step, packed per step size.

    Per token (int64): input ids, positions, cache slots. Per sequence (int32): query start offsets
    (one more entry), sequence lengths, block-table rows.
    """

    def __init__(self, max_tokens: int, max_seqs: int, device: torch.device) -> None:
        self.tokens = _Staged(3 * max_tokens, torch.int64, device)
        self.seqs = _Staged(3 * max_seqs + 1, torch.int32, device)
        self._views: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}

    def host_views(self, num_tokens: int, num_seqs: int) -> tuple[np.ndarray, ...]:
        """Writable host arrays: input_ids, positions, slots, query_start_loc, seq_lens, table_rows."""
        t, s = num_tokens, num_seqs
        return _fields(self.tokens.writable(3 * t), self.seqs.writable(3 * s + 1), t, s)

    def upload(self, num_tokens: int, num_seqs: int) -> tuple[torch.Tensor, ...]:
        """Device views, in `host_views` order, after sending what the host wrote."""
        t, s = num_tokens, num_seqs
        tok = self.tokens.upload(3 * t)
        seq = self.seqs.upload(3 * s + 1)
        if tok.device.type == "cpu":
            # Fresh view objects each step: the torch rotary path caches cos/sin per positions object.
            return _fields(tok, seq, t, s)
        views = self._views.get((t, s))
        if views is None:
            if len(self._views) > 256:
                self._views.clear()
            views = self._views[(t, s)] = _fields(tok, seq, t, s)
        return views


def _fields(tok, seq, t: int, s: int) -> tuple:
    """Split the packed token (3 x t) and sequence (3 x s + 1) buffers into their six fields."""
    return (
        tok[:t],
        tok[t : 2 * t],
        tok[2 * t : 3 * t],
        seq[: s + 1],
        seq[s + 1 : 2 * s + 1],
        seq[2 * s + 1 : 3 * s + 1],
    )
