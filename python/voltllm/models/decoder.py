"""One decoder-only transformer family covering Llama, Mistral, Qwen2, Qwen3 and the mixture-of-experts
Qwen2-MoE, Qwen3-MoE and Mixtral.

The architectures differ only in a few switches (`DecoderVariant`): q/k/v and o_proj biases, per-head
q/k RMSNorm, how the sliding window is assigned to layers, and whether (and how) a layer's MLP is a
sparse mixture-of-experts block (`voltllm.models.moe`). Everything else (GQA, explicit or derived
head_dim, tied embeddings, RoPE theta and scaling, expert counts and sizes) is read from the Hugging
Face config.

Module and parameter names follow Hugging Face checkpoints, except that q/k/v and gate/up are fused
into `qkv_proj` and `gate_up_proj`; `load_weights` maps checkpoint names onto them. The layers come
from `voltllm.layers` (this module calls no kernel): the linear layers shard over the tensor-parallel
group and take their weight method from the `QuantizationConfig`; the attention backend runs the q/k
norm, RoPE and KV-cache write.

Forward contract (what the model runner calls):
    hidden = model(input_ids [T], positions [T], metadata, kv_caches)   -> [T, hidden_size]
    logits = model.compute_logits(hidden[rows])                          -> fp32 [N, vocab_size]
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from voltllm.layers.attention import Attention, AttentionBackend, AttentionMetadata, AttentionSpec
from voltllm.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from voltllm.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ResidualStream,
    RowParallelLinear,
)
from voltllm.layers.norm import RMSNorm
from voltllm.layers.quantization import QuantizationConfig
from voltllm.layers.rotary import RotaryEmbedding, rope_parameters_of
from voltllm.models.checkpoint import FusedShard, load_checkpoint, packed_modules_mapping
from voltllm.models.moe import STACKED_EXPERT_SHARDS, MoeVariant, SparseMoeBlock, SparseMoeSpec, expert_shards


@dataclass(frozen=True)
class DecoderVariant:
    """What distinguishes one architecture of the family from another."""

    # None: follow config.attention_bias; a string: the config field that says (True when absent, as in
    # configs written before the field existed: Qwen2-MoE's qkv_bias).
    qkv_bias: bool | str | None = None
    o_proj_bias: bool | None = None  # None: follow config.attention_bias
    qk_norm: bool = False  # RMSNorm over each head of q and k before RoPE (Qwen3)
    # "all": config.sliding_window applies to every layer (Mistral); "per_layer": config.layer_types, or
    # use_sliding_window + max_window_layers for configs written before layer_types existed (Qwen2/3).
    sliding_window_layers: Literal["all", "per_layer"] = "per_layer"
    moe: MoeVariant | None = None  # None: every MLP dense; else the config's sparse layers are MoE blocks


VARIANTS: dict[str, DecoderVariant] = {
    "LlamaForCausalLM": DecoderVariant(),
    "MistralForCausalLM": DecoderVariant(qkv_bias=False, o_proj_bias=False, sliding_window_layers="all"),
    "Qwen2ForCausalLM": DecoderVariant(qkv_bias=True, o_proj_bias=False),
    "Qwen3ForCausalLM": DecoderVariant(qk_norm=True),
    "Qwen2MoeForCausalLM": DecoderVariant(
        qkv_bias="qkv_bias", o_proj_bias=False, moe=MoeVariant(shared_expert=True)
    ),
    # transformers applies Qwen3-MoE's window (set only with use_sliding_window) to every layer.
    "Qwen3MoeForCausalLM": DecoderVariant(qk_norm=True, sliding_window_layers="all", moe=MoeVariant()),
    "MixtralForCausalLM": DecoderVariant(
        qkv_bias=False,
        o_proj_bias=False,
        sliding_window_layers="all",
        moe=MoeVariant(
            expert_names=("w1", "w3", "w2"),
            block_name="block_sparse_moe",
            renormalize=True,
            expert_size_key="intermediate_size",
        ),
    ),
}


# For configs that omit `architectures` (some converters do): the class transformers would pick.
ARCH_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
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
    """Self-attention: fused qkv projection, paged attention (its backend runs the optional q/k norm,
    RoPE and the KV-cache write), output projection. Heads are sharded over the tensor-parallel ranks."""

    def __init__(
        self,
        hf_config: Any,
        variant: DecoderVariant,
        rotary_emb: RotaryEmbedding,
        sliding_window: int | None,
        attn_backend: AttentionBackend,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__()
        attention_bias = bool(getattr(hf_config, "attention_bias", False))
        qkv_bias = variant.qkv_bias
        if qkv_bias is None:
            qkv_bias = attention_bias
        elif isinstance(qkv_bias, str):
            qkv_bias = bool(getattr(hf_config, qkv_bias, True))
        o_bias = attention_bias if variant.o_proj_bias is None else variant.o_proj_bias
        total_num_heads = hf_config.num_attention_heads
        self.head_size = head_size_of(hf_config)

        self.qkv_proj = QKVParallelLinear(
            hf_config.hidden_size,
            self.head_size,
            total_num_heads,
            num_kv_heads_of(hf_config),
            bias=qkv_bias,
            quant_config=quant_config,
            prefix=f"{prefix}.qkv_proj",
        )
        self.num_heads = self.qkv_proj.num_heads  # this rank's
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(
            total_num_heads * self.head_size,
            hf_config.hidden_size,
            bias=o_bias,
            quant_config=quant_config,
            prefix=f"{prefix}.o_proj",
        )
        if variant.qk_norm:
            self.q_norm = RMSNorm(self.head_size, eps=hf_config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_size, eps=hf_config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.rotary_emb = rotary_emb
        spec = AttentionSpec(
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_size=self.head_size,
            scale=self.head_size**-0.5,
            sliding_window=sliding_window,
        )
        self.attn = Attention(spec, attn_backend, rotary_emb, self.q_norm, self.k_norm)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        return self.o_proj(self.attn(positions, self.qkv_proj(hidden), kv_cache, metadata))


class GatedMLP(nn.Module):
    """`down(silu(gate(x)) * up(x))` with gate and up fused into one projection whose epilogue is the
    SwiGLU; the intermediate features are sharded over the tensor-parallel ranks."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        bias: bool,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
        reduce_results: bool = True,  # False: leave the ranks' partial sums to the caller (a shared expert)
    ) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size,
            [intermediate_size, intermediate_size],
            bias=bias,
            swiglu=True,
            quant_config=quant_config,
            prefix=f"{prefix}.gate_up_proj",
        )
        self.down_proj = RowParallelLinear(
            intermediate_size,
            hidden_size,
            bias=bias,
            reduce_results=reduce_results,
            quant_config=quant_config,
            prefix=f"{prefix}.down_proj",
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj(x))

    def stream_forward(self, stream: ResidualStream, norm: RMSNorm, next_norm: RMSNorm) -> ResidualStream:
        """`self(norm(stream))` into the stream: the add and `norm` folded into gate/up, or the add and
        `next_norm` into down, where the methods can."""
        gated, residual = self.gate_up_proj.stream_forward(stream, norm)
        return self.down_proj.add_to_stream(gated, residual, next_norm)

    def leading_weights(self) -> tuple[torch.Tensor, ...]:
        """The weights a forward reads, in order, before any read that depends on its input: all of
        them (gate/up, then down)."""
        return (*self.gate_up_proj.streamed_weights(), *self.down_proj.streamed_weights())


