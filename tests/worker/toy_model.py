"""A tiny decoder with its own paged attention, and a dense (cache-free) twin used as the oracle.

It implements the model interface the runner needs (`__call__`, `compute_logits`,
`kv_cache_shape_per_layer`, `num_layers`) without depending on `voltllm.models`, so the runner,
scheduler and KV cache are tested on their own. It runs in float64 so that the paged and the dense
computation agree to ~1e-12 and greedy comparisons cannot flip on rounding.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from voltllm.layers.attention.backend import AttentionMetadata
from voltllm.worker.cuda_graphs import DecodeGraphs

VOCAB = 97


class ToyModel(nn.Module):
    def __init__(self, vocab: int = VOCAB, hidden: int = 32, num_layers: int = 2, seed: int = 0):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.num_layers = num_layers
        self.num_heads, self.num_kv_heads, self.head_size = 4, 2, 8
        self.embed = nn.Parameter(torch.randn(vocab, hidden, generator=gen, dtype=torch.float64))
        self.pos = nn.Parameter(torch.randn(2048, hidden, generator=gen, dtype=torch.float64) * 0.5)
        qkv_out = (self.num_heads + 2 * self.num_kv_heads) * self.head_size
        self.qkv = [
            torch.randn(hidden, qkv_out, generator=gen, dtype=torch.float64) / hidden**0.5
            for _ in range(num_layers)
        ]
        self.wo = [
            torch.randn(self.num_heads * self.head_size, hidden, generator=gen, dtype=torch.float64)
            / hidden**0.5
            for _ in range(num_layers)
        ]
        self.lm_head = torch.randn(hidden, vocab, generator=gen, dtype=torch.float64) * 2 / hidden**0.5
        self.block_size_seen: set[int] = set()

    def kv_cache_shape_per_layer(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return (2, num_blocks, block_size, self.num_kv_heads, self.head_size)

    def _split(self, h: torch.Tensor, layer: int):
        q, k, v = (h @ self.qkv[layer]).split(
            [
                self.num_heads * self.head_size,
                self.num_kv_heads * self.head_size,
                self.num_kv_heads * self.head_size,
            ],
            dim=-1,
        )
        return (
            q.view(-1, self.num_heads, self.head_size),
            k.view(-1, self.num_kv_heads, self.head_size),
            v.view(-1, self.num_kv_heads, self.head_size),
        )

    @staticmethod
    def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [Lq, H, D] are the last Lq positions of a context k/v [L, Hkv, D]; causal."""
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / q.shape[-1] ** 0.5
        lq, lk = q.shape[0], k.shape[0]
        mask = torch.arange(lk)[None, :] > (torch.arange(lq)[:, None] + lk - lq)
        scores = scores.masked_fill(mask, float("-inf"))
        return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)

    def forward(self, input_ids, positions, md: AttentionMetadata, kv_caches: list[torch.Tensor]):
        h = self.embed[input_ids] + self.pos[positions]
        for layer in range(self.num_layers):
            q, k, v = self._split(h, layer)
            cache = kv_caches[layer]
            block_size = cache.shape[2]
            flat = cache.view(2, -1, self.num_kv_heads, self.head_size)
            write = md.slot_mapping >= 0
            flat[0, md.slot_mapping[write]] = k[write]
            flat[1, md.slot_mapping[write]] = v[write]
            out = torch.empty_like(q)
            for i in range(md.num_seqs):
                qs, qe = int(md.query_start_loc[i]), int(md.query_start_loc[i + 1])
                seq_len = md.seq_lens_cpu[i]
                blocks = md.block_tables[i, : -(-seq_len // block_size)].long()
                ck = cache[0, blocks].reshape(-1, self.num_kv_heads, self.head_size)[:seq_len]
                cv = cache[1, blocks].reshape(-1, self.num_kv_heads, self.head_size)[:seq_len]
                out[qs:qe] = self._attend(q[qs:qe], ck, cv)
            h = h + out.flatten(1) @ self.wo[layer]
        return h

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return (hidden @ self.lm_head).float()

    def dense_logits(self, token_ids: list[int]) -> torch.Tensor:
        """Logits at every position of `token_ids`, without any cache (the oracle)."""
        ids = torch.tensor(token_ids)
        h = self.embed[ids] + self.pos[torch.arange(len(token_ids))]
        for layer in range(self.num_layers):
            q, k, v = self._split(h, layer)
            h = h + self._attend(q, k, v).flatten(1) @ self.wo[layer]
        return (h @ self.lm_head).float()

    def greedy(self, prompt: list[int], num_new: int) -> list[int]:
        tokens = list(prompt)
        for _ in range(num_new):
            tokens.append(int(self.dense_logits(tokens)[-1].argmax()))
        return tokens[len(prompt) :]


@dataclass
class ToyLoaded:
    """Stands in for `voltllm.loader.LoadedModel`."""

    model: ToyModel
    model_dir: Path = Path("/nonexistent/toy")
    max_model_len: int = 512
    vocab_size: int = VOCAB
    eos_token_ids: tuple[int, ...] = (0,)
    dtype: torch.dtype = torch.float64


class EagerReplayGraphs(DecodeGraphs):
    """CUDA graphs' contract on the CPU: "capture" keeps each bucket's persistent input buffers, and a
    replay runs the toy model on whatever they hold then, as a real graph reads its captured
    addresses. A step whose ids were written on the device after the upload replays right only if
    they landed in those buffers."""

    def capture(self, decode_inputs, kv_caches: list[torch.Tensor]) -> None:
        self._kv_caches = kv_caches
        for size in sorted(self.sizes, reverse=True):
            self._graphs[size] = decode_inputs(size)

    def replay(self, size: int) -> torch.Tensor:
        input_ids, positions, build_metadata = self._graphs[size]
        md = build_metadata()
        md = dataclasses.replace(md, seq_lens_cpu=tuple(md.seq_lens.tolist()))  # the toy reads host lengths
        hidden = self.model(input_ids, positions, md, self._kv_caches)
        self.logits[:size] = self.model.compute_logits(hidden)
        return self.logits[:size]
