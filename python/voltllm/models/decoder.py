"""One decoder-only transformer family covering Llama, Mistral, Qwen2 and Qwen3.

The four architectures differ only in a few switches (`DecoderVariant`): q/k/v and o_proj biases,
per-head q/k RMSNorm, and how the sliding window is assigned to layers. Everything else (GQA, explicit
or derived head_dim, tied embeddings, RoPE theta and scaling) is read from the Hugging Face config.

Module and parameter names follow Hugging Face checkpoints, except that q/k/v and gate/up are fused
into `qkv_proj` and `gate_up_proj`; `load_weights` maps checkpoint names onto them.

Forward contract (what the model runner calls):
    hidden = model(input_ids [T], positions [T], metadata, kv_caches)   -> [T, hidden_size]
    logits = model.compute_logits(hidden[rows])                          -> fp32 [N, vocab_size]
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from voltllm import ops
from voltllm.layers.activation import SiluAndMul
from voltllm.layers.attention import Attention, AttentionBackend, AttentionMetadata, AttentionSpec
from voltllm.layers.embedding import LMHead, VocabEmbedding
from voltllm.layers.linear import Linear, MergedLinear, add_rms_norm_linear, add_rms_norm_linear_applies
from voltllm.layers.norm import RMSNorm
from voltllm.layers.rotary import RotaryEmbedding, rope_parameters_of
from voltllm.ops.linear import gemv, gemv_applies
from voltllm.ops.variants import HEAD_SIZES as KERNEL_HEAD_SIZES


@dataclass(frozen=True)
class DecoderVariant:
    """What distinguishes one architecture of the family from another."""

    qkv_bias: bool | None = None  # None: follow config.attention_bias
    o_proj_bias: bool | None = None  # None: follow config.attention_bias
    qk_norm: bool = False  # RMSNorm over each head of q and k before RoPE (Qwen3)
    # "all": config.sliding_window applies to every layer (Mistral); "per_layer": config.layer_types, or
    # use_sliding_window + max_window_layers for configs written before layer_types existed (Qwen2/3).
    sliding_window_layers: Literal["all", "per_layer"] = "per_layer"


VARIANTS: dict[str, DecoderVariant] = {
    "LlamaForCausalLM": DecoderVariant(),
    "MistralForCausalLM": DecoderVariant(qkv_bias=False, o_proj_bias=False, sliding_window_layers="all"),
    "Qwen2ForCausalLM": DecoderVariant(qkv_bias=True, o_proj_bias=False),
    "Qwen3ForCausalLM": DecoderVariant(qk_norm=True),
}


# For configs that omit `architectures` (some converters do): the class transformers would pick.
ARCH_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


def architecture_names(hf_config: Any) -> list[str]:
    """The config's `architectures`, or the causal-LM class of its `model_type` when it has none."""
    names = list(getattr(hf_config, "architectures", None) or [])
    if not names and getattr(hf_config, "model_type", None) in ARCH_BY_MODEL_TYPE:
        names = [ARCH_BY_MODEL_TYPE[hf_config.model_type]]
    return names


def variant_for(hf_config: Any) -> DecoderVariant:
    """The variant named by the config's architecture."""
    for arch in architecture_names(hf_config):
        if arch in VARIANTS:
            return VARIANTS[arch]
    raise ValueError(
        f"config architectures {architecture_names(hf_config)} are not in the decoder family "
        f"({', '.join(VARIANTS)})"
    )


def head_size_of(hf_config: Any) -> int:
    """Explicit `head_dim` when the config sets one (Qwen3, some Mistrals), else hidden / heads."""
    return getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads


def num_kv_heads_of(hf_config: Any) -> int:
    return getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads


def layer_sliding_windows(hf_config: Any, variant: DecoderVariant) -> list[int | None]:
    """Per layer: the sliding window size, or None for full attention."""
    num_layers = hf_config.num_hidden_layers
    window = getattr(hf_config, "sliding_window", None)
    if window is None:
        return [None] * num_layers
    if variant.sliding_window_layers == "all":
        return [window] * num_layers
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types is not None:
        return [window if t == "sliding_attention" else None for t in layer_types]
    if not getattr(hf_config, "use_sliding_window", False):
        return [None] * num_layers
    first_sliding = getattr(hf_config, "max_window_layers", 0)
    return [window if i >= first_sliding else None for i in range(num_layers)]


