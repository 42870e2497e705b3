"""Unpacking the int32 words quantized checkpoints store their 4- and 8-bit codes in.

Every format here packs `32 // bits` codes per int32 word, code `i` of a word in bits
`[bits * i, bits * (i + 1))` (little-endian, so code `i` of a 4-bit word is a nibble of byte `i // 2`).
They differ in the dimension they pack along and, for AutoAWQ, in the order of the codes within a word.
The unpacking reads the words' bytes (uint8 throughout), so a layer's codes cost one byte each and
nothing wider is ever materialised.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

# AutoAWQ's GEMM layout stores logical columns (0, 2, 4, 6, 1, 3, 5, 7) of each group of eight in codes
# 0..7 of a word; logical column j is therefore code AWQ_REVERSE_ORDER[j].
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)


def unpack_int32(
    packed: torch.Tensor, bits: int, dim: int, order: Sequence[int] | None = None
) -> torch.Tensor:
    """The uint8 codes of `packed` (int32), `32 // bits` per word along `dim`.

    `order`, when given, is which code of a word holds each logical position (AutoAWQ's interleave);
    None is the sequential order (GPTQ, compressed-tensors).
    """
    if packed.dtype != torch.int32:
        raise ValueError(f"packed weights must be int32, got {packed.dtype}")
    if bits not in (4, 8):
        raise ValueError(f"{bits}-bit codes are not supported (4 or 8)")
    words = packed.movedim(dim, -1).contiguous()
    raw = words.view(torch.uint8)  # [..., num_words * 4]: a word's bytes, least significant first
    # 4-bit: code 2i is byte i's low nibble, code 2i + 1 its high one; 8-bit: the bytes are the codes.
    codes = torch.stack((raw & 0xF, raw >> 4), dim=-1).flatten(-2) if bits == 4 else raw
    if order is not None:
        per_word = 32 // bits
        codes = codes.unflatten(-1, (-1, per_word))[..., list(order)].flatten(-2)
    return codes.movedim(-1, dim)
