"""Token embedding and the language-model head (which may share the embedding matrix)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from voltllm.layers.linear import linear


class VocabEmbedding(nn.Module):
    """`ids -> weight[ids]` with `weight: [vocab_size, hidden_size]`."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


class LMHead(nn.Module):
    """Projects hidden states to vocabulary logits, always returned in fp32 (the sampler's dtype).

    With `tied_to`, the head reuses the embedding's parameter (tied word embeddings) instead of owning one.
    """

    def __init__(self, vocab_size: int, hidden_size: int, tied_to: VocabEmbedding | None = None) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.tied = tied_to is not None
        if tied_to is not None:
            self.weight = tied_to.weight
        else:
            self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size))

    def forward(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """fp32 logits; with `out` (fp32, `[rows, vocab]`) they are written there, cast on the way."""
        logits = linear(hidden, self.weight)
        if out is None:
            return logits.float()
        return out.copy_(logits)
