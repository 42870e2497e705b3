"""The experts in plain torch: the CPU path, the oracle for the CUDA kernels (`voltllm.ops.moe`), and
the GPU path for the shapes those kernels do not take.

Every form computes, for each token t and each of its k chosen experts e with weight w,
    out[t] += w * down_e(silu(gate_e(x[t])) * up_e(x[t]))
from stacked weights `w13 [E, 2 * I, H]` (gate rows, then up rows) and `w2 [E, H, I]`, accumulating in
fp32 and returning the input's dtype. They differ in which weights they read and whether the host must
see the routing:

- `experts_grouped`: token/expert pairs sorted by expert; each expert that got tokens runs once on its
  tokens (idle experts are never touched). Reads each chosen expert once, but needs the per-expert
  counts on the host (a sync): the CPU path and eager GPU prefill.
- `experts_gathered`: the chosen experts' weights gathered per pair and applied as a batched
  matrix-vector product. No host sync (CUDA-graph safe); copies `pairs` experts, so it pays only while
  the pairs are few next to the experts (small decode batches).
- `experts_dense`: every expert on every token, the routing applied as a `[T, E]` combine matrix. No
  host sync; reads every expert once, which is what a large decode batch touches anyway.

`fused_experts` picks one; on a GPU the expert kernels (`csrc/moe/`, `voltllm.ops.moe.fused_moe`) run
instead wherever they apply.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from voltllm.layers.activation import silu_and_mul, swiglu


def experts_grouped(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2 * I, H]
    w2: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, k] fp32
    topk_ids: torch.Tensor,  # [T, k] int64
) -> torch.Tensor:  # [T, H]
    num_tokens, top_k = topk_ids.shape
    flat_ids = topk_ids.flatten()  # pair p = (token p // k, its (p % k)-th expert)
    flat_weights = topk_weights.flatten()
    pairs_by_expert = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids, minlength=w13.shape[0]).tolist()  # the host sync
    y_pairs = torch.empty(num_tokens * top_k, x.shape[1], dtype=torch.float32, device=x.device)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        pairs = pairs_by_expert[start : start + count]
        start += count
        y = F.linear(swiglu(F.linear(x[pairs // top_k], w13[expert])), w2[expert])
        y_pairs[pairs] = y.float() * flat_weights[pairs, None]
    return y_pairs.view(num_tokens, top_k, -1).sum(dim=1).to(x.dtype)  # every pair is written once


def experts_gathered(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> torch.Tensor:
    num_tokens, top_k = topk_ids.shape
    flat_ids = topk_ids.flatten()
    xs = x.repeat_interleave(top_k, dim=0)  # [P, H]: pair p's token row
    h = torch.bmm(w13[flat_ids], xs.unsqueeze(-1)).squeeze(-1)  # [P, 2 * I]
    y = torch.bmm(w2[flat_ids], silu_and_mul(h).unsqueeze(-1)).squeeze(-1)  # [P, H]
    y = y.float() * topk_weights.reshape(-1, 1)
    return y.view(num_tokens, top_k, -1).sum(dim=1).to(x.dtype)


def experts_dense(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> torch.Tensor:
    num_tokens = x.shape[0]
    h = torch.matmul(x, w13.transpose(1, 2))  # [E, T, 2 * I]
    y = torch.bmm(silu_and_mul(h), w2.transpose(1, 2))  # [E, T, H]
    combine = torch.zeros(num_tokens, w13.shape[0], dtype=torch.float32, device=x.device)
    combine.scatter_(1, topk_ids, topk_weights)  # [T, E]: a token's weight for each expert, 0 if unchosen
    return torch.einsum("te,eth->th", combine, y.float()).to(x.dtype)


# Up to this many tokens a GPU step runs every expert rather than sync for the routing: a decode batch
# this large touches nearly every expert (64 tokens x top-8 of 128 miss each expert with p ~ 1.6%).
DENSE_MAX_TOKENS = 256


def gather_pays(num_pairs: int, num_experts: int) -> bool:
    """Gathering copies each pair's expert (a read and a write); dense reads every expert once."""
    return 4 * num_pairs <= num_experts


def fused_experts(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> torch.Tensor:
    """The weighted sum of each token's experts, by the cheapest form that is legal here: on the CPU
    the grouped one; on a GPU no host sync while a CUDA graph is being captured or for decode-sized
    batches, the grouped one for prefill."""
    if not x.is_cuda:
        return experts_grouped(x, w13, w2, topk_weights, topk_ids)
    if gather_pays(topk_ids.numel(), w13.shape[0]):
        return experts_gathered(x, w13, w2, topk_weights, topk_ids)
    if torch.cuda.is_current_stream_capturing() or x.shape[0] <= DENSE_MAX_TOKENS:
        return experts_dense(x, w13, w2, topk_weights, topk_ids)
    return experts_grouped(x, w13, w2, topk_weights, topk_ids)
