"""Weight-only quantized linear layers on CUDA: the packed layout, the GEMV, the WMMA GEMMs and the
choice between them (the kernels are in `csrc/quantization/`).

`CudaQuantizedMatmul(weight)` packs a `QuantizedWeight` once into the layout the kernels read
(`quant_common.cuh` describes it: 16-byte chunks of 32 4-bit or 16 8-bit codes per row, one 32-bit
parameter word per group) and keeps only that: its memory is the packed size (codes at `bits` per weight
plus 4 bytes per group). Act-order weights (`g_idx`) are packed with their columns sorted by group, so
that every group is a contiguous run, and `x`'s columns are gathered into the same order at run time.

A call with `rows` rows of x runs
- `rows <= GEMV_DISPATCH_MAX_ROWS`: the GEMV (dequantize in registers, one pass over the packed weight);
- `rows < DENSE_MIN_ROWS`: the weight-streaming WMMA GEMM (each warp streams its features' packed rows
  through registers and dequantizes them into its own shared-memory tile, x staged per block in windows,
  fp32 accumulation, k split over blocks whose last one sums the splits; session 11's
  register-dequantizing WMMA variant, which needed a second copy of the weight, was measured and
  removed: docs/quantization.md); on SM80+ GPUs and 4-bit weights (`GEMM_KERNEL = "mma"`) the
  register-dequantizing mma.sync GEMM instead, which reads the same packed rows;
- larger: the whole weight dequantized to fp16 into a transient buffer, then torch's GEMM: at prefill
  sizes the GEMM is compute bound, so one extra pass over the weight costs little
  (`benches/quantization.py` measures all three).

The products equal `F.linear(x, dequantize(weight, float16), bias)` up to the order of the fp32 sums
(and the GEMV's fp16 products, see `quant_gemv.cuh`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from voltllm.ops._dispatch import kernel_ops as _kernel_ops
from voltllm.ops.activation import silu_and_mul
from voltllm.ops.build import load
from voltllm.ops.linear import norm_weight_ok

if TYPE_CHECKING:  # the seam's type only: ops sit below layers and take the weight as it comes
    from voltllm.layers.quantization.quantized_weight import QuantizedWeight

# QuantKind in quant_common.cuh (and variants.QUANT_KINDS).
KIND_INT4, KIND_INT8, KIND_FP8 = 0, 1, 2
# Most rows the GEMV kernels take (built for 1, 2, 4 and 8 rows).
GEMV_MAX_ROWS = 8
# One-row GEMV shapes built (quant_gemv.cuh QuantGemvOneRowShape): `quant_gemv(..., shape=1..this)`
# forces one, 0 lets the glue choose by the weight's size.
GEMV_ONE_ROW_SHAPES = 2
# Most rows `CudaQuantizedMatmul` sends to the GEMV. H200, AWQ int4 (benches/quantization.py table 2):
# at 4 rows the WMMA GEMM wins on Llama-3-8B's gate_up (56 vs 77 us) and nearly ties on o (18 vs 18);
# at 2 rows the GEMV wins on both (8 vs 18, 41 vs 55).
GEMV_DISPATCH_MAX_ROWS = 3
# Most rows the weight-streaming GEMM (`quant_gemm_stream`) takes: its per-weight split counters are
# sized for this many (64 rows per block at most, so two row blocks).
STREAM_MAX_ROWS = 128
# Output features per block of the streaming GEMM at one weight fragment per warp (8 warps x 16): the
# unit its split counters are counted in.
STREAM_BLOCK_FEATURES = 128
# From this many rows the weight is dequantized and multiplied by torch (cuBLAS): compute bound there,
# so one extra pass over the weight costs little. H200, AWQ int4 (benches/RESULTS.md session 10, call 2):
# at 2,048 rows dequantize + cuBLAS reaches 0.80-0.89x of cuBLAS fp16; at 128 rows the streaming GEMM
# takes 384 us over the four Llama-3-8B projections, dequantize + cuBLAS 435.
DENSE_MIN_ROWS = STREAM_MAX_ROWS + 1
# Columns of one k-tile of the GEMM: `in_features` must be a multiple of it.
K_ALIGN = 64
# Columns of one stretch of the register-dequantizing GEMM (`quant_gemm_mma`): its `in_features` must be
# a multiple of it.
MMA_K_ALIGN = 128
# Which GEMM `CudaQuantizedMatmul` runs between the GEMV and the dense path: "mma" (the
# register-dequantizing mma.sync GEMM where `mma_gemm_applies`, the streaming one elsewhere: Volta,
# 8-bit and fp8 weights) or "stream" (the streaming WMMA GEMM everywhere). H100, AWQ int4, Llama-3-8B
# projections (benches/RESULTS.md session 17, call 5): the four projections take 94.6 / 179.0 / 305.6 us
# at 16 / 64 / 128 rows on "mma" against 108.4 / 212.1 / 389.7 on "stream".
GEMM_KERNEL = "mma"
# The forms of `quant_gemm_mma` (its `form`): the packed weights in a register ring per lane, x through
# registers (the streaming GEMM's double buffer) or by cp.async into a ring of three windows; or
# "staged": weights and x of each stretch by cp.async into a shared-memory ring, warps over row halves
# and feature groups, two blocks an SM.
MMA_FORMS = {"registers": 0, "async_x": 1, "staged": 2}
# The form dispatched. H100 (benches/RESULTS.md session 17, call 5): "async_x" was faster than
# "registers" on every projection at 16-128 rows (geometric mean over cuBLAS fp16 at 64 rows 0.79x
# against 0.70x). "staged" is new and not yet timed.
MMA_FORM = "async_x"


def _kind_of(weight: QuantizedWeight) -> int | None:
    if weight.kind == "fp8":
        return KIND_FP8
    return {4: KIND_INT4, 8: KIND_INT8}.get(weight.bits)


def _chunk(kind: int) -> int:
    """Codes per 16-byte chunk of a packed row."""
    return 32 if kind == KIND_INT4 else 16


def _column_order(weight: QuantizedWeight) -> torch.Tensor | None:
    """The column permutation that makes act-order groups contiguous (None when they already are), or
    raises ValueError when the groups cannot be contiguous runs of `group_size` columns."""
    if weight.g_idx is None:
        return None
    g_idx = weight.g_idx.long()
    in_features = weight.shape[1]
    num_groups = weight.scales.shape[1]
    counts = torch.bincount(g_idx, minlength=num_groups)
    if counts.numel() != num_groups or bool((counts != weight.group_size).any()):
        raise ValueError("g_idx does not assign group_size columns to every group")
    if torch.equal(g_idx, torch.arange(in_features, device=g_idx.device) // weight.group_size):
        return None
    return torch.argsort(g_idx, stable=True)


def unsupported_reason(weight: QuantizedWeight) -> str | None:
    """Why the kernels cannot run `weight`, or None when they can."""
    kind = _kind_of(weight)
    out_features, in_features = weight.shape
    if kind is None:
        return f"{weight.bits}-bit {weight.kind} weights have no kernel"
    if in_features % K_ALIGN:
        return f"in_features {in_features} is not a multiple of {K_ALIGN}"
    num_groups = weight.scales.shape[1]
    if num_groups > 1:
        chunks, rest = divmod(weight.group_size, _chunk(kind))
        if rest or chunks & (chunks - 1) or num_groups * weight.group_size != in_features:
            return f"group size {weight.group_size} is not a power-of-two multiple of {_chunk(kind)}"
    if weight.g_idx is not None:
        try:
            _column_order(weight)
        except ValueError as err:
            return str(err)
    return None


def supports(weight: QuantizedWeight) -> bool:
    """True when the CUDA kernels run `weight` (4-/8-bit int or fp8, `in % 64 == 0`, groups of a
    power-of-two multiple of 32 (4-bit) / 16 (8-bit) columns or one per row, act-order included)."""
    return unsupported_reason(weight) is None


def _pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """`[n, k]` 4-bit codes -> `[n, k / 2]` bytes: in each 32-bit word, code 2j at bits 4j and code
    2j + 1 at bits 16 + 4j (quant_common.cuh), stored little-endian."""
    n, k = codes.shape
    c = codes.view(n, k // 8, 4, 2).to(torch.int64)  # [word, j, (even, odd)]
    shifts = 4 * torch.arange(4, device=codes.device, dtype=torch.int64)
    words = ((c[..., 0] << shifts) | (c[..., 1] << (shifts + 16))).sum(-1)  # disjoint bits: sum == or
    byte_shifts = 8 * torch.arange(4, device=codes.device, dtype=torch.int64)
    return ((words.unsqueeze(-1) >> byte_shifts) & 0xFF).to(torch.uint8).reshape(n, k // 2)


def _group_params(weight: QuantizedWeight, kind: int) -> torch.Tensor:
    """`[n, num_groups]` int32 words: half2 (scale, 1024 + zero) for int kinds, float 256 * scale for fp8."""
    if kind == KIND_FP8:
        return (weight.scales.float() * 256.0).contiguous().view(torch.int32)
    if weight.zeros is None:
        zeros = torch.full_like(weight.scales, float(2 ** (weight.bits - 1)), dtype=torch.float16)
    else:
        zeros = weight.zeros.to(torch.float16)
    biased = (zeros.float() + 1024.0).to(torch.float16)  # exact: 1024 + a code below 256
    scale_bits = weight.scales.to(torch.float16).view(torch.int16).to(torch.int32) & 0xFFFF
    zero_bits = biased.view(torch.int16).to(torch.int32) & 0xFFFF
    return (scale_bits | (zero_bits << 16)).contiguous()


@dataclass
class PackedQuantWeight:
    """A `QuantizedWeight` in the kernels' layout."""

    packed: torch.Tensor  # uint8 [n, k * bits / 8]
    group_params: torch.Tensor  # int32 [n, num_groups]
    column_order: torch.Tensor | None  # int64 [k]: x's columns in the packed order, or None
    kind: int
    group_size: int
    shape: tuple[int, int]  # (out, in)
    # int32 zeros, one per output tile of the streaming GEMM (its last split resets its own): a weight's
    # calls run in stream order, so its counters are never shared by two running kernels.
    split_counters: torch.Tensor

    @property
    def nbytes(self) -> int:
        """Bytes the kernels read per pass: packed codes and group parameters."""
        return self.packed.numel() + self.group_params.numel() * 4


