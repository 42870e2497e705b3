"""voltllm's one in-memory form of a quantized linear weight, which every checkpoint format converts to.

AWQ, GPTQ, compressed-tensors and FP8 checkpoints each pack their weights their own way (nibble orders,
`[in, out/8]` or `[in*bits/32, out]` int32 words, zero points stored as zero - 1, block scales stored
inverted, ...). Their `LinearMethodBase` reads those tensors as the checkpoint spells them and, once
they are loaded, converts them to a `QuantizedWeight`: unpacked codes in the PyTorch `[out, in]`
orientation with per-group scales and zero points. That one form is the seam between the formats and
the kernels:

- `dequantize` is the definition of what a `QuantizedWeight` means, and the CPU reference;
- `quantized_matmul_for` hands it to whatever computes with it: the CUDA kernels repack it once into
  the layout they read fastest (`voltllm.ops.quantized_linear`), elsewhere `TorchQuantizedMatmul`
  dequantizes and multiplies.

The meaning, for output row `n` and input column `k`, with `g = group_of(k)`:

    int formats: W[n, k] = (codes[n, k] - zeros[n, g]) * scales[n, g]
    fp8:         W[n, k] = float(e4m3(codes[n, k])) * scales[n, g]

where `group_of(k)` is `g_idx[k]` when the checkpoint reorders its groups (GPTQ act-order) and
`k // group_size` otherwise, and a missing `zeros` means the symmetric midpoint `2 ** (bits - 1)`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

import torch
import torch.nn.functional as F

from voltllm.layers.activation import swiglu

QuantKind = Literal["int", "fp8"]


@dataclass
class QuantizedWeight:
    """One layer's (one rank's shard of a) quantized weight, unpacked.

    codes:  uint8 `[out, in]`: integer codes in `[0, 2**bits)`, or the raw bytes of e4m3 values (fp8).
    scales: `[out, num_groups]`, float16 for int formats, float32 for fp8 (its scales span a wider range).
    zeros:  uint8 `[out, num_groups]` (the code that means 0.0), or None for symmetric (`2**(bits-1)`);
            always None for fp8.
    g_idx:  int32 `[in]`, the group of each input column, or None when groups are contiguous runs of
            `group_size` columns.
    """

    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    bits: int
    group_size: int  # input columns per group; equals `in` for one scale per output channel
    kind: QuantKind = "int"
    g_idx: torch.Tensor | None = None

    def __post_init__(self) -> None:
        out_features, in_features = self.codes.shape
        codes_shape, scales_shape = tuple(self.codes.shape), tuple(self.scales.shape)
        if self.codes.dtype != torch.uint8:
            raise ValueError(f"QuantizedWeight.codes must be uint8, got {self.codes.dtype}")
        if self.kind == "fp8" and (self.bits != 8 or self.zeros is not None):
            raise ValueError("fp8 weights are 8-bit and have no zero points")
        if self.kind == "int" and self.bits not in (4, 8):
            raise ValueError(f"{self.bits}-bit integer weights are not supported (4 or 8)")
        num_groups = self.scales.shape[1]
        if self.scales.shape[0] != out_features:
            raise ValueError(f"scales {scales_shape} do not match codes {codes_shape}")
        if self.g_idx is None and num_groups != -(-in_features // self.group_size):
            raise ValueError(
                f"{num_groups} scale groups do not cover {in_features} columns in groups of {self.group_size}"
            )
        if self.zeros is not None and self.zeros.shape != self.scales.shape:
            raise ValueError(f"zeros {tuple(self.zeros.shape)} do not match scales {scales_shape}")
        if self.g_idx is not None and self.g_idx.shape != (in_features,):
            raise ValueError(f"g_idx {tuple(self.g_idx.shape)} does not have one entry per input column")

    @property
    def shape(self) -> tuple[int, int]:
        """`(out, in)`, as `nn.Linear.weight.shape`."""
        return tuple(self.codes.shape)  # type: ignore[return-value]

    def group_of_columns(self) -> torch.Tensor:
        """The scale group of every input column: `[in]` int64."""
        if self.g_idx is not None:
            return self.g_idx.long()
        return torch.arange(self.codes.shape[1], device=self.codes.device) // self.group_size


def dequantize(weight: QuantizedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The dense `[out, in]` weight a `QuantizedWeight` stands for (the definition and the reference)."""
    groups = weight.group_of_columns()
    if weight.kind == "fp8":
        values = weight.codes.view(torch.float8_e4m3fn).to(torch.float32)
    else:
        zeros = weight.zeros.float() if weight.zeros is not None else float(2 ** (weight.bits - 1))
        zeros = zeros[:, groups] if isinstance(zeros, torch.Tensor) else zeros
        values = weight.codes.float() - zeros
    return (values * weight.scales.float()[:, groups]).to(dtype)


class QuantizedMatmul(Protocol):
    """`x @ W^T + bias` for one `QuantizedWeight`, in whatever layout its implementation chose."""

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor: ...

    def swiglu(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """`silu(gate) * up` of the output's two halves `[gate | up]` (a fused gate/up projection):
        `[T, out / 2]`, fused into the kernel's epilogue where it has one."""
        ...

    def add_rms_norm(
        self,
        x: torch.Tensor,
        residual: torch.Tensor,
        norm_weight: torch.Tensor,
        eps: float,
        bias: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`rms_norm(residual + self(x, bias)) * norm_weight` and the new residual where the kernel runs
        the add and the norm in its epilogue; None where it does not (the caller runs them apart)."""
        ...


class TorchQuantizedMatmul:
    """The reference: dequantize in the activation's dtype, then a torch GEMM (CPU, and GPUs without a
    kernel for the format). Dequantizes on every call, so memory stays at the packed size."""

    def __init__(self, weight: QuantizedWeight) -> None:
        self.weight = weight

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, dequantize(self.weight, x.dtype), bias)

    def swiglu(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return swiglu(self(x, bias))

    def add_rms_norm(
        self,
        x: torch.Tensor,
        residual: torch.Tensor,
        norm_weight: torch.Tensor,
        eps: float,
        bias: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        return None  # no fused form: the norm runs as the next projection's


def quantized_matmul_for(weight: QuantizedWeight) -> QuantizedMatmul:
    """The fastest implementation for `weight` on its device: the CUDA kernels where they exist for its
    kind, bits and shape, else the torch reference."""
    if weight.codes.is_cuda:
        from voltllm.ops import quantized_linear  # the kernels, built on first CUDA use

        if quantized_linear.supports(weight):
            return quantized_linear.CudaQuantizedMatmul(weight)
    return TorchQuantizedMatmul(weight)
