"""The step staging buffer, the block table, and the runner's CUDA-graph path, on the CPU.

The graph path is run through `ReplayingGraphs`: "capture" keeps each bucket's input buffers and
metadata builder, and a replay runs the toy model on whatever those buffers hold at that moment, as a
CUDA graph replays its kernels on the addresses it was captured with. A field that moved, padding
left stale or a block id missing from the table changes the generated tokens. With
`separate_device_table` the block table's "device" copy is a tensor of its own, kept in step only by
the scatters a GPU would run (eagerly, or inside the graph), as on a GPU.
"""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest
import torch
from toy_model import VOCAB, ToyLoaded, ToyModel

from voltllm.config import CacheConfig, EngineConfig, SchedulerConfig
from voltllm.engine.core import EngineCore
from voltllm.engine.llm_engine import LLMEngine
from voltllm.protocol import EngineCoreRequest, EngineSamplingParams
from voltllm.worker import model_runner
from voltllm.worker.cuda_graphs import DecodeGraphs, graph_batch_sizes
from voltllm.worker.step_inputs import BlockTable, StepBuffers

CPU = torch.device("cpu")
MODEL = ToyModel()


def test_field_addresses_depend_only_on_the_step_sizes():
    buffers = StepBuffers(max_tokens=64, max_seqs=16, max_block_updates=32, device=CPU)
    plain = buffers.stage(16, 16)
    fields = buffers.device_fields(plain)
    for updates, logits in ((5, 0), (32, 0), (3, 7)):
        layout = buffers.stage(16, 16, updates, logits)
        assert [f.data_ptr() for f in buffers.device_fields(layout)] == [f.data_ptr() for f in fields]
        index, ids = buffers.device_block_updates(layout)
        assert index.dtype == torch.int64 and ids.dtype == torch.int32
        assert index.numel() == ids.numel() == updates
        assert buffers.device_logits_indices(layout).numel() == logits
        # The extra entries lie after the fields, never on them.
        fields_end = max(f.data_ptr() + f.numel() * f.element_size() for f in fields)
        extras = (index, ids, buffers.device_logits_indices(layout))
        assert all(e.data_ptr() >= fields_end for e in extras if e.numel())
    with pytest.raises(ValueError, match="exceeds"):
        buffers.stage(16, 16, 33)


def test_host_and_device_views_are_the_same_fields():
    buffers = StepBuffers(max_tokens=8, max_seqs=4, max_block_updates=4, device=CPU)
    layout = buffers.stage(6, 3, 2, 1)
    host = (layout.input_ids, layout.positions, layout.slots, layout.query_start_loc, layout.seq_lens)
    for i, array in enumerate((*host, layout.table_rows)):
        array[:] = np.arange(len(array)) + 10 * i
    layout.block_index[:] = [7, 8]
    layout.block_ids[:] = [70, 80]
    layout.logits_indices[:] = [5]
    dev = buffers.device_fields(layout)
    assert [t.tolist() for t in dev] == [a.tolist() for a in (*host, layout.table_rows)]
    assert [len(t) for t in dev] == [6, 6, 6, 4, 3, 3]
    assert [t.tolist() for t in buffers.device_block_updates(layout)] == [[7, 8], [70, 80]]
    assert buffers.device_logits_indices(layout).tolist() == [5]
    # A new positions object every call (the torch rotary path caches per object).
    assert buffers.device_fields(layout)[1] is not dev[1]


def test_block_table_writes_queued_ids_staged_or_unstaged():
    table = BlockTable(num_rows=3, max_blocks_per_seq=4, device=CPU)
    a = table.add_row([5, 6])
    b = table.add_row([9])
    table.append(a, 2, [7])
    assert table.num_pending == 4
    index, ids = np.zeros(4, dtype=np.int64), np.zeros(4, dtype=np.int32)
    table.write_pending(index, ids)
    assert table.num_pending == 0
    assert table.host[a].tolist() == [5, 6, 7, 0] and table.host[b].tolist() == [9, 0, 0, 0]
    assert ids.tolist() == [5, 6, 9, 7]
    table.append(b, 1, [1, 2, 3])
    table.flush_unstaged()
    assert table.host[b].tolist() == [9, 1, 2, 3]
    assert table.on_device[b].tolist() == [9, 1, 2, 3]
    assert not table.host[table.pad_row].any()
    with pytest.raises(ValueError, match="needs 5 blocks"):
        table.append(b, 4, [1])


class ReplayingGraphs(DecodeGraphs):
    """CUDA graphs emulated on the CPU: a replay runs the model on the captured buffers."""

    def capture(self, decode_inputs, kv_caches: list[torch.Tensor]) -> None:
        self.kv_caches = kv_caches
        self.replayed: list[int] = []
        for size in sorted(self.sizes, reverse=True):
            self._graphs[size] = decode_inputs(size)

    def replay(self, size: int) -> torch.Tensor:
        input_ids, positions, build_metadata = self._graphs[size]
        metadata = build_metadata()
        # The decode kernel reads each sequence's length from the device; the toy model from the host.
        metadata = dataclasses.replace(metadata, seq_lens_cpu=tuple(metadata.seq_lens.tolist()))
        hidden = self.model(input_ids, positions, metadata, self.kv_caches)
        self.logits[:size] = self.model.compute_logits(hidden)
        self.replayed.append(size)
        return self.logits[:size]


