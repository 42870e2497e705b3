"""Rotary position embedding (RoPE), NeoX / Hugging Face style (rotate the two halves of each head).

The frequencies come from the config's RoPE parameters (`rope_parameters` in transformers >= 5, or the
older `rope_theta` + `rope_scaling`). Supported scaling types: `default`, `linear`, `llama3`, `yarn`.
YaRN also scales cos/sin by an attention factor (`rope_attention_scaling`).

Two paths, same math: on CUDA in fp16/bf16 the `voltllm.ops` kernel rotates q/k in place, reading a
cos/sin table of `max_position_embeddings` rows; elsewhere cos/sin are computed per step from the
positions in fp32 (the form the CPU tests check against transformers).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from voltllm.layers.dispatch import use_cuda_kernels

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rope_parameters_of(hf_config: Any) -> dict[str, Any]:
    """The config's RoPE parameters as one flat dict with at least `rope_type` and `rope_theta`."""
    params = getattr(hf_config, "rope_parameters", None)
    if params is None:  # transformers < 5 keeps theta and scaling apart
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    params = dict(params)
    if params and all(isinstance(v, dict) for v in params.values()):
        raise ValueError("per-layer-type RoPE parameters are not supported by this model family")
    params.setdefault("rope_type", params.get("type", "default"))
    params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    return params


def _default_inv_freq(rotary_dim: int, base: float) -> torch.Tensor:
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    return 1.0 / (base**exponents)


