"""The decode GEMV kernel against an fp32 reference, and where `linear` uses it; the GEMV with the
residual add + RMSNorm prologue against the unfused kernels, and the decoder layers that use it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen3Config

from voltllm import ops
from voltllm.layers import linear_method
from voltllm.layers.attention import AttentionMetadata, get_attention_backend
from voltllm.layers.linear import LinearBase, linear
from voltllm.layers.linear_method import UnquantizedLinearMethod
from voltllm.models import decoder
from voltllm.ops.linear import (
    GEMV_MAX_ROWS,
    NORM_GEMV_MAX_HIDDEN,
    add_rms_norm_gemv,
    add_rms_norm_gemv_applies,
    add_rms_norm_gemv_ref,
    gemv,
    gemv_applies,
)

cuda = pytest.mark.gpu


@cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize(("n", "k"), [(4096, 1024), (1024, 3072), (7, 4104), (151, 14336)])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("swiglu", [False, True])
def test_gemv_matches_fp32_reference(dtype, rows, n, k, with_bias, swiglu):
    gen = torch.Generator(device="cuda").manual_seed(rows * 1000 + n + k)
    x = torch.randn(rows, k, device="cuda", generator=gen).to(dtype)
    n_weight = 2 * n if swiglu else n
    weight = (torch.randn(n_weight, k, device="cuda", generator=gen) / k**0.5).to(dtype)
    bias = torch.randn(n_weight, device="cuda", generator=gen).to(dtype) if with_bias else None
    out = torch.full((rows, n), float("nan"), device="cuda", dtype=dtype)  # poisoned: unwritten fails
    gemv(x, weight, bias, out=out, swiglu=swiglu)
    ref = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    if swiglu:  # the unfused path rounds the projection to dtype before the activation
        gate, up = ref.to(dtype).float().chunk(2, dim=-1)
        ref = F.silu(gate) * up
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


@cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2])
def test_float32_out_is_the_widened_result_and_the_lm_head_uses_it(dtype, rows):
    """gemv into a float32 out stores the dtype result widened, bit for bit; ParallelLMHead(fp32_gemv)
    gives the logits the cast path gives; a swiglu GEMV refuses a float32 out."""
    from voltllm.layers.embedding import ParallelLMHead

    gen = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, 1024, device="cuda", generator=gen).to(dtype)
    weight = (torch.randn(4099, 1024, device="cuda", generator=gen) / 32).to(dtype)
    wide = torch.full((rows, 4099), float("nan"), device="cuda")
    gemv(x, weight, out=wide)
    assert torch.equal(wide, gemv(x, weight).float())
    head = ParallelLMHead(4099, 1024).to(device="cuda", dtype=dtype)
    head.weight.data.copy_(weight)
    cast = head(x)
    head.fp32_gemv = True
    direct = torch.full_like(cast, float("nan"))
    assert head(x, out=direct) is direct and torch.equal(direct, cast) and torch.equal(head(x), cast)
    with pytest.raises(RuntimeError, match="swiglu"):
        gemv(
            x,
            torch.randn(2 * 64, 1024, device="cuda", dtype=dtype),
            out=torch.empty(rows, 64, device="cuda"),
            swiglu=True,
        )


@cuda
def test_gemv_reads_strided_rows_and_rejects_bad_input():
    x_wide = torch.randn(2, 2048, device="cuda", dtype=torch.float16)
    x = x_wide[:, :1024]  # rows 2048 elements apart
    weight = torch.randn(64, 1024, device="cuda", dtype=torch.float16)
    torch.testing.assert_close(
        gemv(x, weight).float(), F.linear(x.float(), weight.float()), atol=2e-2, rtol=2e-2
    )
    with pytest.raises(RuntimeError, match="1 or 2 rows"):
        gemv(torch.randn(3, 1024, device="cuda", dtype=torch.float16), weight)
    with pytest.raises(RuntimeError, match="features"):
        gemv(torch.randn(1, 512, device="cuda", dtype=torch.float16), weight)


@cuda
def test_linear_takes_gemv_for_decode_rows_only():
    weight = torch.randn(256, 512, device="cuda", dtype=torch.float16)
    assert gemv_applies(torch.randn(GEMV_MAX_ROWS, 512, device="cuda", dtype=torch.float16), weight)
    assert not gemv_applies(torch.randn(GEMV_MAX_ROWS + 1, 512, device="cuda", dtype=torch.float16), weight)
    assert not gemv_applies(torch.randn(1, 512, device="cuda"), weight.float())  # fp32: torch GEMM
    x = torch.randn(2, 512, device="cuda", dtype=torch.float16)
    torch.testing.assert_close(
        linear(x, weight).float(), F.linear(x.float(), weight.float()), atol=2e-2, rtol=2e-2
    )


def test_linear_on_cpu_is_torch_linear():
    x, weight, bias = torch.randn(2, 16), torch.randn(8, 16), torch.randn(8)
    assert not gemv_applies(x, weight)
    torch.testing.assert_close(linear(x, weight, bias), F.linear(x, weight, bias))
    torch.testing.assert_close(gemv(x, weight, bias), F.linear(x, weight, bias))
    gate, up = F.linear(x, weight, bias).chunk(2, dim=-1)
    torch.testing.assert_close(gemv(x, weight, bias, swiglu=True), F.silu(gate) * up)


def ulps_off(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """|got - want| in units of the last place of `want`'s dtype at its magnitude (at least 1/16)."""
    magnitude = want.float().abs().clamp_min(1 / 16)
    ulp = torch.finfo(want.dtype).eps * torch.exp2(torch.floor(torch.log2(magnitude)))
    return (got.float() - want.float()).abs() / ulp


@cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize(
    ("n", "k"),
    [
        (4096, 1024),  # Qwen3-0.6B qkv (and 2 x 3072 gate/up with swiglu)
        (3072, 1024),
        (6144, 4096),  # Llama-3-8B qkv: more features than resident warps, so warps loop
        (151, 1032),  # k no multiple of a chunk
        (7, NORM_GEMV_MAX_HIDDEN),
    ],
)
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("swiglu", [False, True])
def test_add_rms_norm_gemv_matches_unfused_kernels(dtype, rows, n, k, with_bias, swiglu):
    gen = torch.Generator(device="cuda").manual_seed(rows * 1000 + n + k)
    hidden = torch.randn(rows, k, device="cuda", generator=gen).to(dtype)
    residual = (4 * torch.randn(rows, k, device="cuda", generator=gen)).to(dtype)
    norm_weight = (1 + 0.1 * torch.randn(k, device="cuda", generator=gen)).to(dtype)
    weight = (torch.randn(2 * n if swiglu else n, k, device="cuda", generator=gen) / k**0.5).to(dtype)
    bias = torch.randn(weight.shape[0], device="cuda", generator=gen).to(dtype) if with_bias else None
    assert add_rms_norm_gemv_applies(hidden, residual, norm_weight, weight)
    want_x, want_residual = ops.fused_add_rms_norm(hidden.clone(), residual.clone(), norm_weight, 1e-6)
    want = gemv(want_x, weight, bias, swiglu=swiglu)
    hidden_before, residual_before = hidden.clone(), residual.clone()
    got, got_residual = add_rms_norm_gemv(hidden, residual, norm_weight, 1e-6, weight, bias, swiglu)
    assert torch.equal(got_residual, want_residual)
    assert torch.equal(hidden, hidden_before), "hidden is read-only"
    assert torch.equal(residual, residual_before), "residual is read-only"
    # The same arithmetic in the same order: equal bits, barring a float contraction ptxas made in only
    # one of the two norms.
    assert ulps_off(got, want).max() <= 1, f"{(got != want).sum().item()} of {got.numel()} outputs differ"


@cuda
def test_add_rms_norm_gemv_rejects_overlap_and_checks_applies():
    hidden = torch.randn(1, 1024, device="cuda", dtype=torch.float16)
    residual = torch.randn(1, 1024, device="cuda", dtype=torch.float16)
    norm_weight = torch.ones(1024, device="cuda", dtype=torch.float16)
    weight = torch.randn(64, 1024, device="cuda", dtype=torch.float16)
    out = torch.empty(1, 64, device="cuda", dtype=torch.float16)
    with pytest.raises(RuntimeError, match="must not overlap"):
        ops_call = torch.ops.voltllm_C.add_rms_norm_gemv
        ops_call(out, residual, hidden, residual, norm_weight, 1e-6, weight, None, False)
    assert not add_rms_norm_gemv_applies(hidden.cpu(), residual.cpu(), norm_weight.cpu(), weight.cpu())
    three = torch.randn(GEMV_MAX_ROWS + 1, 1024, device="cuda", dtype=torch.float16)
    assert not add_rms_norm_gemv_applies(three, three.clone(), norm_weight, weight)
    wide = NORM_GEMV_MAX_HIDDEN + 8
    assert not add_rms_norm_gemv_applies(
        torch.randn(1, wide, device="cuda", dtype=torch.float16),
        torch.randn(1, wide, device="cuda", dtype=torch.float16),
        torch.ones(wide, device="cuda", dtype=torch.float16),
        torch.randn(8, wide, device="cuda", dtype=torch.float16),
    )


