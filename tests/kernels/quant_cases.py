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
