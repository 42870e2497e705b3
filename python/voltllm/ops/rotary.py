"""Rotary position embedding (NeoX and GPT-J layouts, any scaling), with its torch reference.

Scaling (linear, llama3, ...) lives entirely in the inverse frequencies, which
`voltllm.layers.rotary.compute_inv_freq` computes; `cos_sin_cache` turns them into the table the kernel
reads, so every scaled variant runs through the same kernel.
"""

from __future__ import annotations

import torch

from voltllm.ops._dispatch import kernel_ops, use_kernels


def cos_sin_cache(
    inv_freq: torch.Tensor, max_position: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """`[max_position, rot_dim]` fp32 table: cos(position * inv_freq) in the first half, sin in the second."""
    positions = torch.arange(max_position, dtype=torch.float32, device=device)
    freqs = positions[:, None] * inv_freq.to(device=device, dtype=torch.float32)[None, :]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).contiguous()


def _rotate_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, is_neox: bool) -> torch.Tensor:
    # x: [num_tokens, num_heads, rot_dim] fp32; cos/sin: [num_tokens, 1, rot_dim / 2]
    if is_neox:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)


def rotary_embedding_ref(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor | None,
    cos_sin: torch.Tensor,
    head_size: int,
    is_neox: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Reference: returns rotated copies of `query` and `key` (fp32 math, input dtype)."""
    if int(positions.max()) >= cos_sin.shape[0] or int(positions.min()) < 0:
        raise IndexError(f"positions must be in [0, {cos_sin.shape[0]})")
    rot_dim = cos_sin.shape[1]
    table = cos_sin[positions]
    cos, sin = table[:, None, : rot_dim // 2], table[:, None, rot_dim // 2 :]

    def apply(x: torch.Tensor) -> torch.Tensor:
        heads = x.reshape(x.shape[0], -1, head_size).float()
        rotated = torch.cat(
            (_rotate_ref(heads[..., :rot_dim], cos, sin, is_neox), heads[..., rot_dim:]), dim=-1
        )
        return rotated.to(x.dtype).view(x.shape)

    return apply(query), None if key is None else apply(key)


def rotary_embedding(
    positions: torch.Tensor,  # [num_tokens] int64
    query: torch.Tensor,  # [num_tokens, num_heads * head_size] or [num_tokens, num_heads, head_size]
    key: torch.Tensor | None,  # [num_tokens, num_kv_heads * head_size] (or 3-D), or None
    cos_sin: torch.Tensor,  # [max_position, rot_dim] fp32, from `cos_sin_cache`
    head_size: int,
    is_neox: bool = True,
) -> None:
    """Rotate the first `rot_dim` elements of every head of `query` and `key`, in place.

    On CUDA, positions outside the table are left unrotated (checking would need a device sync); the
    reference raises IndexError for them.
    """
    if not use_kernels(query):
        q, k = rotary_embedding_ref(positions, query, key, cos_sin, head_size, is_neox)
        query.copy_(q)
        if key is not None and k is not None:
            key.copy_(k)
        return
    kernel_ops().rotary_embedding(positions, query, key, cos_sin, head_size, is_neox)