def build_mlp(
    hf_config: Any,
    moe: SparseMoeSpec | None,
    quant_config: QuantizationConfig | None,
    prefix: str,
) -> GatedMLP | SparseMoeBlock:
    """The layer's MLP: a sparse block when `moe` is given (the layer is one of the config's sparse
    layers), else the dense gated MLP of `intermediate_size`."""
    hidden_size = hf_config.hidden_size
    if moe is None:
        bias = bool(getattr(hf_config, "mlp_bias", False))
        return GatedMLP(hidden_size, hf_config.intermediate_size, bias, quant_config, prefix)
    shared = None
    if moe.shared_expert_intermediate_size:
        shared = GatedMLP(
            hidden_size,
            moe.shared_expert_intermediate_size,
            False,
            quant_config,
            f"{prefix}.shared_expert",
            reduce_results=False,
        )
    return SparseMoeBlock(moe, hidden_size, shared, quant_config, prefix)


class DecoderLayer(nn.Module):
    """Pre-norm block; the residual stream is carried separately so the norms can fuse the add.

    Each norm's residual add + RMSNorm runs inside a projection at decode batch sizes on a GPU, two
    launches fewer per layer: the projection after it folds them into its GEMV's prologue (fp16: qkv,
    and gate/up with SiLU-and-mul as its epilogue), or the projection before it (o and down; quantized
    GEMVs) runs them after its own, and the stream arrives normed (`ResidualStream`). The MLP is dense
    (`GatedMLP`) or, on a mixture-of-experts model's sparse layers, a `SparseMoeBlock`.
    """

    def __init__(
        self,
        hf_config: Any,
        variant: DecoderVariant,
        rotary_emb: RotaryEmbedding,
        sliding_window: int | None,
        attn_backend: AttentionBackend,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
        moe: SparseMoeSpec | None = None,  # given on a sparse layer
    ) -> None:
        super().__init__()
        eps = hf_config.rms_norm_eps
        self.input_layernorm = RMSNorm(hf_config.hidden_size, eps=eps)
        self.self_attn = DecoderAttention(
            hf_config, variant, rotary_emb, sliding_window, attn_backend, quant_config, f"{prefix}.self_attn"
        )
        self.post_attention_layernorm = RMSNorm(hf_config.hidden_size, eps=eps)
        self.mlp = build_mlp(hf_config, moe, quant_config, f"{prefix}.mlp")

    def forward(
        self,
        positions: torch.Tensor,
        stream: ResidualStream,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        next_norm: RMSNorm,  # the next layer's input norm, or the model's final norm
    ) -> ResidualStream:
        attn = self.self_attn
        qkv, residual = attn.qkv_proj.stream_forward(stream, self.input_layernorm)
        # What the layer reads right after attention: a backend may bring it into the GPU's cache while
        # it attends (AttentionBackend.forward_qkv).
        next_weights = (*attn.o_proj.streamed_weights(), *self.mlp.leading_weights())
        attended = attn.attn(positions, qkv, kv_cache, metadata, next_weights)
        stream = attn.o_proj.add_to_stream(attended, residual, self.post_attention_layernorm)
        return self.mlp.stream_forward(stream, self.post_attention_layernorm, next_norm)


