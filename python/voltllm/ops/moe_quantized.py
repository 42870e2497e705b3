"""Quantized experts on CUDA (AWQ, GPTQ, compressed-tensors int4 / int8, fp8 as W8A16): the stacked
packed layout and the decode path (`csrc/moe/quant_pair_gemv.cuh`).

`pack_experts(weights)` packs each expert's `QuantizedWeight` into the layout of the quantized linear
kernels (`voltllm.ops.quantized_linear.pack`: 16-byte chunks of codes, one 32-bit word per group) and
stacks them: `packed [E, rows, k * bits / 8]`, `group_params [E, rows, num_groups]`. Memory is the packed
size; nothing dense is kept.

`fused_moe_quantized` computes a sparse block's experts without a host sync, so a decode step captures in a
CUDA graph, by one of two paths (`quantized_path` picks by the token count):
- `pairs`, up to QUANT_PAIRS_MAX_TOKENS tokens (two launches after the routing): the gated stage per
  (token, expert) pair, the down stage with the top-k sum per token, each pair's expert weights read once
  in their packed form and dequantized in registers (an expert two tokens share is read twice);
- `dequantized`, more tokens (prefill, large decode batches): both stacks dequantized into transient
  fp16 buffers by the quantization kernels' dequantize kernel (two launches), then the fp16 expert
  kernels of `voltllm.ops.moe.fused_moe` (the tensor-core grouped GEMM at these sizes).
Act-order experts (`g_idx`) are packed with their columns sorted by group; the pair path gathers each
pair's input row into its expert's column order, the dequantized path puts the columns back.

The definition is `dequantize` then the fp16 experts (`voltllm.layers.fused_moe.experts_torch`); the pair
path's products are the quantized GEMV's (fp16 products summed 8 at a time, then fp32).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from voltllm.ops._dispatch import kernel_ops
from voltllm.ops.moe import MAX_EXPERTS, MAX_TOP_K, fused_moe
from voltllm.ops.quantized_linear import KIND_INT4, pack, unsupported_reason

if TYPE_CHECKING:  # the seam's type only: ops sit below layers and take the weights as they come
    from voltllm.layers.quantization.quantized_weight import QuantizedWeight

# Tokens up to which `fused_moe_quantized` runs pair by pair. H200, one Qwen3-30B-A3B layer of int4 g128
# experts (benches/moe.py quant, session 10 call 3), pairs vs dequantized: 18.7 vs 830 us at 1 token,
# 129 vs 1,030 at 16, 460 vs 1,446 at 64, 894 vs 1,456 at 128, 1,320 vs 1,464 at 192, 1,755 vs 1,470
# at 256: the pair path grows ~7 us a token, the dequantized one stays ~1.45 ms. (A tiled path, the
# align kernel's tiles of 8 slots with each tile's expert read once, measured slower than one of the two
# at every size in call 2: 24 / 198 / 492 / 1,675 us at 1 / 16 / 64 / 256 tokens.)
QUANT_PAIRS_MAX_TOKENS = 192
PATHS = ("pairs", "dequantized")


@dataclass
class PackedQuantExperts:
    """One stacked expert matrix (`[gate | up]` or down) of every expert, in the kernels' layout."""

    packed: torch.Tensor  # uint8 [E, rows, k * bits / 8]
    group_params: torch.Tensor  # int32 [E, rows, num_groups]
    column_order: torch.Tensor | None  # int64 [E, k]: each expert's input columns in packed order, or None
    kind: int  # quantized_linear.KIND_*
    group_size: int

    @property
    def num_experts(self) -> int:
        return self.packed.shape[0]

    @property
    def rows(self) -> int:
        return self.packed.shape[1]

    @property
    def in_features(self) -> int:
        return self.packed.shape[2] * (2 if self.kind == KIND_INT4 else 1)

    @property
    def nbytes_per_expert(self) -> int:
        """Bytes the kernels read of one expert: packed codes and group parameters."""
        return self.packed[0].numel() + self.group_params[0].numel() * 4


def experts_unsupported_reason(weights: list[QuantizedWeight]) -> str | None:
    """Why the quantized expert kernels cannot run these experts (one matrix kind of every expert), or
    None when they can: every expert must be one the quantized linear kernels take, all of the same kind,
    bits, group size and shape."""
    first = weights[0]
    for e, weight in enumerate(weights):
        reason = unsupported_reason(weight)
        if reason is not None:
            return f"expert {e}: {reason}"
        same = (weight.kind, weight.bits, weight.group_size, weight.shape)
        if same != (first.kind, first.bits, first.group_size, first.shape):
            return f"expert {e} is quantized unlike expert 0"
    if len(weights) > MAX_EXPERTS:
        return f"{len(weights)} experts (the kernels take up to {MAX_EXPERTS})"
    return None


def pack_experts(weights: list[QuantizedWeight]) -> PackedQuantExperts:
    """The experts' weights packed and stacked (raises ValueError where `experts_unsupported_reason`)."""
    reason = experts_unsupported_reason(weights)
    if reason is not None:
        raise ValueError(f"no quantized expert kernel for these experts: {reason}")
    packs = [pack(w) for w in weights]
    orders = [p.column_order for p in packs]
    column_order = None
    if any(order is not None for order in orders):
        identity = torch.arange(packs[0].shape[1], device=packs[0].packed.device)
        column_order = torch.stack([identity if order is None else order for order in orders])
    return PackedQuantExperts(
        packed=torch.stack([p.packed for p in packs]),
        group_params=torch.stack([p.group_params for p in packs]),
        column_order=column_order,
        kind=packs[0].kind,
        group_size=packs[0].group_size,
    )


