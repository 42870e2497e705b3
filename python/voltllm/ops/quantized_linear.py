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
  fp32 accumulation, k split over blocks whose last one sums the splits), or with `gemm="frag"` the
  register-dequantizing GEMM (codes repacked in the device's probed WMMA fragment order, dequantized
  straight into fragment registers: `pack_fragments`, `quant_gemm_frag`; not the default until timed);
- larger: the whole weight dequantized to fp16 into a transient buffer, then torch's GEMM: at prefill
  sizes the GEMM is compute bound, so one extra pass over the weight costs little
  (`benches/quantization.py` measures all three).

The products equal `F.linear(x, dequantize(weight, float16), bias)` up to the order of the fp32 sums
(and the GEMV's fp16 products, see `quant_gemv.cuh`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from voltllm.ops._dispatch import kernel_ops as _kernel_ops
from voltllm.ops.activation import silu_and_mul
from voltllm.ops.build import load

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


# The register-dequantizing GEMM's fragment layouts (quant_gemm_frag.cuh LAYOUT): (REP, RUN) -> number.
# REP: copies of a lane's slots in its fragment (x[i] == x[i + num_elements / 2] when 2); RUN: slots
# sharing one output column, so one group word (2: every pair of slots).
FRAGMENT_LAYOUTS = {(1, 1): 0, (1, 2): 1, (2, 2): 2}
# Columns per k-chunk of the fragment-ordered codes; its groups must be whole chunks.
FRAGMENT_K_CHUNK = 64
# Output features the fragment-ordered tiles are padded to (a warp's two 16-feature tiles at n_frags 2).
FRAGMENT_FEATURE_ALIGN = 32


@dataclass(frozen=True)
class FragmentLayout:
    """Where one device's WMMA `matrix_b` (col-major, 16x16 fp16) fragments put their elements, as the
    repack for `quant_gemm_frag` needs it (built by `fragment_layout_from_probe`)."""

    elements: int  # fragment elements per lane (num_elements)
    layout: int  # FRAGMENT_LAYOUTS[(rep, run)]
    rep: int
    run: int
    tuples: torch.Tensor  # int64 [tuples, slots]: 16 n + k of each tuple's slots, in element order
    lane_tuple: torch.Tensor  # int64 [32]: the tuple of each lane's codes
    lane_cols: torch.Tensor  # int64 [32, 16]: the output column of each lane's group-word slots (0 past)

    @property
    def slots(self) -> int:
        """Distinct elements a lane builds per fragment (D)."""
        return self.elements // self.rep

    def lane_map(self) -> torch.Tensor:
        """int32 [32, 17] on the CPU: each lane's tuple, then its group-word columns (the op's argument)."""
        return torch.cat([self.lane_tuple[:, None], self.lane_cols], dim=1).to(torch.int32)


def fragment_layout_from_probe(probe: torch.Tensor, max_layout: int = 2) -> FragmentLayout:
    """The repack plan for a probed `matrix_b` layout: `probe[lane, i]` = 16 n + k of element i of a
    lane (-1 past num_elements; `quant_wmma_b_layout`). `max_layout` caps the layout number (0 runs the
    layout-free form on any device). Raises ValueError for a probe that does not hold every element."""
    table = probe.detach().to("cpu", torch.int64)
    if table.shape != (32, 16):
        raise ValueError(f"a WMMA layout probe is [32, 16], got {tuple(table.shape)}")
    counts = (table >= 0).sum(dim=1)
    elements = int(counts[0])
    if bool((counts != elements).any()) or elements % 8 or bool((table[:, elements:] >= 0).any()):
        raise ValueError(f"the probe's lanes hold {counts.tolist()} elements (a multiple of 8, all equal)")
    held = table[:, :elements]
    if bool((held > 255).any()) or torch.unique(held).numel() != 256:
        raise ValueError("the probe's fragments do not hold each of the 256 elements")
    half = elements // 2
    rep = 2 if elements % 16 == 0 and torch.equal(held[:, :half], held[:, half:]) else 1
    columns = held[:, : elements // rep] // 16
    run = 2 if torch.equal(columns[:, 0::2], columns[:, 1::2]) else 1
    if (rep, run) not in FRAGMENT_LAYOUTS or FRAGMENT_LAYOUTS[rep, run] > max_layout:
        rep = 1  # the slots held twice are then packed twice: right on any layout
        run = 2 if max_layout >= 1 and torch.equal(held[:, 0::2] // 16, held[:, 1::2] // 16) else 1
    slots = held[:, : elements // rep]
    index: dict[tuple[int, ...], int] = {}
    lane_tuple = torch.tensor([index.setdefault(tuple(row), len(index)) for row in slots.tolist()])
    tuples = torch.tensor(list(index.keys()), dtype=torch.int64)
    lane_cols = torch.zeros(32, 16, dtype=torch.int64)
    lane_cols[:, : slots.shape[1] // run] = slots[:, ::run] // 16
    return FragmentLayout(elements, FRAGMENT_LAYOUTS[rep, run], rep, run, tuples, lane_tuple, lane_cols)


@functools.cache
def fragment_layout(device_index: int) -> FragmentLayout:
    """The probed fragment layout of a CUDA device (its probe kernel runs once per device)."""
    probe = torch.empty(32, 16, dtype=torch.int32, device=f"cuda:{device_index}")
    kernel_ops().quant_wmma_b_layout(probe)
    return fragment_layout_from_probe(probe)


def fragment_unsupported_reason(weight: QuantizedWeight) -> str | None:
    """Why `quant_gemm_frag` cannot run `weight` (None when it can): 4-bit int with groups of a
    power-of-two number of 64-column chunks, or one group per row."""
    reason = unsupported_reason(weight)
    if reason is not None:
        return reason
    if _kind_of(weight) != KIND_INT4:
        return "the register-dequantizing GEMM takes 4-bit int weights only"
    chunks, rest = divmod(weight.group_size, FRAGMENT_K_CHUNK)
    if weight.scales.shape[1] > 1 and (rest or chunks & (chunks - 1)):
        return f"group size {weight.group_size} is not a power-of-two multiple of {FRAGMENT_K_CHUNK}"
    return None


@dataclass
class FragmentPackedWeight:
    """A 4-bit `QuantizedWeight` in `quant_gemm_frag`'s fragment order (quant_gemm_frag.cuh)."""

    codes: torch.Tensor  # uint8 [tiles, k / 64, tuples * 2 slots]
    group_params: torch.Tensor  # int32 [tiles, num_groups, 16]
    layout: FragmentLayout
    column_order: torch.Tensor | None
    group_size: int
    shape: tuple[int, int]  # (out, in)
    split_counters: torch.Tensor  # as PackedQuantWeight's

    @property
    def nbytes(self) -> int:
        """Bytes the kernel reads per pass: codes and group parameters (with the tiles' padding)."""
        return self.codes.numel() + self.group_params.numel() * 4


def pack_fragments(weight: QuantizedWeight, layout: FragmentLayout) -> FragmentPackedWeight:
    """`weight` repacked so that each lane's 16-byte loads hold its `matrix_b` fragment's codes in
    element order (raises ValueError when `fragment_unsupported_reason(weight)` is not None)."""
    reason = fragment_unsupported_reason(weight)
    if reason is not None:
        raise ValueError(f"no register-dequantizing GEMM for this weight: {reason}")
    order = _column_order(weight)
    codes = weight.codes if order is None else weight.codes[:, order]
    params = _group_params(weight, KIND_INT4)
    n, k = weight.shape
    padded = -(-n // FRAGMENT_FEATURE_ALIGN) * FRAGMENT_FEATURE_ALIGN
    codes = torch.nn.functional.pad(codes, (0, 0, 0, padded - n))  # zero codes with zero-scale words
    params = torch.nn.functional.pad(params, (0, 0, 0, padded - n))
    tiles, chunks = padded // 16, k // FRAGMENT_K_CHUNK
    steps = FRAGMENT_K_CHUNK // 16
    by_step = codes.view(tiles, 16, chunks, steps, 16).permute(0, 2, 3, 1, 4)  # [tile, chunk, step, n, k]
    slots = layout.tuples.to(codes.device)
    picked = by_step[..., slots // 16, slots % 16]  # [tile, chunk, step, tuple, slot]
    ordered = picked.transpose(2, 3).reshape(-1, steps * layout.slots)  # per tuple: step-major slots
    packed = _pack_int4(ordered).view(tiles, chunks, -1)
    return FragmentPackedWeight(
        codes=packed.contiguous(),
        group_params=params.view(tiles, 16, -1).transpose(1, 2).contiguous(),
        layout=layout,
        column_order=order,
        group_size=weight.group_size,
        shape=weight.shape,
        split_counters=torch.zeros(_split_tiles(n), dtype=torch.int32, device=codes.device),
    )


def _split_tiles(out_features: int) -> int:
    """Output tiles of the streaming GEMMs at up to STREAM_MAX_ROWS rows: their split counters."""
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
    if x.shape[0] > STREAM_MAX_ROWS:
        raise ValueError(f"quant_gemm_stream takes at most {STREAM_MAX_ROWS} rows, got {x.shape[0]}")
    x = _gather_columns(x, weight.column_order)
    out = torch.empty(x.shape[0], weight.shape[0], dtype=torch.float16, device=x.device)
    kernel_ops().quant_gemm_stream(
        out, x, weight.packed, weight.group_params, bias, weight.split_counters, weight.kind,
        weight.group_size, m_frags, n_frags, splits,
    )  # fmt: skip
    return out


def quant_gemm_frag(
    weight: FragmentPackedWeight,
    x: torch.Tensor,
    bias: torch.Tensor | None = None,
    m_frags: int = 0,
    n_frags: int = 0,
    splits: int = 0,
    deep: bool = False,
) -> torch.Tensor:
    """`x @ W^T + bias` on the register-dequantizing GEMM (4-bit int) for up to STREAM_MAX_ROWS rows;
    `m_frags`, `n_frags` and `splits` as for `quant_gemm_stream`, 0 = chosen by size; `deep` keeps twice
    the codes in flight per lane (built for n_frags 1 on the structured layouts 1 and 2)."""
    if x.shape[0] > STREAM_MAX_ROWS:
        raise ValueError(f"quant_gemm_frag takes at most {STREAM_MAX_ROWS} rows, got {x.shape[0]}")
    x = _gather_columns(x, weight.column_order)
    out = torch.empty(x.shape[0], weight.shape[0], dtype=torch.float16, device=x.device)
    kernel_ops().quant_gemm_frag(
        out, x, weight.codes, weight.group_params, bias, weight.split_counters, weight.layout.lane_map(),
        weight.layout.layout, weight.group_size, m_frags, n_frags, splits, deep,
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

    def __init__(self, weight: QuantizedWeight, gemm: str = "stream") -> None:
        """`gemm` picks the kernel for up to STREAM_MAX_ROWS rows past the GEMV: "stream" (the
        weight-streaming GEMM, the default) or "frag" (the register-dequantizing GEMM, for the 4-bit
        weights it takes: it keeps a second, fragment-ordered copy of the codes; others stay on "stream")."""
        if not weight.codes.is_cuda:
            raise ValueError("CudaQuantizedMatmul needs a weight on a CUDA device")
        if gemm not in ("stream", "frag"):
            raise ValueError(f"gemm must be 'stream' or 'frag', got {gemm!r}")
        load()  # the kernels, built on first use
        self.weight = pack(weight)
        self.fragments: FragmentPackedWeight | None = None
        if gemm == "frag" and fragment_unsupported_reason(weight) is None:
            index = weight.codes.device.index
            layout = fragment_layout(torch.cuda.current_device() if index is None else index)
            self.fragments = pack_fragments(weight, layout)

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
            if self.fragments is not None:
                return quant_gemm_frag(self.fragments, x, bias)
            return quant_gemm_stream(self.weight, x, bias)
        return quant_dense(self.weight, x, bias)

    def swiglu(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """`silu(gate) * up` of a fused gate/up projection `[gate; up]`: `[rows, out / 2]`. Decode rows
        take the GEMV with the activation in its epilogue."""
        self._check(x)
        if x.shape[0] <= GEMV_DISPATCH_MAX_ROWS:
            return quant_gemv(self.weight, x, bias, swiglu=True)
        return silu_and_mul(self(x, bias))
