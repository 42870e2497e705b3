"""Test helper: tiny quantized checkpoints of every format, written from each format's published layout.

`save_quantized_model` takes a tiny random transformers model, quantizes its decoder's linear layers
into a checkpoint folder (safetensors + config.json with `quantization_config`) and sets the model's
weights to the *dequantized* values, so the model is the oracle the loaded checkpoint must reproduce.

The packers here are written from the formats' documentation, independently of voltllm's unpacking:
- AWQ (AutoAWQ GEMM): qweight `[in, out / 8]`, output column `8j + PACK_ORDER[i]` in nibble i of word j.
- GPTQ (AutoGPTQ v1 / GPTQModel v2): qweight `[in / p, out]` sequential along the input, qzeros
  `[groups, out / p]` sequential along the output, stored as zero - 1 in v1; `g_idx [in]`.
- compressed-tensors: the `compressed-tensors` library itself compresses (and, for the oracle,
  decompresses) each weight.
- FP8: e4m3 weights with `weight_scale_inv` blocks or one `weight_scale` per tensor.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tiny_models import PLAIN_COMMON
from transformers import AutoModelForCausalLM, LlamaConfig, PretrainedConfig, Qwen3Config

AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ: nibble i of a word holds column PACK_ORDER[i] of 8
E4M3_MAX = 448.0

# One shape for every format: group sizes up to 128 divide every layer's input (hidden 128, q/o 128,
# intermediate 256) and k/v (64 rows) pack into int32 words.
SHAPE = {**PLAIN_COMMON, "hidden_size": 128, "intermediate_size": 256, "head_dim": 32}
ARCHS = {
    "llama": lambda: LlamaConfig(**SHAPE, tie_word_embeddings=False),
    "qwen3": lambda: Qwen3Config(**SHAPE, tie_word_embeddings=True),
}
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SHARED_INPUT = {
    "q_proj": "qkv",
    "k_proj": "qkv",
    "v_proj": "qkv",
    "gate_proj": "gate_up",
    "up_proj": "gate_up",
}


@dataclass(frozen=True)
class Format:
    """One quantized checkpoint flavour."""

    method: str  # "awq" | "gptq" | "compressed-tensors" | "fp8"
    bits: int = 4
    group_size: int = 32  # -1: per output channel
    symmetric: bool = False
    act_order: bool = False  # GPTQ: a shuffled g_idx
    gptq_version: int = 1
    scales: str = "group"  # FP8: "block" | "tensor" | "channel"; compressed-tensors int: "group" | "channel"
    block: tuple[int, int] = (32, 32)
    skipped: tuple[str, ...] = ()  # modules left in full precision (named in the config)
    extra_config: dict[str, Any] = field(default_factory=dict)  # merged into quantization_config


def build_model(arch: str, seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """The fp32 transformers model of `ARCHS[arch]` (transformers' own initialization, `overrides` of
    its config), eval mode."""
    config = ARCHS[arch]()
    for key, value in overrides.items():
        setattr(config, key, value)
    config.architectures = [type(AutoModelForCausalLM.from_config(config)).__name__]
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def save_quantized_model(
    arch: str, fmt: Format, out_dir: Path, seed: int = 0, **overrides: Any
) -> torch.nn.Module:
    """Write `arch` (config `overrides`) quantized as `fmt` to `out_dir`; returns the transformers model
    holding the dequantized weights (fp32, eval)."""
    model = build_model(arch, seed, **overrides)
    gen = torch.Generator().manual_seed(seed + 1)
    tensors = {name: t.detach().clone().contiguous() for name, t in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        tensors.pop("lm_head.weight")
    g_idx_of_input: dict[tuple[str, str], torch.Tensor] = {}
    for prefix, module in model.named_modules():
        block, _, proj = prefix.rpartition(".")
        if proj not in PROJECTIONS or prefix in fmt.skipped:
            continue
        weight = module.weight.data
        g_idx = None
        if fmt.act_order:
            # q/k/v (and gate/up) see the same input, so GPTQ orders their columns the same way.
            key = (block, SHARED_INPUT.get(proj, proj))
            if key not in g_idx_of_input:
                g_idx_of_input[key] = shuffled_g_idx(weight.shape[1], fmt.group_size, gen)
            g_idx = g_idx_of_input[key]
        del tensors[f"{prefix}.weight"]
        packed, dequantized = QUANTIZERS[fmt.method](weight, fmt, g_idx)
        tensors.update({f"{prefix}.{name}": t.contiguous().clone() for name, t in packed.items()})
        module.weight.data.copy_(dequantized)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out_dir / "model.safetensors")
    write_config(model.config, quantization_config(fmt), out_dir)
    return model


def write_config(config: PretrainedConfig, quant_config: dict[str, Any], out_dir: Path) -> None:
    data = config.to_dict()
    data["quantization_config"] = quant_config
    data["torch_dtype"] = "float16"
    (out_dir / "config.json").write_text(json.dumps(data, indent=2))


def shuffled_g_idx(in_features: int, group_size: int, gen: torch.Generator) -> torch.Tensor:
    """Act-order groups: the input columns in a random order, cut into groups of `group_size`."""
    order = torch.randperm(in_features, generator=gen)
    g_idx = torch.empty(in_features, dtype=torch.int32)
    g_idx[order] = (torch.arange(in_features) // group_size).to(torch.int32)
    return g_idx


# ---------------------------------------------------------------- integer quantization (AWQ, GPTQ)


def quantize_int(
    weight: torch.Tensor,
    bits: int,
    group_of_column: torch.Tensor,
    num_groups: int,
    symmetric: bool,
    min_zero: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest: codes `[out, in]`, fp16 scales and integer zeros `[out, groups]`."""
    maxq = 2**bits - 1
    out_features = weight.shape[0]
    lo = torch.zeros(out_features, num_groups)
    hi = torch.zeros(out_features, num_groups)
    for g in range(num_groups):
        cols = weight[:, group_of_column == g]
        lo[:, g], hi[:, g] = cols.amin(1).clamp(max=0), cols.amax(1).clamp(min=0)
    if symmetric:
        scales = (torch.maximum(-lo, hi) / (2 ** (bits - 1) - 1)).half()
        zeros = torch.full((out_features, num_groups), 2 ** (bits - 1))
    else:
        scales = ((hi - lo) / maxq).half()
        zeros = torch.round(-lo / scales.float()).clamp(min_zero, maxq).long()
    col_scales, col_zeros = scales.float()[:, group_of_column], zeros[:, group_of_column]
    codes = (torch.round(weight / col_scales) + col_zeros).clamp(0, maxq).long()
    return codes, scales, zeros