def _llama3_inv_freq(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1 scaling: long wavelengths divided by `factor`, short ones kept, a smooth ramp between."""
    factor = float(params["factor"])
    low_freq_factor = float(params["low_freq_factor"])
    high_freq_factor = float(params["high_freq_factor"])
    old_context_len = float(params["original_max_position_embeddings"])
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor

    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_original_len(params: dict[str, Any], max_position_embeddings: int) -> int:
    return int(params.get("original_max_position_embeddings") or max_position_embeddings)


def _yarn_factor(params: dict[str, Any], max_position_embeddings: int) -> float:
    # Without an explicit factor (DeepSeek style), the extension ratio is the factor.
    if params.get("factor") is not None:
        return float(params["factor"])
    return max_position_embeddings / _yarn_original_len(params, max_position_embeddings)


def _yarn_inv_freq(rotary_dim: int, params: dict[str, Any], max_position_embeddings: int) -> torch.Tensor:
    """YaRN: interpolate (divide by `factor`) the low frequencies, keep the high ones, linear ramp
    between the dimensions that rotate `beta_slow` and `beta_fast` times over the original context."""
    base = float(params["rope_theta"])
    factor = _yarn_factor(params, max_position_embeddings)
    original_len = _yarn_original_len(params, max_position_embeddings)
    beta_fast = float(params.get("beta_fast") or 32)
    beta_slow = float(params.get("beta_slow") or 1)

    def correction_dim(num_rotations: float) -> float:
        return rotary_dim * math.log(original_len / (num_rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = _default_inv_freq(rotary_dim, base)
    interpolation = extrapolation / factor
    return interpolation * ramp + extrapolation * (1 - ramp)


def rope_attention_scaling(params: dict[str, Any], max_position_embeddings: int) -> float:
    """Factor on cos/sin: YaRN's `attention_factor` (default derived from `factor` and `mscale`s), else 1."""
    if params["rope_type"] != "yarn":
        return 1.0
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    factor = _yarn_factor(params, max_position_embeddings)
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return _yarn_mscale(factor, float(mscale)) / _yarn_mscale(factor, float(mscale_all_dim))
    return _yarn_mscale(factor)


def rope_max_positions(params: dict[str, Any], max_position_embeddings: int) -> int:
    """Longest context the RoPE parameters are meant for: YaRN extends the original length by `factor`."""
    if params["rope_type"] == "yarn":
        original_len = _yarn_original_len(params, max_position_embeddings)
        extended = int(original_len * _yarn_factor(params, max_position_embeddings))
        return max(max_position_embeddings, extended)
    return max_position_embeddings


def compute_inv_freq(rotary_dim: int, params: dict[str, Any], max_position_embeddings: int) -> torch.Tensor:
    """Inverse frequencies `[rotary_dim // 2]` (fp32) for the given RoPE parameters."""
    rope_type = params["rope_type"]
    inv_freq = _default_inv_freq(rotary_dim, float(params["rope_theta"]))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(params["factor"])
    if rope_type == "llama3":
        params = dict(params)
        params.setdefault("original_max_position_embeddings", max_position_embeddings)
        return _llama3_inv_freq(inv_freq, params)
    if rope_type == "yarn":
        return _yarn_inv_freq(rotary_dim, params, max_position_embeddings)
    raise ValueError(
        f"unsupported RoPE scaling type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
    )


def rotary_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 `cos, sin: [num_tokens, 1, rotary_dim / 2]` of angle `position * inv_freq`, times `scaling`."""
    freqs = positions.float()[:, None] * inv_freq[None, :]  # [T, rotary_dim / 2]
    return (freqs.cos() * scaling)[:, None, :], (freqs.sin() * scaling)[:, None, :]


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the NeoX halves of `x: [num_tokens, num_heads, head_size]` by precomputed cos/sin."""
    x1, x2 = x.float().chunk(2, dim=-1)
    rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return rotated.to(x.dtype)


def apply_rotary(
    positions: torch.Tensor, x: torch.Tensor, inv_freq: torch.Tensor, scaling: float = 1.0
) -> torch.Tensor:
    """Rotate `x: [num_tokens, num_heads, head_size]` by angle `position * inv_freq` (NeoX halves),
    with cos/sin multiplied by `scaling`."""
    return rotate(x, *rotary_cos_sin(positions, inv_freq, scaling))


class RotaryEmbedding(nn.Module):
    """Applies RoPE to queries and keys given each token's position."""

    def __init__(self, head_size: int, params: dict[str, Any], max_position_embeddings: int) -> None:
        super().__init__()
        if head_size % 2:
            raise ValueError(f"RoPE needs an even head size, got {head_size}")
        if float(params.get("partial_rotary_factor", 1.0)) != 1.0:
            raise ValueError("partial rotary embeddings are not supported by this model family")
        self.head_size = head_size
        self.rope_type = params["rope_type"]
        self.max_position_embeddings = rope_max_positions(params, max_position_embeddings)
        self.attention_scaling = rope_attention_scaling(params, max_position_embeddings)
        # Kept in fp32 whatever the model dtype: rounding the frequencies would shift long-range angles.
        inv_freq = compute_inv_freq(head_size, params, max_position_embeddings)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        # The CUDA kernel's table, built up front on CUDA: building it lazily inside a CUDA-graph capture
        # would record the computation instead of running it.
        self._cos_sin = self._build_cos_sin() if inv_freq.is_cuda else None
        # Torch path: cos/sin of the last positions tensor seen. Every layer of a step shares this module
        # and the step's positions tensor, so cos/sin are computed once per step instead of per layer.
        # Keyed by identity (the reference keeps the tensor alive, so its id cannot be recycled); the
        # runner builds a fresh positions tensor each step and never writes into one it has passed on.
        self._step_positions: torch.Tensor | None = None
        self._step_cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None

    def _apply(self, fn: Any, recurse: bool = True) -> RotaryEmbedding:
        # `model.to(dtype)` must not cast inv_freq; only device moves apply to it.
        inv_freq = self.inv_freq
        super()._apply(fn, recurse)
        self.inv_freq = inv_freq.to(self.inv_freq.device)
        self._cos_sin = self._build_cos_sin() if self.inv_freq.is_cuda else None
        self._step_positions = self._step_cos_sin = None  # computed on the old device
        return self

    def _build_cos_sin(self) -> torch.Tensor:
        from voltllm import ops

        table = ops.cos_sin_cache(self.inv_freq, self.max_position_embeddings, self.inv_freq.device)
        return table if self.attention_scaling == 1.0 else table * self.attention_scaling

    def cos_sin_table(self) -> torch.Tensor:
        """`[max_position_embeddings, head_size]` fp32 cos|sin table for the CUDA kernel."""
        if self._cos_sin is None or self._cos_sin.device != self.inv_freq.device:
            self._cos_sin = self._build_cos_sin()
        return self._cos_sin

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated `query: [T, heads, head_size]` and `key: [T, kv_heads, head_size]`. On the CUDA path
        they are rotated in place (views into a fused qkv output are fine)."""
        if use_cuda_kernels(query):
            from voltllm import ops

            ops.rotary_embedding(positions, query, key, self.cos_sin_table(), self.head_size, is_neox=True)
            return query, key
        if positions is not self._step_positions or self._step_cos_sin is None:
            self._step_cos_sin = rotary_cos_sin(positions, self.inv_freq, self.attention_scaling)
            self._step_positions = positions
        cos, sin = self._step_cos_sin
        return rotate(query, cos, sin), rotate(key, cos, sin)