class DecoderAttention(nn.Module):
    """Self-attention: fused qkv projection, optional q/k norm, RoPE, paged attention, output projection."""

    def __init__(
        self,
        hf_config: Any,
        variant: DecoderVariant,
        rotary_emb: RotaryEmbedding,
        sliding_window: int | None,
        attn_backend: AttentionBackend,
    ) -> None:
        super().__init__()
        attention_bias = bool(getattr(hf_config, "attention_bias", False))
        qkv_bias = attention_bias if variant.qkv_bias is None else variant.qkv_bias
        o_bias = attention_bias if variant.o_proj_bias is None else variant.o_proj_bias
        self.num_heads = hf_config.num_attention_heads
        self.num_kv_heads = num_kv_heads_of(hf_config)
        self.head_size = head_size_of(hf_config)
        self.q_size = self.num_heads * self.head_size
        self.kv_size = self.num_kv_heads * self.head_size

        self.qkv_proj = MergedLinear(
            hf_config.hidden_size, [self.q_size, self.kv_size, self.kv_size], bias=qkv_bias
        )
        self.o_proj = Linear(self.q_size, hf_config.hidden_size, bias=o_bias)
        if variant.qk_norm:
            self.q_norm = RMSNorm(self.head_size, eps=hf_config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_size, eps=hf_config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.rotary_emb = rotary_emb
        # Read once: the check runs in every layer of every step.
        self.fused_prologue_enabled = (
            self.head_size in KERNEL_HEAD_SIZES and os.environ.get("VOLTLLM_FUSED_PROLOGUE", "1") != "0"
        )
        spec = AttentionSpec(
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_size=self.head_size,
            scale=self.head_size**-0.5,
            sliding_window=sliding_window,
        )
        self.attn = Attention(spec, attn_backend)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        return self.attend(positions, self.qkv_proj(hidden), kv_cache, metadata)

    def attend(
        self,
        positions: torch.Tensor,
        qkv: torch.Tensor,  # [T, q_size + 2 * kv_size]: the qkv projection of the normed hidden rows
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """Everything after the qkv projection (which a decoder layer may fuse with its input norm)."""
        num_tokens = qkv.shape[0]
        fused = self._fused_prologue(qkv, kv_cache)
        if fused:
            # q/k norm, rotary and the KV-cache write in one kernel, in place on qkv.
            norm = self.q_norm is not None
            ops.qk_norm_rope_kv_write(
                qkv,
                positions,
                self.rotary_emb.cos_sin_table(),
                self.q_norm.weight if norm else None,
                self.k_norm.weight if norm else None,
                self.q_norm.eps if norm else 0.0,
                self.num_heads,
                kv_cache,
                metadata.slot_mapping,
            )
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_size)
        k = k.view(num_tokens, self.num_kv_heads, self.head_size)
        v = v.view(num_tokens, self.num_kv_heads, self.head_size)
        if not fused:
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v, kv_cache, metadata, kv_written=fused))

    def _fused_prologue(self, qkv: torch.Tensor, kv_cache: torch.Tensor) -> bool:
        """The fused prologue kernel applies: CUDA fp16/bf16, a head size it is built for, the cache in
        the same dtype, and not switched off with VOLTLLM_FUSED_PROLOGUE=0."""
        return (
            self.fused_prologue_enabled
            and qkv.is_cuda
            and qkv.dtype in (torch.float16, torch.bfloat16)
            and kv_cache.dtype == qkv.dtype
        )