def test_add_rms_norm_gemv_on_cpu_is_the_unfused_sequence():
    gen = torch.Generator().manual_seed(0)
    hidden, residual = torch.randn(2, 16, generator=gen), torch.randn(2, 16, generator=gen)
    norm_weight, weight, bias = torch.randn(16, generator=gen), torch.randn(8, 16), torch.randn(8)
    out, new_residual = add_rms_norm_gemv(hidden, residual, norm_weight, 1e-6, weight, bias, swiglu=True)
    summed = hidden + residual
    normed = summed * torch.rsqrt(summed.pow(2).mean(-1, keepdim=True) + 1e-6) * norm_weight
    gate, up = F.linear(normed, weight, bias).chunk(2, dim=-1)
    torch.testing.assert_close(new_residual, summed)
    torch.testing.assert_close(out, F.silu(gate) * up)
    torch.testing.assert_close(
        out, add_rms_norm_gemv_ref(hidden, residual, norm_weight, 1e-6, weight, bias, swiglu=True)[0]
    )


def tiny_qwen3(device: str, dtype: torch.dtype) -> decoder.DecoderForCausalLM:
    """Two Qwen3 layers with head size 128 (a size the CUDA kernels take) and random weights."""
    config = Qwen3Config(
        vocab_size=256, hidden_size=256, intermediate_size=384, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=128, max_position_embeddings=64, rms_norm_eps=1e-6,
    )  # fmt: skip
    model = decoder.DecoderForCausalLM(config, get_attention_backend("auto", device))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            param.copy_(1 + 0.3 * noise if "norm" in name else 0.1 * noise)
    return model.to(device=device, dtype=dtype).eval()


def decode_steps(model: decoder.DecoderForCausalLM, num_seqs: int, device: str) -> list[torch.Tensor]:
    """Three steps of one token per sequence from an empty cache (sequence i in block i)."""
    shape = model.kv_cache_shape_per_layer(num_seqs, 16)
    dtype = model.model.norm.weight.dtype
    kv_caches = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(model.num_layers)]
    hiddens = []
    for step in range(3):
        metadata = AttentionMetadata(
            query_start_loc=torch.arange(num_seqs + 1, dtype=torch.int32, device=device),
            seq_lens=torch.full((num_seqs,), step + 1, dtype=torch.int32, device=device),
            block_tables=torch.arange(num_seqs, dtype=torch.int32, device=device).view(num_seqs, 1),
            slot_mapping=torch.arange(num_seqs, dtype=torch.int64, device=device) * 16 + step,
            max_query_len=1,
            max_seq_len=step + 1,
            query_lens_cpu=(1,) * num_seqs,
            seq_lens_cpu=(step + 1,) * num_seqs,
        )
        input_ids = torch.arange(num_seqs, device=device) * 7 + step
        positions = torch.full((num_seqs,), step, dtype=torch.int64, device=device)
        with torch.inference_mode():
            hiddens.append(model(input_ids, positions, metadata, kv_caches))
    return hiddens


@pytest.mark.parametrize("num_seqs", [1, 2])
def test_decoder_layers_fold_norms_into_the_projections(num_seqs, monkeypatch):
    # On the CPU the fused op is its torch reference: forcing the fold on checks the layer's plumbing
    # (residual hand-over, attention after a given qkv, SwiGLU output into down_proj) against the
    # unfused modules.
    model = tiny_qwen3("cpu", torch.float32)
    unfused = decode_steps(model, num_seqs, "cpu")
    calls = []

    def always(*args: object) -> bool:
        calls.append(args)
        return True

    monkeypatch.setattr(linear_method, "add_rms_norm_gemv_applies", always)
    folded = decode_steps(model, num_seqs, "cpu")
    # Every norm but the first layer's input norm, in each of the 3 steps.
    assert len(calls) == 3 * (2 * model.num_layers - 1)
    for got, want in zip(folded, unfused, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@cuda
@pytest.mark.parametrize("num_seqs", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_decoder_layers_fold_norms_on_cuda(num_seqs, dtype):
    model = tiny_qwen3("cuda", dtype)
    linears = [m for m in model.modules() if isinstance(m, LinearBase)]
    assert all(m.linear_method.fold_norm for m in linears)
    folded = decode_steps(model, num_seqs, "cuda")
    for m in linears:
        m.linear_method = UnquantizedLinearMethod(fold_norm=False)  # the same weights, norms unfolded
    unfused = decode_steps(model, num_seqs, "cuda")
    for got, want in zip(folded, unfused, strict=True):
        assert ulps_off(got, want).max() <= 1
