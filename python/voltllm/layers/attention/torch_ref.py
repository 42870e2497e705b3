"""The reference attention backend: plain torch, fp32 softmax, any device and dtype.

It is the oracle the CUDA kernels are tested against and the backend used on the CPU, so it stays
plainly correct, but it must not be slow: the CPU path serves real requests.

- `voltllm.ops.attention.attend` / `gather_context` are the one-sequence definition of paged causal
  attention (the kernels' oracle too).
- `TorchAttentionBackend` computes the same thing batched. Sequences with one query token (decodes, and
  one-token chunks) are handled together: every context is gathered through the block tables at once
  into a padded `[seqs, max_ctx, kv_heads, head]` view and attended with one masked
  `scaled_dot_product_attention` call (GQA through `enable_gqa`). Longer chunks (prefills) go through
  SDPA one sequence at a time, with an explicit mask when the chunk follows a cached prefix or a
  sliding window applies.
- Everything that is the same for every layer of a step (which rows decode, gather indices, masks,
  write slots) is computed once per step and reused by the following layers (`_StepPlan`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from voltllm.layers.attention.backend import AttentionBackend, AttentionMetadata, AttentionSpec


def _check_metadata(metadata: AttentionMetadata, num_tokens: int) -> None:
    if sum(metadata.query_lens_cpu) != num_tokens:
        raise ValueError(
            f"metadata covers {sum(metadata.query_lens_cpu)} query tokens but the batch has {num_tokens}"
        )
    for query_len, seq_len in zip(metadata.query_lens_cpu, metadata.seq_lens_cpu, strict=True):
        if not 0 <= query_len <= seq_len:
            raise ValueError(f"query_len {query_len} must be in [0, seq_len={seq_len}]")


def _allowed(q_pos: torch.Tensor, k_pos: torch.Tensor, sliding_window: int | None) -> torch.Tensor:
    """Causal (and sliding-window) mask: may the query at `q_pos` see the key at `k_pos`?"""
    allowed = k_pos <= q_pos
    if sliding_window is not None:
        allowed &= k_pos > q_pos - sliding_window
    return allowed


@dataclass
class _Prefill:
    """One sequence with more than one query token."""

    rows: slice  # its query rows in the flat batch
    seq_len: int
    blocks: torch.Tensor  # [num_blocks] int64, the blocks holding its context
    # sliding window -> [query_len, seq_len] bool mask, or None where SDPA's causal flag is exact
    masks: dict[int | None, torch.Tensor | None]


class _StepPlan:
    """Index tensors and masks shared by every layer of one step (built on the first layer)."""

    def __init__(self, metadata: AttentionMetadata, block_size: int, device: torch.device) -> None:
        self.num_tokens = sum(metadata.query_lens_cpu)
        slot_mapping = metadata.slot_mapping
        # Rows to store (slot -1 = skip). Decided on the host once, not with a boolean index per layer.
        valid = (slot_mapping >= 0).cpu()
        if bool(valid.all()):
            self.write_rows, self.write_slots = None, slot_mapping
        else:
            rows = valid.nonzero().squeeze(1).to(device)
            self.write_rows, self.write_slots = rows, slot_mapping[rows]

        starts = [0]
        for query_len in metadata.query_lens_cpu:
            starts.append(starts[-1] + query_len)
        decode = [i for i, q in enumerate(metadata.query_lens_cpu) if q == 1]
        self.prefills = [
            _Prefill(
                rows=slice(starts[i], starts[i + 1]),
                seq_len=seq_len,
                blocks=metadata.block_tables[i, : -(-seq_len // block_size)].long(),
                masks={},
            )
            for i, (q, seq_len) in enumerate(zip(metadata.query_lens_cpu, metadata.seq_lens_cpu, strict=True))
            if q > 1
        ]
        self.decode_rows: torch.Tensor | None = None
        if decode:
            lens = [metadata.seq_lens_cpu[i] for i in decode]
            self.decode_max_len = max(lens)
            num_blocks = -(-self.decode_max_len // block_size)
            index = torch.tensor(decode, dtype=torch.int64, device=device)
            self.decode_rows = torch.tensor([starts[i] for i in decode], dtype=torch.int64, device=device)
            self.decode_all_rows = len(decode) == self.num_tokens  # the batch is nothing but decodes
            # [num_decode * num_blocks]: the blocks of every context, padded with block 0 (masked below).
            self.decode_blocks = metadata.block_tables.index_select(0, index)[:, :num_blocks].long().flatten()
            self.decode_seq_lens = torch.tensor(lens, dtype=torch.int64, device=device)
            self.decode_masks: dict[int | None, torch.Tensor] = {}

    def decode_mask(self, sliding_window: int | None) -> torch.Tensor:
        """[num_decode, 1, 1, max_len] bool: the positions each decode query may attend to."""
        mask = self.decode_masks.get(sliding_window)
        if mask is None:
            k_pos = torch.arange(self.decode_max_len, device=self.decode_seq_lens.device)[None, :]
            q_pos = (self.decode_seq_lens - 1)[:, None]
            mask = _allowed(q_pos, k_pos, sliding_window)[:, None, None, :]
            self.decode_masks[sliding_window] = mask
        return mask

    @staticmethod
    def prefill_mask(
        prefill: _Prefill, sliding_window: int | None, device: torch.device
    ) -> torch.Tensor | None:
        """[query_len, seq_len] bool, or None when SDPA's own causal mask is exact (no cached prefix and
        no window: its top-left-aligned causal mask then coincides with ours)."""
        if sliding_window not in prefill.masks:
            query_len = prefill.rows.stop - prefill.rows.start
            if query_len == prefill.seq_len and sliding_window is None:
                prefill.masks[sliding_window] = None
            else:
                q_pos = torch.arange(prefill.seq_len - query_len, prefill.seq_len, device=device)[:, None]
                k_pos = torch.arange(prefill.seq_len, device=device)[None, :]
                prefill.masks[sliding_window] = _allowed(q_pos, k_pos, sliding_window)
        return prefill.masks[sliding_window]


class TorchAttentionBackend(AttentionBackend):
    """Reference implementation of `AttentionBackend` in plain torch, batched over sequences."""

    name = "torch"

    def __init__(self) -> None:
        # The plan of the step in flight, keyed by the identity of its metadata: every layer of a step
        # receives the same metadata object. Holding it keeps it alive, so an identity match is never
        # a recycled id.
        self._plan_metadata: AttentionMetadata | None = None
        self._plan: _StepPlan | None = None

    def _plan_for(self, metadata: AttentionMetadata, kv_cache: torch.Tensor, num_tokens: int) -> _StepPlan:
        if metadata is not self._plan_metadata or self._plan is None:
            _check_metadata(metadata, num_tokens)
            self._plan = _StepPlan(metadata, kv_cache.shape[2], kv_cache.device)
            self._plan_metadata = metadata
        return self._plan

    def forward(
        self,
        spec: AttentionSpec,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        plan = self._plan_for(metadata, kv_cache, query.shape[0])
        if query.shape[0] != plan.num_tokens:
            raise ValueError(
                f"metadata covers {plan.num_tokens} query tokens but the batch has {query.shape[0]}"
            )
        self._write(key, value, kv_cache, plan)
        if plan.decode_rows is not None and plan.decode_all_rows:
            return self._decode(spec, query, kv_cache, plan)
        # Every row belongs to a decode or a prefill (zero-length sequences own no rows): all are written.
        output = torch.empty_like(query)
        if plan.decode_rows is not None:
            output.index_copy_(
                0, plan.decode_rows, self._decode(spec, query[plan.decode_rows], kv_cache, plan)
            )
        for prefill in plan.prefills:
            output[prefill.rows] = self._prefill(spec, query[prefill.rows], kv_cache, prefill, plan)
        return output

    @staticmethod
    def _write(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, plan: _StepPlan) -> None:
        num_kv_heads, head_size = kv_cache.shape[-2:]
        if plan.write_rows is not None:
            key, value = key[plan.write_rows], value[plan.write_rows]
        kv_cache[0].view(-1, num_kv_heads, head_size).index_copy_(0, plan.write_slots, key.to(kv_cache.dtype))
        kv_cache[1].view(-1, num_kv_heads, head_size).index_copy_(
            0, plan.write_slots, value.to(kv_cache.dtype)
        )

    @staticmethod
    def _decode(
        spec: AttentionSpec, query: torch.Tensor, kv_cache: torch.Tensor, plan: _StepPlan
    ) -> torch.Tensor:
        """One query per sequence: `query [num_decode, heads, head]` -> same shape, in the query dtype."""
        num_decode = query.shape[0]
        _, num_blocks, block_size, num_kv_heads, head_size = kv_cache.shape
        # One gather for keys and values of every context: [2, num_decode, padded_len, kv_heads, head].
        kv = kv_cache.view(2, num_blocks, -1).index_select(1, plan.decode_blocks)
        kv = kv.view(2, num_decode, -1, num_kv_heads, head_size)[:, :, : plan.decode_max_len]
        k = kv[0].float().transpose(1, 2)  # [num_decode, kv_heads, max_len, head]
        v = kv[1].float().transpose(1, 2)
        q = query.float().unsqueeze(2)  # [num_decode, heads, 1, head]
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=plan.decode_mask(spec.sliding_window), scale=spec.scale, enable_gqa=True
        )
        return out.squeeze(2).to(query.dtype)

    @staticmethod
    def _prefill(
        spec: AttentionSpec, query: torch.Tensor, kv_cache: torch.Tensor, prefill: _Prefill, plan: _StepPlan
    ) -> torch.Tensor:
        """One sequence's chunk `query [query_len, heads, head]` over its cached context."""
        num_kv_heads, head_size = kv_cache.shape[-2:]
        k = kv_cache[0].index_select(0, prefill.blocks).view(-1, num_kv_heads, head_size)[: prefill.seq_len]
        v = kv_cache[1].index_select(0, prefill.blocks).view(-1, num_kv_heads, head_size)[: prefill.seq_len]
        mask = plan.prefill_mask(prefill, spec.sliding_window, query.device)
        out = F.scaled_dot_product_attention(
            query.float().transpose(0, 1),
            k.float().transpose(0, 1),
            v.float().transpose(0, 1),
            attn_mask=mask,
            is_causal=mask is None,
            scale=spec.scale,
            enable_gqa=True,
        )
        return out.transpose(0, 1).to(query.dtype)