class GatedMLP(nn.Module):
    """`down(silu(gate(x)) * up(x))` with gate and up fused into one projection."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool) -> None:
        super().__init__()
        self.gate_up_proj = MergedLinear(hidden_size, [intermediate_size, intermediate_size], bias=bias)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj
        if gemv_applies(x, gate_up.weight):
            # Decode rows on a GPU: SiLU-and-mul runs in the gate/up GEMV's epilogue.
            return self.down_proj(gemv(x, gate_up.weight, gate_up.bias, swiglu=True))
        return self.down_proj(self.act_fn(gate_up(x)))


class DecoderLayer(nn.Module):
    """Pre-norm block; the residual stream is carried separately so the norms can fuse the add.

    At decode batch sizes on a GPU each norm's residual add + RMSNorm also runs as the prologue of the
    projection after it (qkv, and gate/up with SiLU-and-mul as its epilogue): two launches fewer per
    layer. VOLTLLM_NORM_GEMV=0 turns that off (for A/B timing), read once when the model is built.
    """

    def __init__(
        self,
        hf_config: Any,
        variant: DecoderVariant,
        rotary_emb: RotaryEmbedding,
        sliding_window: int | None,
        attn_backend: AttentionBackend,
    ) -> None:
        super().__init__()
        eps = hf_config.rms_norm_eps
        self.input_layernorm = RMSNorm(hf_config.hidden_size, eps=eps)
        self.self_attn = DecoderAttention(hf_config, variant, rotary_emb, sliding_window, attn_backend)
        self.post_attention_layernorm = RMSNorm(hf_config.hidden_size, eps=eps)
        self.mlp = GatedMLP(
            hf_config.hidden_size, hf_config.intermediate_size, bool(getattr(hf_config, "mlp_bias", False))
        )
        # Read once: the check runs in every layer of every step.
        self.norm_gemv_enabled = os.environ.get("VOLTLLM_NORM_GEMV", "1") != "0"

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        attn, mlp = self.self_attn, self.mlp
        if residual is None:  # the first layer: no residual stream to add yet
            residual = hidden
            qkv = attn.qkv_proj(self.input_layernorm(hidden))
        elif self._norm_gemv(hidden, residual, self.input_layernorm, attn.qkv_proj):
            qkv, residual = add_rms_norm_linear(hidden, residual, self.input_layernorm, attn.qkv_proj)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
            qkv = attn.qkv_proj(hidden)
        hidden = attn.attend(positions, qkv, kv_cache, metadata)
        if self._norm_gemv(hidden, residual, self.post_attention_layernorm, mlp.gate_up_proj):
            gated, residual = add_rms_norm_linear(
                hidden, residual, self.post_attention_layernorm, mlp.gate_up_proj, swiglu=True
            )
            return mlp.down_proj(gated), residual
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return mlp(hidden), residual

    def _norm_gemv(self, hidden: torch.Tensor, residual: torch.Tensor, norm: RMSNorm, proj: Linear) -> bool:
        """The add + norm runs inside `proj`'s GEMV: decode rows on a GPU, not switched off."""
        return self.norm_gemv_enabled and add_rms_norm_linear_applies(hidden, residual, norm, proj)


class DecoderModel(nn.Module):
    """Embedding, the decoder layers and the final norm (Hugging Face's `model.*` submodule)."""

    def __init__(self, hf_config: Any, variant: DecoderVariant, attn_backend: AttentionBackend) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(hf_config.vocab_size, hf_config.hidden_size)
        rotary_emb = RotaryEmbedding(
            head_size_of(hf_config), rope_parameters_of(hf_config), hf_config.max_position_embeddings
        )
        windows = layer_sliding_windows(hf_config, variant)
        self.layers = nn.ModuleList(
            DecoderLayer(hf_config, variant, rotary_emb, windows[i], attn_backend)
            for i in range(hf_config.num_hidden_layers)
        )
        self.norm = RMSNorm(hf_config.hidden_size, eps=hf_config.rms_norm_eps)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: AttentionMetadata,
        kv_caches: list[torch.Tensor],
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden, residual = layer(positions, hidden, residual, kv_cache, metadata)
        hidden, _ = self.norm(hidden, residual)
        return hidden


