"""The decode GEMV kernel against an fp32 reference, and where `linear` uses it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from voltllm.layers.linear import linear
from voltllm.ops.linear import GEMV_MAX_ROWS, gemv, gemv_applies

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