class DecoderModel(nn.Module):
    """Embedding, the decoder layers and the final norm (Hugging Face's `model.*` submodule)."""

    def __init__(
        self,
        hf_config: Any,
        variant: DecoderVariant,
        attn_backend: AttentionBackend,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "model",
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(
            hf_config.vocab_size, hf_config.hidden_size, prefix=f"{prefix}.embed_tokens"
        )
        rotary_emb = RotaryEmbedding(
            head_size_of(hf_config), rope_parameters_of(hf_config), hf_config.max_position_embeddings
        )
        windows = layer_sliding_windows(hf_config, variant)
        moe = SparseMoeSpec.of(hf_config, variant.moe) if variant.moe is not None else None
        self.layers = nn.ModuleList(
            DecoderLayer(
                hf_config,
                variant,
                rotary_emb,
                windows[i],
                attn_backend,
                quant_config,
                f"{prefix}.layers.{i}",
                moe if moe is not None and i in moe.sparse_layer_ids else None,
            )
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
        embedded = self.embed_tokens(input_ids)
        # The first layer's input norm has no sublayer output to add: it runs here, on the embedding.
        stream = ResidualStream(self.layers[0].input_layernorm(embedded), embedded, normed=True)
        next_norms = [layer.input_layernorm for layer in self.layers[1:]] + [self.norm]
        for layer, kv_cache, next_norm in zip(self.layers, kv_caches, next_norms, strict=True):
            stream = layer(positions, stream, kv_cache, metadata, next_norm)
        if stream.normed:  # the last projection ran the final norm
            return stream.hidden
        hidden, _ = self.norm(stream.hidden, stream.residual)
        return hidden


# Checkpoint names that land in a fused parameter.
FUSED_SHARDS = (
    FusedShard(".q_proj.", ".qkv_proj.", "q"),
    FusedShard(".k_proj.", ".qkv_proj.", "k"),
    FusedShard(".v_proj.", ".qkv_proj.", "v"),
    FusedShard(".gate_proj.", ".gate_up_proj.", 0),
    FusedShard(".up_proj.", ".gate_up_proj.", 1),
)
# Buffers some older checkpoints saved that the model recomputes.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class DecoderForCausalLM(nn.Module):
    """Llama / Mistral / Qwen2 / Qwen3 / Qwen2-MoE / Qwen3-MoE / Mixtral causal LM over a paged KV cache.

    Built for the tensor-parallel group current at construction (`voltllm.distributed`): each rank holds
    its heads, its intermediate features and its vocab rows, and `kv_cache_shape_per_layer` is its
    share of the cache. `quant_config` picks each linear layer's weight method (None: unquantized).
    """

    def __init__(
        self,
        hf_config: Any,
        attn_backend: AttentionBackend,
        variant: DecoderVariant | None = None,
        quant_config: QuantizationConfig | None = None,
    ) -> None:
        super().__init__()
        act = getattr(hf_config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"decoder family supports hidden_act 'silu' only, got {act!r}")
        self.config = hf_config
        self.variant = variant if variant is not None else variant_for(hf_config)
        self.quant_config = quant_config
        if quant_config is not None:  # so that it can match its per-module settings against fused layers
            quant_config.packed_modules_mapping = packed_modules_mapping(FUSED_SHARDS)
        self.model = DecoderModel(hf_config, self.variant, attn_backend, quant_config)
        self.attn_backend = attn_backend
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        self.lm_head = ParallelLMHead(
            hf_config.vocab_size,
            hf_config.hidden_size,
            tied_to=self.model.embed_tokens if self.tie_word_embeddings else None,
            prefix="lm_head",
        )
        attn = self.model.layers[0].self_attn
        self.num_layers: int = hf_config.num_hidden_layers
        self.num_kv_heads: int = attn.num_kv_heads  # this rank's
        self.head_size: int = attn.head_size
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

        Raises ValueError on unknown names, shape mismatches and tensors the checkpoint lacks.
        """
        # Some tied checkpoints still store the (identical) head.
        skipped = frozenset({"lm_head.weight"}) if self.tie_word_embeddings else frozenset()
        moe = self.variant.moe
        if moe is None:
            load_checkpoint(self, weights, FUSED_SHARDS, _IGNORED_SUFFIXES, skipped)
            return
        if moe.block_name != "mlp":  # classic Mixtral checkpoints; transformers >= 5 names it mlp too
            old, new = f".{moe.block_name}.", ".mlp."
            weights = ((name.replace(old, new), tensor) for name, tensor in weights)
        fused = STACKED_EXPERT_SHARDS + FUSED_SHARDS
        load_checkpoint(self, weights, fused, _IGNORED_SUFFIXES, skipped, expert_shards(moe))
