"""The structured-output mask (csrc/structured/apply_token_bitmask.cuh), with its torch reference.

`apply_token_bitmask` sets, in place, every logit whose token a grammar disallows to -inf. The mask is
llguidance's bitmask as it fills it: int32 words, bit `t % 32` of word `t // 32` set when token `t` is
allowed. Mask `m` applies to logits row `rows[m]` (row `m` when `rows` is None); bits past the logits'
width are ignored.
"""

from __future__ import annotations

import torch

from voltllm.ops._dispatch import kernel_ops, use_kernels


def apply_token_bitmask_ref(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None
) -> None:
    """The reference: unpack the bits to a boolean mask and `masked_fill` the rows.

    logits: [num_rows, vocab]; bitmask: [num_masks, words] int32; rows: [num_masks] int32 or None."""
    num_masks, vocab = bitmask.shape[0], logits.shape[1]
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    disallowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).view(num_masks, -1)[:, :vocab] == 0
    if rows is None:
        logits[:num_masks].masked_fill_(disallowed, float("-inf"))
    else:
        index = rows.long()
        logits[index] = logits[index].masked_fill(disallowed, float("-inf"))


def apply_token_bitmask(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None
) -> None:
    """Set `logits[rows[m], t]` to -inf wherever bit `t` of `bitmask[m]` is 0, in place (one kernel on
    CUDA tensors; `apply_token_bitmask_ref` elsewhere).

    logits: [num_rows, vocab] float32/float16/bfloat16 with contiguous rows; bitmask: [num_masks,
    words] int32 contiguous, words * 32 >= vocab; rows: [num_masks] int32 (distinct rows), or None for
    rows 0..num_masks-1."""
    if bitmask.dtype != torch.int32 or bitmask.dim() != 2:
        raise ValueError(f"bitmask must be a 2-D int32 tensor, got {bitmask.dtype} {tuple(bitmask.shape)}")
    if bitmask.shape[1] * 32 < logits.shape[-1]:
        raise ValueError(f"{bitmask.shape[1]} bitmask words cannot cover {logits.shape[-1]} tokens")
    if use_kernels(logits):
        kernel_ops().apply_token_bitmask(logits, bitmask, rows)
    else:
        apply_token_bitmask_ref(logits, bitmask, rows)
