"""voltllm's unpacking against the tests' packers (written from the formats' layouts), and dummy
quantized weights: random packed tensors of the right shapes, converted layer by layer, bounded and
deterministic."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from checkpoints import AWQ_PACK_ORDER, Format, build_model, pack_along, quantization_config, write_config
from model_shapes import QWEN3_32B
from paged_batch import PagedBatch
from transformers import Qwen3Config

from voltllm.config import ModelConfig
from voltllm.layers.attention import get_attention_backend
from voltllm.layers.quantization import get_quantization_config
from voltllm.layers.quantization.packing import AWQ_REVERSE_ORDER, unpack_int32
from voltllm.layers.quantization.quantized_method import DUMMY_WEIGHT_RANGE, QuantizedLinearMethod
from voltllm.layers.quantization.quantized_weight import dequantize
from voltllm.loader.loader import load_model
from voltllm.models import DecoderForCausalLM

# (bits, packed dim, AutoAWQ order): GPTQ packs along 0 (qweight) and 1 (qzeros), compressed-tensors
# along 1 (weight_packed) and 0 (weight_zero_point), AWQ along 1 in its interleaved order.
PACKINGS = [(4, 0, False), (4, 1, False), (8, 0, False), (8, 1, False), (4, 1, True), (4, 0, True)]


@pytest.mark.parametrize(("bits", "dim", "awq_order"), PACKINGS)
def test_unpacking_inverts_the_published_packing(bits: int, dim: int, awq_order: bool) -> None:
    gen = torch.Generator().manual_seed(bits + dim)
    codes = torch.randint(0, 2**bits, (32, 48), generator=gen)
    packed = pack_along(codes, bits, dim, AWQ_PACK_ORDER if awq_order else None)
    assert packed.dtype == torch.int32 and packed.shape[dim] == codes.shape[dim] * bits // 32
    unpacked = unpack_int32(packed, bits, dim, AWQ_REVERSE_ORDER if awq_order else None)
    assert unpacked.dtype == torch.uint8 and torch.equal(unpacked.long(), codes)


def test_unpacking_refuses_what_it_cannot_read() -> None:
    with pytest.raises(ValueError, match="3-bit codes are not supported"):
        unpack_int32(torch.zeros(4, 4, dtype=torch.int32), 3, 0)
    with pytest.raises(ValueError, match="must be int32"):
        unpack_int32(torch.zeros(4, 4, dtype=torch.int64), 4, 0)


DUMMY_FORMATS = {
    "awq": Format("awq", group_size=64),
    "gptq-8bit-act_order": Format("gptq", bits=8, group_size=32, act_order=True),
    "ct-w4a16-asym": Format("compressed-tensors", bits=4, group_size=32),
    "ct-fp8-channel": Format("compressed-tensors", bits=8, scales="channel"),
    "fp8-block": Format("fp8", bits=8, scales="block", block=(32, 32)),
    "fp8-tensor": Format("fp8", bits=8, scales="tensor"),
}


def load_dummy(model_dir: Path, seed: int = 0):
    config = ModelConfig(model=str(model_dir), load_format="dummy", dtype="float32", seed=seed)
    return load_model(config, "cpu", None, get_attention_backend("torch", "cpu"), progress=False).model


@pytest.mark.parametrize("name", sorted(DUMMY_FORMATS))
def test_dummy_quantized_weights_are_converted_bounded_and_deterministic(name: str, tmp_path: Path) -> None:
    config = build_model("qwen3").config
    write_config(config, quantization_config(DUMMY_FORMATS[name]), tmp_path)
    model, again = load_dummy(tmp_path), load_dummy(tmp_path)
    layers = [
        (m, a) for m, a in zip(model.modules(), again.modules(), strict=True) if hasattr(m, "linear_method")
    ]
    assert len(layers) == 2 * 4
    for layer, twin in layers:
        assert isinstance(layer.linear_method, QuantizedLinearMethod)
        # The checkpoint layout is gone once converted: only the quantized form is held.
        assert not set(layer.linear_method.checkpoint_params) & {n for n, _ in layer.named_parameters()}
        weight = dequantize(layer.quantized_matmul.weight)
        assert weight.shape == (layer.output_size_per_partition, layer.input_size_per_partition)
        assert (
            float(weight.abs().max()) <= DUMMY_WEIGHT_RANGE and float(weight.std()) > DUMMY_WEIGHT_RANGE / 20
        )
        assert torch.equal(weight, dequantize(twin.quantized_matmul.weight))  # same seed, same weights
    kv_caches = [torch.zeros(model.kv_cache_shape_per_layer(4, 8)) for _ in range(model.num_layers)]
    metadata = PagedBatch(1, num_blocks=4, block_size=8).step([6])
    with torch.inference_mode():
        logits = model.compute_logits(model(torch.arange(6), torch.arange(6), metadata, kv_caches))
    assert torch.isfinite(logits).all()


def _weight_bytes_on_meta(shape: dict, quantization_config: dict | None) -> int:
    """Bytes of a model's parameters as built (before any conversion), on the meta device."""
    config = Qwen3Config(**{k: v for k, v in shape.items() if k not in ("architectures", "model_type")})
    config.architectures = shape["architectures"]
    if quantization_config is not None:
        config.quantization_config = quantization_config
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float16)
    try:
        with torch.device("meta"):
            model = DecoderForCausalLM(
                config, get_attention_backend("torch", "cpu"), quant_config=get_quantization_config(config)
            )
    finally:
        torch.set_default_dtype(previous)
    return sum(p.numel() * p.element_size() for p in model.parameters())


def test_a_qwen3_32b_shape_awq_model_is_built_at_its_packed_size() -> None:
    """The checkpoint-layout parameters a Qwen3-32B-shape AWQ model is built with (all it holds before
    the layer-by-layer conversion) fit the issue's 20 GB: no fp16 copy of a quantized weight."""
    awq = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}
    quantized, dense = _weight_bytes_on_meta(QWEN3_32B, awq), _weight_bytes_on_meta(QWEN3_32B, None)
    assert dense > 60e9  # 32.8B parameters in fp16
    assert quantized <= 20e9, f"{quantized / 1e9:.2f} GB"
