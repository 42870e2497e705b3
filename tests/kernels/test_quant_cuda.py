"""The quantized kernels on a GPU against `dequantize` then an fp32 product: every kind, bit width, group
size and act-order, the GEMV at 1..8 rows (plain, SwiGLU, and with the add + RMSNorm epilogue), the
WMMA GEMM at every row tile with and without split k, the weight-streaming GEMM at every fragment count,
the SM80 register-dequantizing 4-bit GEMM, the dense path, the row-count dispatch of
`CudaQuantizedMatmul`, CUDA-graph capture, the packed memory size and the errors. Inputs are fresh random
draws every run (the seed is printed)."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
import torch.nn.functional as F
from quant_cases import CASES, QuantCase, make_weight

from voltllm.layers.quantization.quantized_weight import QuantizedWeight, dequantize, quantized_matmul_for
from voltllm.ops import quantized_linear as ql
from voltllm.ops.norm import fused_add_rms_norm_ref

cuda = pytest.mark.gpu
SEED = int.from_bytes(os.urandom(4), "little")


def _generator(*key: object) -> torch.Generator:
    seed = (SEED + hash(key)) % 2**31
    print(f"seed {seed} for {key}")  # shown on failure
    return torch.Generator().manual_seed(seed)


def _reference(weight: QuantizedWeight, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    dense = dequantize(weight, torch.float16).float()
    return F.linear(x.float(), dense, None if bias is None else bias.float())


def _close(out: torch.Tensor, ref: torch.Tensor) -> None:
    # fp16 output rounding plus the GEMV's fp16 products (runs of 8), relative to the output's scale.
    torch.testing.assert_close(out.float(), ref, atol=3e-3 * float(ref.abs().max()) + 1e-3, rtol=0)


def _inputs(case: QuantCase, rows: int, n: int, k: int, key: object):
    gen = _generator(case.name, rows, n, k, key)
    weight = make_weight(case, n, k, gen, device="cuda")
    x = torch.randn(rows, k, generator=gen).to(torch.float16).cuda()
    bias = torch.randn(n, generator=gen).to(torch.float16).cuda()
    return weight, x, bias


@cuda
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
@pytest.mark.parametrize("rows", range(1, 9))
def test_gemv_every_kind_and_row_count(case: QuantCase, rows: int):
    weight, x, bias = _inputs(case, rows, 1000, 1024, "gemv")
    packed = ql.pack(weight)
    _close(ql.quant_gemv(packed, x, bias), _reference(weight, x, bias))
    _close(ql.quant_gemv(packed, x), _reference(weight, x, None))


@cuda
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
@pytest.mark.parametrize("shape", range(1, ql.GEMV_ONE_ROW_SHAPES + 1))
@pytest.mark.parametrize("swiglu", [False, True])
def test_gemv_every_one_row_shape(case: QuantCase, shape: int, swiglu: bool):
    """Each built one-row shape on a k that its steps and k split do not divide (k = 1,152: 36 int4
    chunks, 72 8-bit ones: a short last step, idle split warps) with an n that leaves part of a block
    empty, and on a k of many steps."""
    for n, k in ((2 * 195, 1152), (2 * 36, 8192)):
        weight, x, bias = _inputs(case, 1, n, k, ("shape", shape, swiglu))
        x = x * (1024 / k) ** 0.5  # sums of k products stay as large as at k = 1,024: SwiGLU stays in fp16
        packed = ql.pack(weight)
        ref = _reference(weight, x, bias)
        if swiglu:
            gate, up = ref.to(torch.float16).float().chunk(2, dim=-1)
            ref = F.silu(gate) * up
        _close(ql.quant_gemv(packed, x, bias, swiglu=swiglu, shape=shape), ref)


@cuda
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
@pytest.mark.parametrize("rows", [1, 2, 5, 8])
def test_gemv_swiglu_epilogue(case: QuantCase, rows: int):
    weight, x, bias = _inputs(case, rows, 2 * 384, 512, "swiglu")
    out = ql.quant_gemv(ql.pack(weight), x, bias, swiglu=True)
    gate, up = _reference(weight, x, bias).to(torch.float16).float().chunk(2, dim=-1)
    _close(out, F.silu(gate) * up)


def _add_norm_reference(weight, x, bias, residual, norm_weight, eps):
    """The projection rounded to fp16 as the unfused layer stores it, then `fused_add_rms_norm`."""
    return fused_add_rms_norm_ref(_reference(weight, x, bias).half(), residual, norm_weight, eps)


@cuda
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
@pytest.mark.parametrize("rows,shape", [(1, 0), (1, 1), (1, 2), (2, 0), (3, 0), (8, 0)])
def test_gemv_add_norm_epilogue(case: QuantCase, rows: int, shape: int):
    """The GEMV whose last block adds the projection into the residual and normalizes: every kind, each
    one-row shape (n = 4,104: a partial last block) and more rows, twice in a row (the arrival counter
    is back at zero after each launch)."""
    n, k = 4104, 1024
    weight, x, bias = _inputs(case, rows, n, k, ("add_norm", shape))
    gen = _generator(case.name, rows, shape, "residual")
    residual = torch.randn(rows, n, generator=gen).half().cuda()
    norm_weight = (1 + 0.1 * torch.randn(n, generator=gen)).half().cuda()
    packed = ql.pack(weight)
    ref_normed, ref_residual = _add_norm_reference(weight, x, bias, residual, norm_weight, 1e-5)
    for _ in range(2):
        normed, new_residual = ql.quant_gemv_add_rms_norm(packed, x, residual, norm_weight, 1e-5, bias, shape)
        _close(new_residual, ref_residual.float())
        _close(normed, ref_normed.float())
        assert ql.norm_arrivals(x.device).item() == 0
    exact = fused_add_rms_norm_ref(torch.zeros_like(new_residual), new_residual, norm_weight, 1e-5)[0]
    torch.testing.assert_close(normed.float(), exact.float(), atol=2e-3, rtol=2e-3)


@cuda
def test_add_norm_method_dispatch_and_graph_replay():
    """`CudaQuantizedMatmul.add_rms_norm` runs the fused GEMV at decode rows (captured in a CUDA graph,
    replayed with fresh inputs) and declines above them, where the caller runs the norm apart."""
    n, k = 4096, 2048
    weight, x, bias = _inputs(QuantCase("int", 4, 128), 1, n, k, "add_norm_graph")
    residual = torch.randn(1, n, device="cuda").half()
    norm_weight = (1 + 0.1 * torch.randn(n, device="cuda")).half()
    matmul = ql.CudaQuantizedMatmul(weight)
    assert matmul.add_rms_norm(torch.randn(16, k, device="cuda").half(), residual.expand(16, n).contiguous(),
                               norm_weight, 1e-5) is None  # fmt: skip
    static_x, static_residual = x.clone(), residual.clone()
    matmul.add_rms_norm(static_x, static_residual, norm_weight, 1e-5, bias)  # warm-up
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_normed, static_new = matmul.add_rms_norm(static_x, static_residual, norm_weight, 1e-5, bias)
    for _ in range(3):
        fresh_x, fresh_residual = torch.randn_like(x), torch.randn_like(residual)
        static_x.copy_(fresh_x)
        static_residual.copy_(fresh_residual)
        graph.replay()
        ref_normed, ref_residual = _add_norm_reference(
            weight, fresh_x, bias, fresh_residual, norm_weight, 1e-5
        )
        _close(static_new, ref_residual.float())
        _close(static_normed, ref_normed.float())


@cuda
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
@pytest.mark.parametrize("rows", [9, 16, 64, 100, 2048])
def test_gemm_every_kind_and_tile(case: QuantCase, rows: int):
    weight, x, bias = _inputs(case, rows, 392, 1024, "gemm")  # n: a partial 128-column tile
    packed = ql.pack(weight)
    ref = _reference(weight, x, bias)
    for block_m in (16, 64, 128):
        for splits in (1, 0, 3):  # one split, the size-based choice, an uneven split of 16 k-tiles
            _close(ql.quant_gemm(packed, x, bias, block_m=block_m, splits=splits), ref)
    _close(ql.quant_dense(packed, x, bias), ref)


@cuda
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
@pytest.mark.parametrize("rows", [4, 9, 16, 20, 33, 64, 100, 128])
def test_stream_gemm_every_kind_and_fragment_count(case: QuantCase, rows: int):
    weight, x, bias = _inputs(case, rows, 392, 1024, "stream")  # n: a partial warp and block of features
    packed = ql.pack(weight)
    ref = _reference(weight, x, bias)
    for m_frags in (0, 1, 2, 3, 4):
        for n_frags in (0, 1, 2):
            # one split, the size-based choice, an uneven split of 16 k-chunks, splits of one chunk
            for splits in (1, 0, 3, 16):
                out = ql.quant_gemm_stream(packed, x, bias, m_frags=m_frags, n_frags=n_frags, splits=splits)
                _close(out, ref)
                assert not packed.split_counters.any(), "the last split leaves its tile counter at zero"


@cuda
def test_stream_gemm_refuses_what_it_cannot_run():
    weight, x, _ = _inputs(QuantCase("int", 4, 128), 16, 256, 512, "stream-refusals")
    packed = ql.pack(weight)
    with pytest.raises(ValueError, match=f"at most {ql.STREAM_MAX_ROWS} rows"):
        ql.quant_gemm_stream(packed, torch.randn(ql.STREAM_MAX_ROWS + 1, 512, device="cuda").half())
    with pytest.raises(RuntimeError, match="n_frags 3 is not built"):
        ql.quant_gemm_stream(packed, x, n_frags=3)
    few = dataclasses.replace(packed, split_counters=torch.zeros(1, dtype=torch.int32, device="cuda"))
    with pytest.raises(RuntimeError, match="split_counters holds 1 tile counters"):
        ql.quant_gemm_stream(few, x, m_frags=1, n_frags=1, splits=2)  # 2 blocks of 128 features


@cuda
def test_stream_gemm_takes_a_16_byte_aligned_x():
    """x is staged through 16-byte loads: a view starting 16 (not 32) bytes into its storage works."""
    weight, x, bias = _inputs(QuantCase("int", 4, 128), 16, 256, 512, "stream-align")
    storage = torch.empty(16 * 512 + 8, dtype=torch.float16, device="cuda")
    shifted = storage[8:].view(16, 512)
    shifted.copy_(x)
    assert shifted.data_ptr() % 32 == 16
    _close(ql.quant_gemm_stream(ql.pack(weight), shifted, bias), _reference(weight, x, bias))


sm80 = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 8, reason="mma.sync needs SM80+"
)


@cuda
@sm80
@pytest.mark.parametrize("case", [c for c in CASES if c.kind == "int" and c.bits == 4], ids=lambda c: c.name)
@pytest.mark.parametrize("rows", [4, 9, 16, 20, 33, 64, 100, 128])
def test_mma_gemm_every_4bit_case_and_fragment_count(case: QuantCase, rows: int):
    # n: a partial n-tile, warp and block of features; k: 12 stretches of 128 columns
    weight, x, bias = _inputs(case, rows, 392, 1536, "mma")
    packed = ql.pack(weight)
    ref = _reference(weight, x, bias)
    for m_frags in (0, 1, 2, 3, 4):
        # one split, the size-based choice, an uneven split of 12 stretches, splits of one stretch
        for splits in (1, 0, 5, 12):
            for form in ql.MMA_FORMS:
                if form == "staged" and m_frags not in (0, 2, 4):
                    continue
                out = ql.quant_gemm_mma(packed, x, bias, m_frags=m_frags, splits=splits, form=form)
                _close(out, ref)
                assert not packed.split_counters.any(), "the last split leaves its tile counter at zero"


@cuda
@sm80
def test_mma_gemm_refuses_what_it_cannot_run():
    weight, x, _ = _inputs(QuantCase("int", 8, 128), 16, 256, 512, "mma-refusals")
    with pytest.raises(RuntimeError, match="4-bit weights only"):
        ql.quant_gemm_mma(ql.pack(weight), x)
    weight, x, _ = _inputs(QuantCase("int", 4, 64), 16, 256, 576, "mma-refusals")
    packed = ql.pack(weight)
    assert not ql.mma_gemm_applies(packed, x.device)
    with pytest.raises(RuntimeError, match="not a multiple of 128"):
        ql.quant_gemm_mma(packed, x)
    weight, x, _ = _inputs(QuantCase("int", 4, 128), 16, 256, 512, "mma-refusals")
    with pytest.raises(RuntimeError, match="staged form takes m_frags 2 or 4"):
        ql.quant_gemm_mma(ql.pack(weight), x, m_frags=3, form="staged")
    with pytest.raises(ValueError, match="form 'tiled' is not one of"):
        ql.quant_gemm_mma(ql.pack(weight), x, form="tiled")


@cuda
@sm80
@pytest.mark.parametrize("rows", [16, 64])
def test_mma_gemm_dispatch_and_graph_replay(rows: int, monkeypatch: pytest.MonkeyPatch):
    """With GEMM_KERNEL "mma" the matmul runs it, and a CUDA graph of it replays fresh inputs."""
    monkeypatch.setattr(ql, "GEMM_KERNEL", "mma")
    weight, x, bias = _inputs(QuantCase("int", 4, 128), rows, 4096, 4096, "mma-graph")
    matmul = quantized_matmul_for(weight)
    assert matmul.mma
    static_x = x.clone()
    matmul(static_x, bias)  # warm-up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = matmul(static_x, bias)
    for draw in range(3):
        fresh = torch.randn(x.shape, generator=_generator("mma-graph", rows, draw)).half().cuda()
        static_x.copy_(fresh)
        graph.replay()
        _close(static_out, _reference(weight, fresh, bias))


@cuda
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_dequantize_kernel_is_the_definition(case: QuantCase):
    weight, _, _ = _inputs(case, 1, 256, 2048, "dequantize")
    packed = ql.pack(weight)
    expected = dequantize(weight, torch.float16)
    if packed.column_order is not None:
        expected = expected[:, packed.column_order]
    assert torch.equal(ql.dequantize_packed(packed), expected)


@cuda
@pytest.mark.parametrize("rows", [1, 3, 8, 16, 64, 100, 128, 1024, 2048])
def test_matmul_dispatch_on_llama_shapes(rows: int):
    """`quantized_matmul_for` on CUDA picks the kernels, at Llama-3-8B projection shapes (o, down)."""
    for n, k in [(4096, 4096), (4096, 14336)]:
        weight, x, bias = _inputs(QuantCase("int", 4, 128), rows, n, k, "dispatch")
        matmul = quantized_matmul_for(weight)
        assert isinstance(matmul, ql.CudaQuantizedMatmul)
        _close(matmul(x, bias), _reference(weight, x, bias))


@cuda
def test_swiglu_method_above_gemv_rows():
    weight, x, bias = _inputs(QuantCase("int", 4, 64), 40, 2 * 512, 1024, "swiglu-gemm")
    gate, up = _reference(weight, x, bias).to(torch.float16).float().chunk(2, dim=-1)
    _close(ql.CudaQuantizedMatmul(weight).swiglu(x, bias), F.silu(gate) * up)


@cuda
@pytest.mark.parametrize("rows", [1, 4, 16])
def test_cuda_graph_replays_fresh_inputs(rows: int):
    """Decode batches run in captured CUDA graphs: the kernels (and the split-k workspace) capture and a
    replay with new x gives the new product (no host syncs, no stale buffers)."""
    weight, x, bias = _inputs(QuantCase("int", 4, 128, act_order=True), rows, 2048, 1024, "graph")
    matmul = ql.CudaQuantizedMatmul(weight)
    static_x = x.clone()
    matmul(static_x, bias)  # warm-up (kernel build, allocator)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = matmul(static_x, bias)
    for _ in range(2):
        fresh = torch.randn(x.shape, device="cuda").half()
        static_x.copy_(fresh)
        graph.replay()
        _close(static_out, _reference(weight, fresh, bias))


@cuda
def test_memory_ends_at_the_packed_size():
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    weight, _, _ = _inputs(QuantCase("int", 4, 128), 1, 4096, 4096, "memory")
    matmul = ql.CudaQuantizedMatmul(weight)
    del weight
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - before
    packed_bytes = 4096 * 4096 // 2 + 4096 * 32 * 4
    assert matmul.weight.nbytes == packed_bytes
    assert held <= packed_bytes + 2**20, f"{held} bytes held for a {packed_bytes}-byte packed weight"


@cuda
def test_bad_input_is_refused_with_its_reason():
    weight, x, _ = _inputs(QuantCase("int", 4, 128), 2, 256, 512, "errors")
    matmul = ql.CudaQuantizedMatmul(weight)
    with pytest.raises(TypeError, match="float16 activations"):
        matmul(x.to(torch.bfloat16))
    with pytest.raises(ValueError, match="does not match"):
        matmul(x[:, :256])
    odd = make_weight(QuantCase("int", 4, 32), 64, 96, torch.Generator().manual_seed(0), device="cuda")
    assert not ql.supports(odd) and "multiple of 64" in ql.unsupported_reason(odd)
    assert type(quantized_matmul_for(odd)).__name__ == "TorchQuantizedMatmul"
    small_groups = make_weight(
        QuantCase("int", 4, 16), 64, 128, torch.Generator().manual_seed(0), device="cuda"
    )
    assert "group size 16" in ql.unsupported_reason(small_groups)
    with pytest.raises(ValueError, match="group size 16"):
        ql.pack(small_groups)
    with pytest.raises(RuntimeError, match="1 to 8 rows"):
        ql.quant_gemv(matmul.weight, torch.randn(9, 512, device="cuda").half())
    with pytest.raises(RuntimeError, match=f"shape {ql.GEMV_ONE_ROW_SHAPES + 1} is not built"):
        ql.quant_gemv(matmul.weight, x[:1], shape=ql.GEMV_ONE_ROW_SHAPES + 1)
    with pytest.raises(RuntimeError, match="one row only, got 2 rows"):
        ql.quant_gemv(matmul.weight, x, shape=1)
    with pytest.raises(RuntimeError, match="m_frags 5 is not built"):
        ql.quant_gemm_stream(matmul.weight, x, m_frags=5)