# Checkpoint names that land in a fused parameter: (checkpoint fragment, fused fragment, shard index).
_FUSED_SHARDS = (
    (".q_proj.", ".qkv_proj.", 0),
    (".k_proj.", ".qkv_proj.", 1),
    (".v_proj.", ".qkv_proj.", 2),
    (".gate_proj.", ".gate_up_proj.", 0),
    (".up_proj.", ".gate_up_proj.", 1),
)
# Buffers some older checkpoints saved that the model recomputes.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class DecoderForCausalLM(nn.Module):
    """Llama / Mistral / Qwen2 / Qwen3 causal LM over a paged KV cache."""

    def __init__(
        self, hf_config: Any, attn_backend: AttentionBackend, variant: DecoderVariant | None = None
    ) -> None:
        super().__init__()
        act = getattr(hf_config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"decoder family supports hidden_act 'silu' only, got {act!r}")
        self.config = hf_config
        self.variant = variant if variant is not None else variant_for(hf_config)
        self.model = DecoderModel(hf_config, self.variant, attn_backend)
        self.attn_backend = attn_backend
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        self.lm_head = LMHead(
            hf_config.vocab_size,
            hf_config.hidden_size,
            tied_to=self.model.embed_tokens if self.tie_word_embeddings else None,
        )
        self.num_layers: int = hf_config.num_hidden_layers
        self.num_kv_heads: int = num_kv_heads_of(hf_config)
        self.head_size: int = head_size_of(hf_config)
        self.vocab_size: int = hf_config.vocab_size

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        metadata: AttentionMetadata,
        kv_caches: list[torch.Tensor],  # num_layers x [2, num_blocks, block_size, kv_heads, head_size]
    ) -> torch.Tensor:  # [T, hidden_size]
        if len(kv_caches) != self.num_layers:
            raise ValueError(f"expected {self.num_layers} KV caches, got {len(kv_caches)}")
        return self.model(input_ids, positions, metadata, kv_caches)

    def compute_logits(self, hidden_rows: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """fp32 logits `[N, vocab_size]` for the selected hidden rows (usually each sequence's last),
        written into `out` when given (a CUDA graph's fixed output buffer)."""
        return self.lm_head(hidden_rows, out=out)

    def kv_cache_shape_per_layer(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """Shape of one layer's paged cache: `[2, num_blocks, block_size, num_kv_heads, head_size]`."""
        return (2, num_blocks, block_size, self.num_kv_heads, self.head_size)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named checkpoint tensors into the model; every parameter must be covered.

        Raises ValueError on unknown names, shape mismatches and parameters the checkpoint lacks.
        """
        modules = dict(self.named_modules())
        params = dict(self.named_parameters())  # tied lm_head.weight is deduplicated away here
        loaded: set[str] = set()
        for name, tensor in weights:
            if name.endswith(_IGNORED_SUFFIXES):
                continue
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue  # some tied checkpoints still store the (identical) head
            target, shard = name, None
            for fragment, fused, shard_id in _FUSED_SHARDS:
                if fragment in name:
                    target, shard = name.replace(fragment, fused), shard_id
                    break
            if target not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no place in {type(self).__name__}")
            module_name, _, param_name = target.rpartition(".")
            module = modules[module_name]
            if shard is None:
                if isinstance(module, Linear):
                    module.load_weight(param_name, tensor)
                else:
                    _copy_param(params[target], tensor, name)
                loaded.add(target)
            else:
                module.load_shard(param_name, shard, tensor)
                loaded.add(f"{target}#{shard}")
        self._check_all_loaded(params, modules, loaded)

    def _check_all_loaded(
        self, params: dict[str, nn.Parameter], modules: dict[str, nn.Module], loaded: set[str]
    ) -> None:
        missing = []
        for name in params:
            module_name, _, _ = name.rpartition(".")
            module = modules[module_name]
            if isinstance(module, MergedLinear):
                missing += [
                    f"{name}#{i}" for i in range(len(module.output_sizes)) if f"{name}#{i}" not in loaded
                ]
            elif name not in loaded:
                missing.append(name)
        if missing:
            shown = ", ".join(missing[:8]) + (f" (+{len(missing) - 8} more)" if len(missing) > 8 else "")
            raise ValueError(f"checkpoint is missing {len(missing)} tensors: {shown}")


def _copy_param(param: nn.Parameter, tensor: torch.Tensor, name: str) -> None:
    if param.shape != tensor.shape:
        raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != expected {tuple(param.shape)}")
    with torch.no_grad():
        param.copy_(tensor)