def separate_device_table(table: BlockTable) -> None:
    """Give a CPU block table a device copy of its own, written only by `scatter` / `flush_unstaged`."""
    table.on_device = table.on_device.clone()
    table._flat_device = table.on_device.view(-1)
    table.has_device_copy = True


def graph_engine(max_seqs: int, separate_table: bool = False, **cache) -> LLMEngine:
    config = EngineConfig(
        cache=CacheConfig(block_size=4, **cache),
        scheduler=SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=max_seqs),
        device="cpu",
    )
    core = EngineCore(config, ToyLoaded(MODEL, max_model_len=256), CPU)
    runner = core.runner
    if separate_table:
        separate_device_table(runner.block_table)
    sizes = graph_batch_sizes(max_seqs)
    runner.capture_cuda_graphs(ReplayingGraphs(runner.model, sizes, runner.vocab_size, CPU))
    return LLMEngine(config, core)


def requests(seed: int, count: int) -> tuple[list[list[int]], list[int]]:
    """Prompts (some sharing a prefix) and output lengths that differ, so decode batches shrink
    through several buckets, with padding."""
    rng = random.Random(seed)
    prefix = [rng.randrange(1, VOCAB) for _ in range(9)]
    prompts = [
        (prefix if i % 3 == 0 else []) + [rng.randrange(1, VOCAB) for _ in range(rng.randrange(1, 30))]
        for i in range(count)
    ]
    return prompts, [3 + 2 * i for i in range(count)]


def generate(eng: LLMEngine, prompts: list[list[int]], lengths: list[int]) -> list[list[int]]:
    reqs = [
        EngineCoreRequest(
            str(i), p, EngineSamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True), 0.0
        )
        for i, (p, n) in enumerate(zip(prompts, lengths, strict=True))
    ]
    out = eng.generate_token_ids(reqs)
    return [out[str(i)].new_token_ids for i in range(len(prompts))]


@pytest.mark.parametrize("separate_table", [False, True])
def test_graph_path_matches_dense_greedy(separate_table: bool):
    prompts, lengths = requests(0, 11)
    eng = graph_engine(max_seqs=12, separate_table=separate_table, num_kv_blocks=256)
    got = generate(eng, prompts, lengths)
    assert got == [MODEL.greedy(p, n) for p, n in zip(prompts, lengths, strict=True)]
    replayed = eng.core.runner.graphs.replayed
    assert len(set(replayed)) >= 4  # buckets 12, 8, 4, 2, 1 as requests finish
    assert eng.core.scheduler.kv.num_free_blocks == 256
    table = eng.core.runner.block_table
    assert torch.equal(table.on_device, torch.from_numpy(table.host))


@pytest.mark.parametrize("separate_table", [False, True])
def test_graph_path_with_preemption_and_unstaged_block_updates(monkeypatch, separate_table: bool):
    # A staging buffer too small for one request's table: big updates take the unstaged path.
    monkeypatch.setattr(model_runner, "MAX_STAGED_BLOCK_UPDATES", 3)
    prompts, lengths = requests(1, 8)
    eng = graph_engine(max_seqs=8, separate_table=separate_table, num_kv_blocks=24)
    got = generate(eng, prompts, lengths)
    assert got == [MODEL.greedy(p, n) for p, n in zip(prompts, lengths, strict=True)]
    assert eng.get_stats().num_preemptions > 0
    assert eng.core.runner.graphs.replayed
    table = eng.core.runner.block_table
    assert torch.equal(table.on_device, torch.from_numpy(table.host))


@pytest.mark.gpu
def test_cuda_upload_and_block_table_scatter():
    cuda = torch.device("cuda")
    buffers = StepBuffers(max_tokens=64, max_seqs=16, max_block_updates=8, device=cuda)
    table = BlockTable(num_rows=4, max_blocks_per_seq=6, device=cuda)
    graph_fields = buffers.device_fields(buffers.stage(8, 8))
    for step in range(6):
        row = table.add_row(list(range(10 * step, 10 * step + 3))) if step < 4 else step % 4
        if step >= 4:
            table.append(row, 3, [100 + step])
        layout = buffers.stage(8, 8, table.num_pending)
        table.write_pending(layout.block_index, layout.block_ids)
        fields = (layout.input_ids, layout.positions, layout.slots, layout.query_start_loc, layout.seq_lens)
        for i, array in enumerate((*fields, layout.table_rows)):
            array[:] = np.arange(len(array)) + 100 * i + step
        # Steps alternate: an event, the caller's wait, and a wait it never reports (the fallback).
        buffers.upload(layout, host_waits=step % 3 != 0)
        table.scatter(*buffers.device_block_updates(layout))
        dev = buffers.device_fields(layout)
        assert [d.data_ptr() for d in dev] == [d.data_ptr() for d in graph_fields]
        assert [d.tolist() for d in dev] == [a.tolist() for a in (*fields, layout.table_rows)]
        if step % 3 == 1:
            buffers.device_synced()
        assert torch.equal(table.on_device.cpu(), torch.from_numpy(table.host))
    table.append(0, 4, [7, 8])
    table.flush_unstaged()
    assert torch.equal(table.on_device.cpu(), torch.from_numpy(table.host))
    assert table.host[0, 3:5].tolist() == [104, 7] and table.host[0, 5] == 8