def pack(weight: QuantizedWeight) -> PackedQuantWeight:
    """`weight` in the kernels' layout (raises ValueError when `supports(weight)` is False)."""
    reason = unsupported_reason(weight)
    if reason is not None:
        raise ValueError(f"no quantized kernel for this weight: {reason}")
    kind = _kind_of(weight)
    assert kind is not None
    order = _column_order(weight)
    codes = weight.codes if order is None else weight.codes[:, order]
    packed = _pack_int4(codes) if kind == KIND_INT4 else codes.contiguous()
    return PackedQuantWeight(
        packed=packed,
        group_params=_group_params(weight, kind),
        column_order=order,
        kind=kind,
        group_size=weight.group_size,
        shape=weight.shape,
        split_counters=torch.zeros(_split_tiles(weight.shape[0]), dtype=torch.int32, device=packed.device),
    )


def _split_tiles(out_features: int) -> int:
    """Output tiles of the streaming GEMM at up to STREAM_MAX_ROWS rows: their split counters."""
    return -(-out_features // STREAM_BLOCK_FEATURES) * -(-STREAM_MAX_ROWS // 16)


def kernel_ops() -> torch._ops._OpNamespace:
    """The extension's ops, built and loaded on first use."""
    load()
    return _kernel_ops()


def _gather_columns(x: torch.Tensor, order: torch.Tensor | None) -> torch.Tensor:
    if order is None and x.stride(-1) == 1 and x.stride(0) % 8 == 0 and x.data_ptr() % 16 == 0:
        return x
    return (x if order is None else x.index_select(1, order)).contiguous()


def quant_gemv(
    weight: PackedQuantWeight,
    x: torch.Tensor,
    bias: torch.Tensor | None = None,
    swiglu: bool = False,
    shape: int = 0,
) -> torch.Tensor:
    """`x @ W^T + bias` for 1..GEMV_MAX_ROWS rows (`silu(gate) * up` of its halves with `swiglu`).
    `shape` (one row only): 1..GEMV_ONE_ROW_SHAPES runs that built shape, 0 the one the glue picks."""
    x = _gather_columns(x, weight.column_order)
    width = weight.shape[0] // 2 if swiglu else weight.shape[0]
    out = torch.empty(x.shape[0], width, dtype=torch.float16, device=x.device)
    kernel_ops().quant_gemv(
        out, x, weight.packed, weight.group_params, bias, weight.kind, weight.group_size, swiglu, shape
    )
    return out


# One arrival counter per device for the GEMV's add + RMSNorm epilogue: zero between launches (each
# launch's last block resets it), so every launch on the device's stream can share it.
_ARRIVALS: dict[torch.device, torch.Tensor] = {}


def norm_arrivals(device: torch.device) -> torch.Tensor:
    """The device's arrival counter for `quant_gemv_add_rms_norm`, made on first use. Make it before a
    CUDA graph is captured (`CudaQuantizedMatmul` does so when it is built): a counter made during a
    capture would live in the graph's memory pool."""
    counter = _ARRIVALS.get(device)
    if counter is None:
        counter = _ARRIVALS[device] = torch.zeros(1, dtype=torch.int32, device=device)
    return counter


def quant_gemv_add_rms_norm(
    weight: PackedQuantWeight,
    x: torch.Tensor,  # [rows, in]
    residual: torch.Tensor,  # [rows, out]
    norm_weight: torch.Tensor,  # [out]
    eps: float,
    bias: torch.Tensor | None = None,
    shape: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`rms_norm(residual + (x @ W^T + bias)) * norm_weight` and the new residual, for 1..GEMV_MAX_ROWS
    rows, in the GEMV's one launch: the last of its blocks normalizes the rows (the projection that
    ends a pre-norm block hands the next projection its normalized input). `residual` is left as it
    was. Equals the projection then `fused_add_rms_norm`, but for the order in which the squares are
    summed."""
    x = _gather_columns(x, weight.column_order)
    rows, out_features = x.shape[0], weight.shape[0]
    normed = torch.empty(rows, out_features, dtype=torch.float16, device=x.device)
    new_residual = torch.empty_like(residual)
    kernel_ops().quant_gemv_add_rms_norm(
        normed,
        new_residual,
        x,
        weight.packed,
        weight.group_params,
        bias,
        residual,
        norm_weight,
        eps,
        norm_arrivals(x.device),
        weight.kind,
        weight.group_size,
        shape,
    )
    return normed, new_residual


def quant_gemm(
    weight: PackedQuantWeight,
    x: torch.Tensor,
    bias: torch.Tensor | None = None,
    block_m: int = 0,
    splits: int = 0,
) -> torch.Tensor:
    """`x @ W^T + bias` on the WMMA GEMM; `block_m` (16, 64, 128) and `splits` of k, 0 = chosen by size."""
    x = _gather_columns(x, weight.column_order)
    out = torch.empty(x.shape[0], weight.shape[0], dtype=torch.float16, device=x.device)
    kernel_ops().quant_gemm(
        out, x, weight.packed, weight.group_params, bias, weight.kind, weight.group_size, block_m, splits
    )
    return out


def _split_gemm_operands(
    weight: PackedQuantWeight, x: torch.Tensor, op: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """x (columns in the packed order) and an empty out for the split-k GEMMs (`quant_gemm_stream`,
    `quant_gemm_mma`), whose split counters are sized for at most STREAM_MAX_ROWS rows."""
    if x.shape[0] > STREAM_MAX_ROWS:
        raise ValueError(f"{op} takes at most {STREAM_MAX_ROWS} rows, got {x.shape[0]}")
    x = _gather_columns(x, weight.column_order)
    return x, torch.empty(x.shape[0], weight.shape[0], dtype=torch.float16, device=x.device)


def quant_gemm_stream(
    weight: PackedQuantWeight,
    x: torch.Tensor,
    bias: torch.Tensor | None = None,
    m_frags: int = 0,
    n_frags: int = 0,
    splits: int = 0,
) -> torch.Tensor:
    """`x @ W^T + bias` on the weight-streaming WMMA GEMM for up to STREAM_MAX_ROWS rows; `m_frags` (1-4
    fragments of 16 rows of x per warp), `n_frags` (1-2 fragments of 16 weight rows per warp) and
    `splits` of k, 0 = chosen by size."""
    x, out = _split_gemm_operands(weight, x, "quant_gemm_stream")
    kernel_ops().quant_gemm_stream(
        out, x, weight.packed, weight.group_params, bias, weight.split_counters, weight.kind,
        weight.group_size, m_frags, n_frags, splits,
    )  # fmt: skip
    return out


def mma_gemm_applies(weight: PackedQuantWeight, device: torch.device) -> bool:
    """Whether `quant_gemm_mma` runs this weight on `device`: 4-bit codes, `in_features` a multiple of
    MMA_K_ALIGN, an SM80 or newer GPU (mma.sync m16n8k16)."""
    return (
        weight.kind == KIND_INT4
        and weight.shape[1] % MMA_K_ALIGN == 0
        and device.type == "cuda"
        and torch.cuda.get_device_capability(device)[0] >= 8
    )


def quant_gemm_mma(
    weight: PackedQuantWeight,
    x: torch.Tensor,
    bias: torch.Tensor | None = None,
    m_frags: int = 0,
    splits: int = 0,
    form: str | None = None,
) -> torch.Tensor:
    """`x @ W^T + bias` on the register-dequantizing 4-bit GEMM (SM80+, `mma_gemm_applies`) for up to
    STREAM_MAX_ROWS rows: each lane dequantizes the packed codes it loaded straight into its MMA operand
    (`quant_gemm_mma_sm80.cuh`); `m_frags` (1-4 fragments of 16 rows of x per block) and `splits` of
    k, 0 = chosen by size (the "staged" form takes 2 or 4); `form`: one of MMA_FORMS, None = MMA_FORM."""
    form = MMA_FORM if form is None else form
    if form not in MMA_FORMS:
        raise ValueError(f"quant_gemm_mma form {form!r} is not one of {sorted(MMA_FORMS)}")
    x, out = _split_gemm_operands(weight, x, "quant_gemm_mma")
    kernel_ops().quant_gemm_mma(
        out, x, weight.packed, weight.group_params, bias, weight.split_counters, weight.kind,
        weight.group_size, m_frags, splits, MMA_FORMS[form],
    )  # fmt: skip
    return out


def dequantize_packed(weight: PackedQuantWeight) -> torch.Tensor:
    """The dense fp16 `[out, in]` weight, columns in the packed order (the reference's values)."""
    out = torch.empty(weight.shape, dtype=torch.float16, device=weight.packed.device)
    kernel_ops().quant_dequantize(out, weight.packed, weight.group_params, weight.kind, weight.group_size)
    return out


def quant_dense(weight: PackedQuantWeight, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ W^T + bias` through a transient fp16 copy of the weight and torch's GEMM."""
    x = _gather_columns(x, weight.column_order)
    return torch.nn.functional.linear(x, dequantize_packed(weight), bias)


class CudaQuantizedMatmul:
    """`x @ W^T + bias` for one packed weight, choosing the kernel by the number of rows.

    Holds only the packed form: the caller should drop its `QuantizedWeight` after building this.
    """

    def __init__(self, weight: QuantizedWeight) -> None:
        if not weight.codes.is_cuda:
            raise ValueError("CudaQuantizedMatmul needs a weight on a CUDA device")
        load()  # the kernels, built on first use
        self.weight = pack(weight)
        self.mma = mma_gemm_applies(self.weight, weight.codes.device)
        norm_arrivals(weight.codes.device)  # before any CUDA graph capture

    def _check(self, x: torch.Tensor) -> None:
        if x.dtype != torch.float16:
            raise TypeError(f"the quantized kernels take float16 activations, got {x.dtype}")
        if x.dim() != 2 or x.shape[1] != self.weight.shape[1]:
            raise ValueError(f"x {tuple(x.shape)} does not match a [rows, {self.weight.shape[1]}] input")

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        self._check(x)
        rows = x.shape[0]
        if rows <= GEMV_DISPATCH_MAX_ROWS:
            return quant_gemv(self.weight, x, bias)
        if rows < DENSE_MIN_ROWS:
            if GEMM_KERNEL == "mma" and self.mma:
                return quant_gemm_mma(self.weight, x, bias)
            return quant_gemm_stream(self.weight, x, bias)
        return quant_dense(self.weight, x, bias)

    def swiglu(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """`silu(gate) * up` of a fused gate/up projection `[gate; up]`: `[rows, out / 2]`. Decode rows
        take the GEMV with the activation in its epilogue."""
        self._check(x)
        if x.shape[0] <= GEMV_DISPATCH_MAX_ROWS:
            return quant_gemv(self.weight, x, bias, swiglu=True)
        return silu_and_mul(self(x, bias))

    def add_rms_norm(
        self,
        x: torch.Tensor,
        residual: torch.Tensor,
        norm_weight: torch.Tensor,
        eps: float,
        bias: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`rms_norm(residual + self(x, bias)) * norm_weight` and the new residual, in the GEMV's launch
        (`quant_gemv_add_rms_norm`) for decode rows; None where that kernel does not apply (more rows,
        or operands it does not take), and the caller runs the projection and the norm apart."""
        self._check(x)
        out_features = self.weight.shape[0]
        if not (
            x.shape[0] <= GEMV_DISPATCH_MAX_ROWS
            and out_features % 8 == 0
            and residual.dtype == torch.float16
            and residual.shape == (x.shape[0], out_features)
            and residual.is_contiguous()
            and residual.data_ptr() % 16 == 0  # the epilogue reads and writes 8 halves at a time
            and norm_weight_ok(norm_weight, out_features, torch.float16)
        ):
            return None
        return quant_gemv_add_rms_norm(self.weight, x, residual, norm_weight, eps, bias)
