"""The mixture-of-experts kernels (`csrc/moe/`): routing, the two expert stages and the top-k sum.

A step of `fused_moe` on CUDA is five launches and no host sync (so it captures in a CUDA graph):
1. `topk_softmax`: each token's softmax over the expert logits in fp32, its top k, renormalised or not;
2. `moe_align`: the `pairs = tokens * top_k` (token, expert) pairs sorted by expert into tiles of
   `tile_rows` slots, each expert's run padded with -1; the buffers are sized for the worst case
   (`moe_max_tiles`) and the count of tiles in use stays on the device;
3. the gated stage, `act[slot] = silu(x @ gate_e.T) * (x @ up_e.T)` for each slot's token and expert;
4. the down stage, `y[pair] = weight * (act[slot] @ down_e.T)` in fp32;
5. `moe_combine`, `out[t] = sum_j y[t * top_k + j]`, rounded once.

Up to PAIRS_MAX_TOKENS tokens (small decode batches) the step is three launches instead:
`topk_softmax`, then `fused_moe_pairs` (`pair_gemv.cuh`): the gated stage per pair, its expert taken
straight from the routing (no align: a token's k experts are distinct, and at a few tokens tiles would
save little),
and the down stage with the top-k sum per token (no combine, no fp32 `y` round trip), by the staged
kernel up to PAIR_DOWN_STAGED_MAX_TOKENS tokens and the unstaged one past that (`pair_down_chunks`).

Stages 3 and 4 run one of two kernels, picked by `use_grouped_gemm` from the shape alone: the decode
GEMV (`expert_gemv.cuh`, tiles of 8 slots, CUDA cores: an expert's weights are read once per tile, and
at decode sizes an expert gets a tile or so), or the tensor-core grouped GEMM (`grouped_gemm_wmma.cuh`,
tiles of 64 slots, fp16 WMMA on Volta, bf16 from SM80) once the experts get many tokens each.

The definition of the routing is `topk_softmax_ref`; the experts' definition is the torch forms in
`voltllm.layers.fused_moe.experts_torch`, which the tests compare against.
"""

from __future__ import annotations

import torch

from voltllm.ops._dispatch import kernel_ops, use_kernels
from voltllm.ops.variants import MOE_PAIR_DOWN_STAGED_CHUNKS as PAIR_DOWN_STAGED_CHUNKS

# What the kernels are built for (csrc/moe/moe_params.cuh).
MAX_EXPERTS = 512
MAX_TOP_K = 32
# Average pairs per expert above which the tensor-core grouped GEMM beats the decode GEMV (whose tiles
# hold 8 slots: an expert's weights are read once per tile). Measured on the H200 with the
# Qwen3-30B-A3B experts (benches/moe.py kernels): the GEMV wins at 8 tokens of top-8 over 128 experts
# (0.5 pairs per expert), the GEMM at 64 (4 per expert).
GROUPED_GEMM_MIN_PAIRS_PER_EXPERT = 2
# Tokens up to which `fused_moe` runs pair by pair (`fused_moe_pairs`: two launches, no align or
# combine; a shared expert is read once per token). Measured on the H200 (benches/moe.py kernels,
# session 9 calls 1 and 3): 26.2 vs 41.1 us at 1 token, 130.8 vs 182.8 us at 8 (54 experts for 64
# pairs), 226.5 vs 294.4 us at 16 (83 experts) against the tiled GEMV.
PAIRS_MAX_TOKENS = 16
# The pair path's down stage: 0 runs `moe_pair_down_kernel`; 12 runs `moe_pair_down_staged_kernel` with
# 12 16-byte weight loads per lane in flight, act staged in shared memory and the first round's loads issued
# before the wait for the gated stage. The default up to PAIR_DOWN_STAGED_MAX_TOKENS tokens.
PAIR_DOWN_CHUNKS = 12
# Tokens up to which the pair path runs the staged down stage (PAIR_DOWN_CHUNKS); past them, chunks 0.
# Measured on the H100 (issue 17, `benches/moe_down_ab.sh --no-tests`, Qwen3-30B-A3B shape, fp16): one
# layer from a graph, the down stage 11.0 vs 12.9 us (1.17x over chunks 0) at 1 token, 58.0 vs 60.4 at 8,
# 100.6 vs 103.0 at 16, but 369.9 vs 311.9 (0.84x) at 64; the decode step 3.242 vs 3.300 ms at batch 1
# (0.632 of its 2.049 ms floor), 9.326 vs 9.429 ms at batch 8. 24 loads in flight and routing inside the
# pair stages (no top-k launch) lost and were dropped: 24 0.90x of chunks 0's down stage at 8 tokens,
# routed 0.92x (12) and 0.88x (24) of the batch-8 step.
PAIR_DOWN_STAGED_MAX_TOKENS = 16
# Shared memory the staged kernel stages a token's act rows in (csrc/moe/pair_gemv.cuh,
# kMoePairStagedMaxSmem, moe_pair_staged_smem_bytes): top_k * k / 8 chunks of 16 bytes and a 4-byte
# routing weight each.
PAIR_DOWN_STAGED_MAX_SMEM = 48 * 1024