def dequantize_int(codes, scales, zeros, group_of_column) -> torch.Tensor:
    return (codes - zeros[:, group_of_column]).float() * scales.float()[:, group_of_column]


def to_int32(words: torch.Tensor) -> torch.Tensor:
    """Unsigned 32-bit values (in int64) as the int32 words a checkpoint stores."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack_along(
    values: torch.Tensor, bits: int, dim: int, order: tuple[int, ...] | None = None
) -> torch.Tensor:
    """`32 / bits` values per int32 along `dim`: value `order[i]` (default i) of each run in bits `bits*i`."""
    per_word = 32 // bits
    moved = values.movedim(dim, -1).long() & (2**bits - 1)
    runs = moved.unflatten(-1, (-1, per_word))
    order = order or tuple(range(per_word))
    words = sum(runs[..., order[i]] << (bits * i) for i in range(per_word))
    return to_int32(words).movedim(-1, dim)


def quantize_awq(weight: torch.Tensor, fmt: Format, g_idx: torch.Tensor | None):
    in_features = weight.shape[1]
    groups = torch.arange(in_features) // fmt.group_size
    codes, scales, zeros = quantize_int(weight, 4, groups, in_features // fmt.group_size, symmetric=False)
    packed = {
        "qweight": pack_along(codes.t(), 4, dim=1, order=AWQ_PACK_ORDER),  # [in, out / 8]
        "qzeros": pack_along(zeros.t(), 4, dim=1, order=AWQ_PACK_ORDER),  # [groups, out / 8]
        "scales": scales.t(),  # [groups, out]
    }
    return packed, dequantize_int(codes, scales, zeros, groups)


def quantize_gptq(weight: torch.Tensor, fmt: Format, g_idx: torch.Tensor | None):
    in_features = weight.shape[1]
    group_size = in_features if fmt.group_size == -1 else fmt.group_size
    if g_idx is None:
        g_idx = (torch.arange(in_features) // group_size).to(torch.int32)
    num_groups = in_features // group_size
    # v1 stores zero - 1, so a zero of 0 cannot be written (AutoGPTQ's own limitation): keep zeros >= 1.
    codes, scales, zeros = quantize_int(
        weight, fmt.bits, g_idx.long(), num_groups, fmt.symmetric, min_zero=1 if fmt.gptq_version == 1 else 0
    )
    stored_zeros = zeros - 1 if fmt.gptq_version == 1 else zeros
    packed = {
        "qweight": pack_along(codes.t(), fmt.bits, dim=0),  # [in / p, out]
        "qzeros": pack_along(stored_zeros.t(), fmt.bits, dim=1),  # [groups, out / p]
        "scales": scales.t(),  # [groups, out]
        "g_idx": g_idx,
    }
    return packed, dequantize_int(codes, scales, zeros, g_idx.long())


# ---------------------------------------------------------------- compressed-tensors (the library)


def compressed_tensors_scheme(fmt: Format):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    if is_fp8(fmt):
        weights = QuantizationArgs(
            num_bits=8,
            type="float",
            symmetric=True,
            strategy=fmt.scales,
            block_structure=list(fmt.block) if fmt.scales == "block" else None,
        )
        # FP8_DYNAMIC: activations quantized per token on FP8 GPUs; voltllm serves it as W8A16.
        inputs = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="token", dynamic=True)
        return QuantizationScheme(targets=["Linear"], weights=weights, input_activations=inputs)
    strategy = "group" if fmt.scales == "group" else "channel"
    weights = QuantizationArgs(
        num_bits=fmt.bits,
        type="int",
        symmetric=fmt.symmetric,
        strategy=strategy,
        group_size=fmt.group_size if strategy == "group" else None,
    )
    return QuantizationScheme(targets=["Linear"], weights=weights)


def is_fp8(fmt: Format) -> bool:
    return fmt.method == "compressed-tensors" and fmt.scales in ("block", "tensor", "channel")


def quantize_compressed_tensors(weight: torch.Tensor, fmt: Format, g_idx: torch.Tensor | None):
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization.utils import calculate_qparams

    scheme = compressed_tensors_scheme(fmt)
    args = scheme.weights
    if args.strategy == "group":
        runs = weight.unflatten(1, (-1, args.group_size))
        lo, hi = runs.amin(-1), runs.amax(-1)
    elif args.strategy == "channel":
        lo, hi = weight.amin(1, keepdim=True), weight.amax(1, keepdim=True)
    elif args.strategy == "block":
        bn, bk = args.block_structure
        blocks = weight.unflatten(0, (-1, bn)).unflatten(2, (-1, bk))  # [out / bn, bn, in / bk, bk]
        lo, hi = blocks.amin((1, 3)), blocks.amax((1, 3))
    else:
        lo, hi = weight.amin().reshape(1), weight.amax().reshape(1)
    scale, zero_point = calculate_qparams(lo, hi, args)
    if not is_fp8(fmt):
        scale = scale.half()  # as llm-compressor writes a float16 model's scales
    state = {"weight": weight, "weight_scale": scale, "weight_zero_point": zero_point}
    compressor = BaseCompressor.get_value_from_registry(
        "float-quantized" if is_fp8(fmt) else "pack-quantized"
    )
    packed = compressor.compress(state, scheme)
    # The oracle: the library's own decompression, in fp32 (the stored fp16 scales are exact in fp32).
    dequantized = compressor.decompress({**packed, "weight_scale": packed["weight_scale"].float()}, scheme)
    return packed, dequantized["weight"].float()


# ---------------------------------------------------------------- FP8 (quant_method fp8)


def quantize_fp8(weight: torch.Tensor, fmt: Format, g_idx: torch.Tensor | None):
    if fmt.scales == "block":
        bn, bk = fmt.block
        blocks = weight.unflatten(0, (-1, bn)).unflatten(2, (-1, bk))
        scale = (blocks.abs().amax((1, 3)) / E4M3_MAX).float()  # [out / bn, in / bk]
        full = scale.repeat_interleave(bn, 0).repeat_interleave(bk, 1)
        codes = (weight / full).to(torch.float8_e4m3fn)
        return {"weight": codes, "weight_scale_inv": scale}, codes.float() * full
    scale = (weight.abs().amax() / E4M3_MAX).float()
    codes = (weight / scale).to(torch.float8_e4m3fn)
    return {"weight": codes, "weight_scale": scale}, codes.float() * scale


QUANTIZERS = {
    "awq": quantize_awq,
    "gptq": quantize_gptq,
    "compressed-tensors": quantize_compressed_tensors,
    "fp8": quantize_fp8,
}


def quantization_config(fmt: Format) -> dict[str, Any]:
    """The `quantization_config` each format's tool writes into config.json."""
    skipped = list(fmt.skipped)
    if fmt.method == "awq":
        config = {
            "quant_method": "awq",
            "bits": 4,
            "group_size": fmt.group_size,
            "zero_point": True,
            "version": "gemm",
            "modules_to_not_convert": skipped or None,
        }
    elif fmt.method == "gptq":
        config = {
            "quant_method": "gptq",
            "bits": fmt.bits,
            "group_size": fmt.group_size,
            "desc_act": fmt.act_order,
            "sym": fmt.symmetric,
            "checkpoint_format": "gptq" if fmt.gptq_version == 1 else "gptq_v2",
            "damp_percent": 0.01,
            "true_sequential": True,
        }
        if skipped:
            config["modules_to_not_convert"] = skipped
    elif fmt.method == "compressed-tensors":
        from compressed_tensors.quantization import QuantizationConfig

        config = QuantizationConfig(
            config_groups={"group_0": compressed_tensors_scheme(fmt)},
            format="float-quantized" if is_fp8(fmt) else "pack-quantized",
            ignore=["lm_head", *skipped],
            quantization_status="compressed",
        ).model_dump(mode="json")
    else:
        config = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3"}
        if fmt.scales == "block":
            config["weight_block_size"] = list(fmt.block)
        if skipped:
            config["ignored_layers"] = skipped
    config.update(fmt.extra_config)
    return config
