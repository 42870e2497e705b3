"""Random `QuantizedWeight`s of every kind the quantized kernels run, for the emulated and the CUDA tests.

Each case is drawn fresh from the generator it is given: codes uniform over the code range (fp8: every
e4m3 byte but the two NaNs), scales around 0.01 (fp8: per-group fp32), zero points uniform or None
(symmetric), and for act-order a shuffled `g_idx` with `group_size` columns in every group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from voltllm.layers.quantization.quantized_weight import QuantizedWeight


@dataclass(frozen=True)
class QuantCase:
    kind: str  # "int" or "fp8"
    bits: int
    group_size: int  # -1: one group per row (per-channel)
    zeros: bool = True  # int only: False = symmetric
    act_order: bool = False

    @property
    def name(self) -> str:
        group = "channel" if self.group_size < 0 else f"g{self.group_size}"
        sym = "" if self.kind == "fp8" or self.zeros else "-sym"
        kind = "fp8" if self.kind == "fp8" else f"int{self.bits}"
        return f"{kind}-{group}{sym}{'-actorder' if self.act_order else ''}"


# Every format kind, bit width and group size the kernels take (4-bit AWQ/GPTQ/compressed-tensors,
# 8-bit GPTQ/compressed-tensors, fp8 with block or channel scales), asymmetric and symmetric, act-order.
CASES = [
    *(QuantCase("int", 4, g) for g in (32, 64, 128, -1)),
    QuantCase("int", 4, 128, zeros=False),
    QuantCase("int", 4, 128, act_order=True),
    QuantCase("int", 4, 32, zeros=False, act_order=True),
    *(QuantCase("int", 8, g) for g in (32, 128, -1)),
    QuantCase("int", 8, 64, zeros=False, act_order=True),
    *(QuantCase("fp8", 8, g) for g in (128, -1)),
    QuantCase("fp8", 8, 32),
]


def random_fp8_codes(shape: tuple[int, int], gen: torch.Generator) -> torch.Tensor:
    codes = torch.randint(0, 256, shape, generator=gen, dtype=torch.int32)
    nan = (codes & 0x7F) == 0x7F
    return torch.where(nan, codes - 1, codes).to(torch.uint8)  # 0x7e: 448, the largest finite value


def make_weight(
    case: QuantCase, out_features: int, in_features: int, gen: torch.Generator, device: str = "cpu"
) -> QuantizedWeight:
    group_size = in_features if case.group_size < 0 else case.group_size
    num_groups = in_features // group_size
    if case.kind == "fp8":
        codes = random_fp8_codes((out_features, in_features), gen)
        # Scales as an fp8 checkpoint has them: max |w| / 448, here for weights around 0.05.
        scales = (torch.rand(out_features, num_groups, generator=gen) + 0.5) * (0.05 / 448)
        zeros = None
    else:
        codes = torch.randint(0, 2**case.bits, (out_features, in_features), generator=gen).to(torch.uint8)
        scales = ((torch.rand(out_features, num_groups, generator=gen) + 0.5) * 0.01).to(torch.float16)
        zeros = None
        if case.zeros:
            zeros = torch.randint(0, 2**case.bits, (out_features, num_groups), generator=gen).to(torch.uint8)
    g_idx = None
    if case.act_order:
        groups = torch.arange(in_features) // group_size
        g_idx = groups[torch.randperm(in_features, generator=gen)].to(torch.int32)
    weight = QuantizedWeight(
        codes=codes,
        scales=scales,
        zeros=zeros,
        bits=case.bits,
        group_size=group_size,
        kind=case.kind,
        g_idx=g_idx,
    )
    if device != "cpu":
        weight = QuantizedWeight(
            codes=codes.to(device),
            scales=scales.to(device),
            zeros=None if zeros is None else zeros.to(device),
            bits=case.bits,
            group_size=group_size,
            kind=case.kind,
            g_idx=None if g_idx is None else g_idx.to(device),
        )
    return weight


# fp16's unit roundoff (half an ulp at 1).
FP16_EPS = 2.0**-11


def fp16_dot_error_bound(x: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
    """A first-order bound, per output feature, on |kernel - fp32 reference| for x @ dense.T as the
    quantized kernels compute it: fp16 products summed 8 per fp16 accumulator (eight roundings, each at
    most FP16_EPS of a partial sum, itself at most sum |x_k w_k|), then fp32; plus the reference's own
    rounding of each dequantized weight to fp16. Elementwise, so a draw with a large sum of absolute
    terms gets the margin it needs and a layout bug (a wrong group, nibble or scale: errors of the
    order of the value itself) still fails."""
    return 9 * FP16_EPS * (x.float().abs() @ dense.float().abs().T)


def swiglu_error_bound(proj: torch.Tensor, proj_bound: torch.Tensor) -> torch.Tensor:
    """Bound on |silu(g') * u' - silu(g) * u| for the gated halves [gate | up] of `proj` (fp32, the
    exact projection) when g', u' are each within proj_bound of it and both sides round g, u to fp16
    (which can land an ulp apart) and the kernel rounds its product to fp16. |silu'| <= 1.1."""
    half = proj.shape[-1] // 2
    gate, up = proj[..., :half], proj[..., half:]
    err_gate = proj_bound[..., :half] + 2 * FP16_EPS * gate.abs()
    err_up = proj_bound[..., half:] + 2 * FP16_EPS * up.abs()
    silu = torch.nn.functional.silu(gate)
    value = silu * up
    return 1.1 * err_gate * (up.abs() + err_up) + silu.abs() * err_up + 2 * FP16_EPS * value.abs() + 1e-6


def assert_within(got: torch.Tensor, expected: torch.Tensor, bound: torch.Tensor, msg: str) -> None:
    """Every element of got within its own bound of expected (and no NaN)."""
    err = (got.float() - expected.float()).abs()
    worst = int(torch.argmax(err - bound))
    assert not torch.isnan(got).any(), f"NaN in the output: {msg}"
    got_worst, expected_worst = float(got.flatten()[worst]), float(expected.flatten()[worst])
    assert bool((err <= bound).all()), (
        f"{msg}: element {worst} is {got_worst}, expected {expected_worst}"
        f" within {float(bound.flatten()[worst]):.3g}"
    )