def topk_softmax_ref(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The router's choice as transformers computes it (Qwen2-MoE, Qwen3-MoE, Mixtral):
    `softmax(logits.float())`, its `topk`, divided by the sum of the k chosen probabilities when
    `renormalize`. Returns `(topk_weights fp32 [T, k], topk_ids int64 [T, k])` by falling probability."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    topk_weights, topk_ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return topk_weights, topk_ids


def topk_softmax(
    router_logits: torch.Tensor,  # [T, num_experts]
    top_k: int,
    renormalize: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`topk_softmax_ref`, by the fused kernel on CUDA (fp16/bf16 logits, up to MAX_EXPERTS experts and
    MAX_TOP_K choices): its ids are int32 there, int64 elsewhere."""
    num_experts = router_logits.shape[-1]
    if not 0 < top_k <= num_experts:
        raise ValueError(f"top_k {top_k} must be in 1..num_experts ({num_experts})")
    if not (
        use_kernels(router_logits)
        and router_logits.dtype in (torch.float16, torch.bfloat16)
        and router_logits.dim() == 2
        and router_logits.stride(1) == 1
        and num_experts <= MAX_EXPERTS
        and top_k <= MAX_TOP_K
    ):
        return topk_softmax_ref(router_logits, top_k, renormalize)
    num_tokens = router_logits.shape[0]
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=router_logits.device)
    kernel_ops().moe_topk_softmax(weights, ids, router_logits, renormalize)
    return weights, ids


def moe_max_tiles(num_pairs: int, num_experts: int, tile_rows: int) -> int:
    """Most tiles `num_pairs` pairs can fill: each used expert pads its run to a whole tile, and every
    tile holds at least one pair."""
    used = min(num_experts, num_pairs)
    return max(1, min(num_pairs, (num_pairs + used * (tile_rows - 1)) // tile_rows))


def moe_tile_rows(grouped_gemm: bool) -> int:
    """Slots per tile of the grouped GEMM (True) or the decode GEMV (False)."""
    return kernel_ops().moe_tile_rows(grouped_gemm)


def moe_align(
    topk_ids: torch.Tensor,  # [T, k] int32, on CUDA
    num_experts: int,
    tile_rows: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The pairs sorted by expert into tiles: `(sorted_pair_ids [max_tiles * tile_rows] int32, -1 for
    padding; tile_experts [max_tiles] int32; num_tiles [1] int32)`. Only the first `num_tiles` tiles are
    written; which slot of its expert's run a pair lands in varies between runs."""
    num_pairs = topk_ids.numel()
    max_tiles = moe_max_tiles(num_pairs, num_experts, tile_rows)
    device = topk_ids.device
    sorted_pair_ids = torch.empty(max_tiles * tile_rows, dtype=torch.int32, device=device)
    tile_experts = torch.empty(max_tiles, dtype=torch.int32, device=device)
    num_tiles = torch.empty(1, dtype=torch.int32, device=device)
    kernel_ops().moe_align(sorted_pair_ids, tile_experts, num_tiles, topk_ids, num_experts, tile_rows)
    return sorted_pair_ids, tile_experts, num_tiles


def use_grouped_gemm(num_pairs: int, num_experts: int, dtype: torch.dtype, device: torch.device) -> bool:
    """The tensor-core grouped GEMM once the experts average more than GROUPED_GEMM_MIN_PAIRS_PER_EXPERT
    pairs (bf16 needs SM80 for it: Volta then runs the decode GEMV at every size)."""
    if dtype == torch.bfloat16 and torch.cuda.get_device_capability(device)[0] < 8:
        return False
    return num_pairs > GROUPED_GEMM_MIN_PAIRS_PER_EXPERT * num_experts


def fused_moe_applies(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int) -> bool:
    """True where `fused_moe` runs the kernels: CUDA fp16/bf16 `x [T, H]` with contiguous, 16-byte
    aligned rows, contiguous stacked weights `w13 [E, 2I, H]`, `w2 [E, H, I]` of x's dtype, H and I
    multiples of 8, at most MAX_EXPERTS experts and MAX_TOP_K choices."""
    if not (x.is_cuda and x.dim() == 2 and w13.dim() == 3 and w2.dim() == 3):
        return False
    num_experts, two_i, hidden = w13.shape
    return (
        x.dtype in (torch.float16, torch.bfloat16)
        and w13.dtype == x.dtype
        and w2.dtype == x.dtype
        and x.shape[1] == hidden
        and w2.shape == (num_experts, hidden, two_i // 2)
        and hidden % 8 == 0
        and two_i % 16 == 0
        and x.stride(1) == 1
        and x.stride(0) % 8 == 0
        and x.data_ptr() % 16 == 0
        and w13.is_contiguous()
        and w2.is_contiguous()
        and num_experts <= MAX_EXPERTS
        and 0 < top_k <= min(MAX_TOP_K, num_experts)
    )


def staged_pair_down_fits(top_k: int, w2: torch.Tensor) -> bool:
    """Whether the staged down stage takes `w2 [E, H, I]` at `top_k`: the token's act rows and their
    routing weights fit PAIR_DOWN_STAGED_MAX_SMEM, and the stack has fewer than 2^32 16-byte chunks."""
    row_chunks = w2.shape[2] // 8
    return 0 < top_k * row_chunks * 20 <= PAIR_DOWN_STAGED_MAX_SMEM and w2.numel() // 8 < 2**32


def pair_down_chunks(num_tokens: int, top_k: int, w2: torch.Tensor, requested: int | None = None) -> int:
    """The down-stage variant `fused_moe_pairs` runs on `num_tokens` tokens: `requested`, or when None
    PAIR_DOWN_CHUNKS up to PAIR_DOWN_STAGED_MAX_TOKENS tokens and 0 past them, where the staged kernel takes
    the shape, else 0 (the unstaged kernel takes every shape)."""
    if requested is not None:
        chunks = requested
    else:
        chunks = PAIR_DOWN_CHUNKS if num_tokens <= PAIR_DOWN_STAGED_MAX_TOKENS else 0
    if chunks not in (0, *PAIR_DOWN_STAGED_CHUNKS):
        raise ValueError(f"down_chunks must be 0 or one of {PAIR_DOWN_STAGED_CHUNKS}, got {chunks}")
    return chunks if chunks and staged_pair_down_fits(top_k, w2) else 0


def fused_moe_pairs(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H]
    w2: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, k] fp32
    topk_ids: torch.Tensor,  # [T, k] int32
    down_chunks: int | None = None,  # the down stage's variant; None: `pair_down_chunks`' default
) -> torch.Tensor:  # [T, H] in x's dtype
    """`fused_moe` pair by pair (`csrc/moe/pair_gemv.cuh`): the gated stage per (token, expert) pair,
    the down stage and the top-k sum per token; two launches, no align, no combine. An expert two
    tokens share is read twice: the path of small decode batches (PAIRS_MAX_TOKENS)."""
    num_tokens, hidden = x.shape
    ops = kernel_ops()
    act = torch.empty(topk_ids.numel(), w13.shape[1] // 2, dtype=x.dtype, device=x.device)
    ops.moe_pair_experts(act, x, w13, topk_ids, topk_weights, True)
    out = torch.empty(num_tokens, hidden, dtype=x.dtype, device=x.device)
    chunks = pair_down_chunks(num_tokens, topk_ids.shape[1], w2, down_chunks)
    ops.moe_pair_experts(out, act, w2, topk_ids, topk_weights, False, chunks)
    return out


def fused_moe(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H]: each expert's gate rows, then its up rows
    w2: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, k] fp32
    topk_ids: torch.Tensor,  # [T, k] int32
    grouped_gemm: bool | None = None,  # the tiled path's kernel; None: the pair path up to
    # PAIRS_MAX_TOKENS tokens, then `use_grouped_gemm`'s choice
) -> torch.Tensor:  # [T, H] in x's dtype
    """`sum_j topk_weights[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t]))` over each token's experts
    `e = topk_ids[t, j]`, by the kernels (check `fused_moe_applies` first). No host sync."""
    num_tokens, hidden = x.shape
    num_experts, two_i, _ = w13.shape
    top_k = topk_ids.shape[1]
    if topk_ids.dtype != torch.int32 or topk_weights.dtype != torch.float32:
        raise ValueError("fused_moe takes int32 topk_ids and fp32 topk_weights (from topk_softmax)")
    if grouped_gemm is None:
        if num_tokens <= PAIRS_MAX_TOKENS:
            return fused_moe_pairs(x, w13, w2, topk_weights, topk_ids)
        grouped_gemm = use_grouped_gemm(topk_ids.numel(), num_experts, x.dtype, x.device)
    tile_rows = moe_tile_rows(grouped_gemm)
    sorted_pair_ids, tile_experts, num_tiles = moe_align(topk_ids, num_experts, tile_rows)
    ops = kernel_ops()
    act = torch.empty(sorted_pair_ids.numel(), two_i // 2, dtype=x.dtype, device=x.device)
    weights = topk_weights.reshape(-1)
    ops.moe_experts(act, x, w13, sorted_pair_ids, tile_experts, num_tiles, weights, top_k, True, grouped_gemm)
    y = torch.empty(topk_ids.numel(), hidden, dtype=torch.float32, device=x.device)
    ops.moe_experts(y, act, w2, sorted_pair_ids, tile_experts, num_tiles, weights, top_k, False, grouped_gemm)
    out = torch.empty(num_tokens, hidden, dtype=x.dtype, device=x.device)
    ops.moe_combine(out, y, top_k)
    return out
