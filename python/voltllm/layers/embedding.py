"""Token embedding and the language-model head, sharded over the tensor-parallel ranks by vocab rows.

Rank r holds rows `[r * per_rank, (r + 1) * per_rank)` of the table. Sharded, the vocabulary is padded
to `tp_size * round_up(vocab / tp_size, padding_size)` rows so every rank holds the same number (the
padding rows are zero and never looked up; their logits are cut off). Unsharded, the table keeps the
checkpoint's shape: padding would change nothing but cost a slice per step.

- `VocabParallelEmbedding`: each rank looks up the ids in its rows (zeros for the others), then the
  ranks' results are summed (all-reduce).
- `ParallelLMHead`: each rank computes the logits of its rows; they are gathered along the vocab.
  It may share the embedding's table (tied word embeddings).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from voltllm.distributed import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)
from voltllm.layers.linear_method import linear
from voltllm.layers.parameter import copy_checked, set_weight_attrs
from voltllm.ops.linear import gemv, gemv_applies

DEFAULT_VOCAB_PADDING_SIZE = 64  # rows per rank are a multiple of this when sharded (GEMM tiles)


@dataclass(frozen=True)
class VocabShard:
    """Which vocab rows this rank holds."""

    vocab_size: int  # the model's (unpadded) vocabulary
    padded_vocab_size: int
    rows_per_rank: int
    start: int  # first token id held here
    end: int  # one past the last real token id held here (<= start + rows_per_rank)

    @staticmethod
    def of(vocab_size: int, rank: int, tp_size: int, padding_size: int) -> VocabShard:
        if tp_size == 1:
            return VocabShard(vocab_size, vocab_size, vocab_size, 0, vocab_size)
        per_rank = -(-vocab_size // tp_size)
        per_rank = -(-per_rank // padding_size) * padding_size
        start = rank * per_rank
        return VocabShard(
            vocab_size, per_rank * tp_size, per_rank, start, max(start, min(start + per_rank, vocab_size))
        )


class VocabParallelEmbedding(nn.Module):
    """`ids -> weight[ids]` with this rank's `weight: [rows_per_rank, hidden_size]`."""

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        padding_size: int = DEFAULT_VOCAB_PADDING_SIZE,
        prefix: str = "",
    ) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.tp_rank = get_tensor_model_parallel_rank()
        self.tp_size = get_tensor_model_parallel_world_size()
        self.shard = VocabShard.of(vocab_size, self.tp_rank, self.tp_size, padding_size)
        self.weight = nn.Parameter(torch.empty(self.shard.rows_per_rank, hidden_size))
        set_weight_attrs(self.weight, {"output_dim": 0, "weight_loader": self.weight_loader})

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: None = None) -> None:
        """This rank's rows of the checkpoint's `[vocab_size, hidden]` table; padding rows zero."""
        load_vocab_rows(self.shard, param, loaded_weight)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        held = (input_ids >= self.shard.start) & (input_ids < self.shard.end)
        local_ids = (input_ids - self.shard.start).masked_fill(~held, 0)
        out = F.embedding(local_ids, self.weight).masked_fill(~held.unsqueeze(-1), 0)
        return tensor_model_parallel_all_reduce(out)

    def extra_repr(self) -> str:
        return f"{self.vocab_size}, {self.weight.shape[1]}, rows={self.shard.start}:{self.shard.end}"


class ParallelLMHead(nn.Module):
    """Hidden states to vocabulary logits, always returned in fp32 (the sampler's dtype).

    With `tied_to`, the head reuses the embedding's parameter (tied word embeddings) and its shard.
    `fp32_gemv=True` (unsharded decode rows on a GPU) has the GEMV store the fp32 logits itself instead
    of a cast kernel after it: the same values, one kernel fewer per step (on by default: H100,
    Qwen3-0.6B batch 1, 0.3-0.5% of the step under race_first sampling, `benches/batch1_ab.py` +lm32).
    """

    fp32_gemv: bool = True

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        tied_to: VocabParallelEmbedding | None = None,
        padding_size: int = DEFAULT_VOCAB_PADDING_SIZE,
        prefix: str = "",
    ) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.tp_size = get_tensor_model_parallel_world_size()
        self.tied = tied_to is not None
        if tied_to is not None:
            self.shard = tied_to.shard
            self.weight = tied_to.weight
        else:
            self.shard = VocabShard.of(
                vocab_size, get_tensor_model_parallel_rank(), self.tp_size, padding_size
            )
            self.weight = nn.Parameter(torch.empty(self.shard.rows_per_rank, hidden_size))
            set_weight_attrs(self.weight, {"output_dim": 0, "weight_loader": self.weight_loader})

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: None = None) -> None:
        load_vocab_rows(self.shard, param, loaded_weight)

    def forward(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """fp32 logits `[rows, vocab_size]`; with `out` (fp32, `[rows, vocab]`) they are written there,
        cast on the way."""
        if self.fp32_gemv and self.tp_size == 1 and gemv_applies(hidden, self.weight):
            if out is None:
                out = torch.empty(hidden.shape[0], self.weight.shape[0], device=hidden.device)
            return gemv(hidden, self.weight, out=out)
        logits = linear(hidden, self.weight)
        if self.tp_size > 1:
            logits = tensor_model_parallel_all_gather(logits, dim=-1)[:, : self.vocab_size]
        if out is None:
            return logits.float()
        return out.copy_(logits)


def load_vocab_rows(shard: VocabShard, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
    """Copy the rows `shard` holds of a `[vocab_size, hidden]` checkpoint table; zero the padding."""
    if loaded_weight.shape[0] != shard.vocab_size:
        raise ValueError(
            f"checkpoint shape {tuple(loaded_weight.shape)} has not {shard.vocab_size} vocab rows"
        )
    rows = shard.end - shard.start
    copy_checked(param.data[:rows], loaded_weight[shard.start : shard.end])
    with torch.no_grad():
        param.data[rows:].zero_()