def fused_moe_quantized_applies(
    x: torch.Tensor, w13: PackedQuantExperts, w2: PackedQuantExperts, top_k: int
) -> bool:
    """True where `fused_moe_quantized` runs: CUDA float16 `x [T, H]` with contiguous, 16-byte aligned
    rows, gate/up `[E, 2I, H]` and down `[E, H, I]` stacks of the same experts, I a multiple of 8, at
    most MAX_TOP_K choices."""
    if not (x.is_cuda and x.dim() == 2 and x.dtype == torch.float16):
        return False
    hidden = x.shape[1]
    return (
        w13.in_features == hidden
        and w2.num_experts == w13.num_experts
        and w2.rows == hidden
        and w13.rows == 2 * w2.in_features
        and w2.in_features % 8 == 0
        and x.stride(1) == 1
        and x.stride(0) % 8 == 0
        and x.data_ptr() % 16 == 0
        and 0 < top_k <= min(MAX_TOP_K, w13.num_experts)
    )


def _gather_pair_rows(
    rows: torch.Tensor, experts: PackedQuantExperts, topk_ids: torch.Tensor
) -> torch.Tensor:
    """`rows [pairs, k]` with each pair's columns in its expert's packed order (act-order experts)."""
    assert experts.column_order is not None
    return rows.gather(1, experts.column_order[topk_ids.reshape(-1).long()])


def fused_moe_quantized_pairs(
    x: torch.Tensor,  # [T, H] float16
    w13: PackedQuantExperts,  # [E, 2I, H]
    w2: PackedQuantExperts,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, k] fp32
    topk_ids: torch.Tensor,  # [T, k] int32
) -> torch.Tensor:  # [T, H] float16
    """The pair path (two launches, no host sync): gated stage per pair, down stage + top-k sum per
    token, each pair's expert read in its packed form."""
    num_tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    ops = kernel_ops()
    a, rows_per_pair = x, False
    if w13.column_order is not None:
        a, rows_per_pair = _gather_pair_rows(x.repeat_interleave(top_k, dim=0), w13, topk_ids), True
    act = torch.empty(topk_ids.numel(), w13.rows // 2, dtype=x.dtype, device=x.device)
    ops.moe_quant_pair_experts(
        act, a, w13.packed, w13.group_params, topk_ids, topk_weights, w13.kind, w13.group_size, True,
        rows_per_pair,
    )  # fmt: skip
    if w2.column_order is not None:
        act = _gather_pair_rows(act, w2, topk_ids)
    out = torch.empty(num_tokens, hidden, dtype=x.dtype, device=x.device)
    ops.moe_quant_pair_experts(
        out, act, w2.packed, w2.group_params, topk_ids, topk_weights, w2.kind, w2.group_size, False, True
    )
    return out


def dequantize_experts(experts: PackedQuantExperts) -> torch.Tensor:
    """The dense float16 `[E, rows, k]` stack in checkpoint column order (a transient: 4x an int4 stack),
    by the quantization kernels' dequantize kernel, one launch for every expert."""
    num_experts, rows, _ = experts.packed.shape
    k = experts.in_features
    dense = torch.empty(num_experts, rows, k, dtype=torch.float16, device=experts.packed.device)
    kernel_ops().quant_dequantize(
        dense.view(num_experts * rows, k),
        experts.packed.view(num_experts * rows, -1),
        experts.group_params.view(num_experts * rows, -1),
        experts.kind,
        experts.group_size,
    )
    if experts.column_order is None:
        return dense
    # Packed column c of expert e is checkpoint column order[e, c]: scatter them back.
    index = experts.column_order[:, None, :].expand(num_experts, rows, k)
    return torch.empty_like(dense).scatter_(2, index, dense)


def quantized_path(num_tokens: int) -> str:
    """The path `fused_moe_quantized` takes for `num_tokens` tokens (see the module docstring)."""
    return "pairs" if num_tokens <= QUANT_PAIRS_MAX_TOKENS else "dequantized"


def fused_moe_quantized(
    x: torch.Tensor,  # [T, H] float16
    w13: PackedQuantExperts,  # [E, 2I, H]: each expert's gate rows, then its up rows
    w2: PackedQuantExperts,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, k] fp32
    topk_ids: torch.Tensor,  # [T, k] int32
    path: str | None = None,  # one of PATHS; None: `quantized_path`'s choice
) -> torch.Tensor:  # [T, H] float16
    """`sum_j topk_weights[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t]))` over each token's experts
    `e = topk_ids[t, j]` with quantized expert weights (check `fused_moe_quantized_applies` first). No
    host sync."""
    if topk_ids.dtype != torch.int32 or topk_weights.dtype != torch.float32:
        raise ValueError("fused_moe_quantized takes int32 topk_ids and fp32 topk_weights (from topk_softmax)")
    path = path or quantized_path(x.shape[0])
    if path == "pairs":
        return fused_moe_quantized_pairs(x, w13, w2, topk_weights, topk_ids)
    if path == "dequantized":
        return fused_moe(x, dequantize_experts(w13), dequantize_experts(w2), topk_weights, topk_ids)
    raise ValueError(f"unknown quantized expert path {path!r} (one of {', '.join(PATHS)})")
