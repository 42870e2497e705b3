"""The router's choice: softmax over the experts' logits, the top k, optionally renormalised.

Computed in fp32 whatever the model's dtype, as transformers does (Qwen2-MoE, Qwen3-MoE, Mixtral):
`softmax(logits.float())`, `topk`, then divided by the sum of the k chosen probabilities where the model
renormalises (Qwen's `norm_topk_prob`; Mixtral always). The weights stay fp32 into the weighted sum. The
definition lives beside its fused kernel, `voltllm.ops.moe.topk_softmax_ref`.
"""

from __future__ import annotations

import torch

from voltllm.ops.moe import topk_softmax_ref


def select_experts(
    router_logits: torch.Tensor,  # [T, num_experts], any float dtype
    top_k: int,
    renormalize: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(topk_weights fp32 [T, top_k], topk_ids int64 [T, top_k])`, each row's experts by falling
    probability, in plain torch (the CPU path and the torch forms of the experts)."""
    return topk_softmax_ref(router_logits, top_k, renormalize)
