"""Token sampling without a vocabulary sort (csrc/sampling/radix_sampling.cuh), with its torch reference.

`sample_tokens` draws one token per row from logits under temperature, top-k, top-p and min-p. The
sets are defined by each token's distance from the row's best logit in units of temperature,
`d = (max - x) * (1 / T)` in fp32, and its relative probability `e = exp(-d)`:

- top-k keeps `d <= the k-th smallest d` (ties at the k-th value are all kept);
- top-p keeps `d <= K`, the smallest K whose set holds at least `top_p` of the mass left by top-k, the
  mass summed in fixed point (`floor(e * 2**40)`), so that the sum is exact and order-free;
- min-p keeps `e >= min_p`;
- the draw is the exponential race, `argmax(x / T - log E)` over the kept tokens (the product rounded
  before the subtraction), which samples them in proportion to `e`; `E = -log1p(-v)` with `v` from 32
  bits of a SplitMix64 hash of (row seed, token id). The race value does not need the row's max, so
  the kernels can race a row before they know which tokens the filters keep.

A filter that no row uses can be passed as None (the kernel then launches nothing for it). Rows with
temperature <= 0 take the first argmax. The noise of a row depends on its seed alone, so a
draw is reproducible whatever else is in the batch. The reference computes the same sets with a sort
and the same noise; the kernels and it agree token for token up to last-bit differences of exp/log.

Two kernels draw the same tokens (`SAMPLING_METHODS`):
"select" (csrc/sampling/radix_sampling.cuh: the filters' thresholds by radix select, then the race over
what they keep) and "race_first" (csrc/sampling/race_first_sampling.cuh: the race's best few tokens
first, then a check of each against the top-p set; three launches for top-p, one for temperature or
greedy). "race_first" covers temperature and top-p; a batch in which a row uses top-k or min-p takes
"select" (the same token either way, so a row's draw still does not depend on its batch). "auto" (the
default) picks per call by what the GPU measured (`resolve_sampling_method`; benches/RESULTS.md,
"Session 13").
"""

from __future__ import annotations

import torch

from voltllm.ops._dispatch import kernel_ops, use_kernels

SAMPLING_METHODS = ("select", "race_first")
# The methods a caller may name: a kernel, or "auto" (`resolve_sampling_method`).
METHOD_CHOICES = ("auto", *SAMPLING_METHODS)
# Where "auto" races first (`resolve_sampling_method`). H100, Qwen3's vocabulary, the draw alone at 1 to
# 256 rows (benches/sampling.py; race_first's device time over the select's): greedy 0.52-0.88 at every
# size; temperature alone 0.91 at 1 row, 1.13-1.33 from 4; top-p 0.95 0.42-0.74 up to 64 rows, 0.60-0.92
# at 128, 0.61-1.31 at 256; top-p 0.5 0.42-0.76 at 1 row but up to 7.6x from 4 (a row whose four best
# race candidates all fall outside the top-p set, probability (1 - p)^4, takes a row-wide select).
RACE_FIRST_MAX_ROWS_TEMPERATURE = 1
RACE_FIRST_MAX_ROWS_TOP_P = 64
RACE_FIRST_MIN_TOP_P = 0.9
# Fewest tokens one block of a race_first split pass takes (kRaceMinSplitTokens in the kernel header):
# about 150 blocks for one row of Qwen3's 151,936 tokens. The draw does not depend on it.
RACE_MIN_SPLIT_TOKENS = 1024

_GOLDEN = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB
MASS_SCALE = float(2**40)


def _int64(c: int) -> int:
    """A 64-bit constant as the signed value torch's int64 arithmetic (which wraps) holds."""
    return c - (1 << 64) if c >= 1 << 63 else c


def _shift_right(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch's `>>` is arithmetic)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def splitmix64(x: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finaliser on int64 bit patterns (wrapping multiplies, as the kernel's uint64)."""
    x = x ^ _shift_right(x, 30)
    x = x * _int64(_MIX1)
    x = x ^ _shift_right(x, 27)
    x = x * _int64(_MIX2)
    return x ^ _shift_right(x, 31)


def exponential_noise(seeds: torch.Tensor, vocab: int) -> torch.Tensor:
    """`E ~ Exp(1)` for every (row, token): `[N]` int64 seeds -> `[N, vocab]` float32."""
    tokens = torch.arange(1, vocab + 1, dtype=torch.int64, device=seeds.device)
    h = splitmix64(seeds.unsqueeze(1) + tokens * _int64(_GOLDEN))
    v = (_shift_right(h, 32) | 1).to(torch.float32) * 2.0**-32
    return -torch.log1p(-v)


def random_seeds(
    num_rows: int, device: torch.device, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Fresh noise seeds for rows that did not ask for one: `[num_rows]` int64."""
    low, high = -(2**63), 2**63 - 1
    return torch.randint(low, high, (num_rows,), dtype=torch.int64, device=device, generator=generator)


def seed_as_int64(seed: int) -> int:
    """A seed in [0, 2**64) as the int64 with the same bits (what the seeds tensor holds)."""
    return _int64(seed % (1 << 64))


def sample_tokens_ref(
    logits: torch.Tensor,  # [N, V]
    temperature: torch.Tensor,  # [N] float32; <= 0: greedy
    top_k: torch.Tensor | None,  # [N] int32; <= 0 or >= V: off; None: off for every row
    top_p: torch.Tensor | None,  # [N] float32; >= 1: off; None: off for every row
    min_p: torch.Tensor | None,  # [N] float32; <= 0: off; None: off for every row
    seeds: torch.Tensor,  # [N] int64
) -> torch.Tensor:
    """The reference of `sample_tokens`: the same sets by sorting, the same noise. `[N]` int64."""
    rows, device = logits.shape[0], logits.device
    top_k = top_k if top_k is not None else torch.zeros(rows, dtype=torch.int32, device=device)
    top_p = top_p if top_p is not None else torch.ones(rows, device=device)
    min_p = min_p if min_p is not None else torch.zeros(rows, device=device)
    x = logits.float()
    vocab = x.shape[1]
    argmax = x.argmax(dim=-1)
    max_logit = x.gather(1, argmax.unsqueeze(1))
    sampling = (temperature > 0) & (max_logit.squeeze(1) != float("-inf"))
    inv_t = 1.0 / torch.where(sampling, temperature, torch.ones_like(temperature))
    d = (max_logit - x) * inv_t.unsqueeze(1)
    keep = torch.ones_like(d, dtype=torch.bool)
    sorted_d = d.sort(dim=-1).values
    k = top_k.long()
    k_on = (k > 0) & (k < vocab)
    kth = sorted_d.gather(1, (k.clamp(1, vocab) - 1).unsqueeze(1))
    keep &= ~k_on.unsqueeze(1) | (d <= kth)
    e = torch.exp(-d)
    p_on = top_p < 1
    if bool(p_on.any()):
        ceiling, _, _ = top_p_cut(d, e, keep, top_p)
        keep &= ~p_on.unsqueeze(1) | (d <= ceiling)
    m_on = min_p > 0
    keep &= ~m_on.unsqueeze(1) | (e >= min_p.unsqueeze(1))
    race = race_values(x, inv_t, seeds)
    return torch.where(sampling, torch.where(keep, race, float("-inf")).argmax(dim=-1), argmax)


def race_values(x: torch.Tensor, inv_t: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
    """Every token's race value `x / T - log E` (float32 `[N, V]` logits, `[N]` 1/T and seeds)."""
    return x * inv_t.unsqueeze(1) - torch.log(exponential_noise(seeds, x.shape[1]))


def top_p_cut(
    d: torch.Tensor, e: torch.Tensor, keep: torch.Tensor, top_p: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row, the smallest d whose set {d' <= d} (within `keep`) holds `top_p` of the kept mass,
    with the integer masses the kernels sum.

    Returns the ceiling `[N, 1]`, every token's mass `[N, V]` (int64, 0 outside `keep`) and the
    target mass `[N]`."""
    mass = torch.where(keep, (e * MASS_SCALE).to(torch.int64), 0)
    total = mass.sum(dim=-1)
    target = (top_p.double() * total.double()).floor().to(torch.int64).clamp(min=1)
    target = torch.minimum(target, total)
    order = torch.where(keep, d, float("inf")).argsort(dim=-1, stable=True)
    cumulative = mass.gather(1, order).cumsum(dim=-1)
    first = (cumulative >= target.unsqueeze(1)).int().argmax(dim=-1, keepdim=True)
    return d.gather(1, order.gather(1, first)), mass, target


def check_sampling_method(method: str) -> None:
    """Raises ValueError unless `method` is one of `METHOD_CHOICES`."""
    if method not in METHOD_CHOICES:
        raise ValueError(f"unknown sampling method {method!r}: one of {', '.join(METHOD_CHOICES)}")


def resolve_sampling_method(method: str, rows: int, greedy: bool, min_top_p: float = 1.0) -> str:
    """The kernel `method` names for a draw of `rows` rows whose smallest top-p is `min_top_p` (1: no
    row filters by top-p). "auto" races first for a greedy batch, for one row, and for at most
    `RACE_FIRST_MAX_ROWS_TOP_P` top-p rows all at `RACE_FIRST_MIN_TOP_P` or more (temperature alone: at
    most `RACE_FIRST_MAX_ROWS_TEMPERATURE` rows); it selects otherwise."""
    check_sampling_method(method)
    if method != "auto":
        return method
    if greedy or rows <= RACE_FIRST_MAX_ROWS_TEMPERATURE:
        return "race_first"
    if min_top_p < 1 and rows <= RACE_FIRST_MAX_ROWS_TOP_P and min_top_p >= RACE_FIRST_MIN_TOP_P:
        return "race_first"
    return "select"


def sample_tokens(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    min_p: torch.Tensor | None,
    seeds: torch.Tensor,
    method: str = "auto",
    min_split_tokens: int = RACE_MIN_SPLIT_TOKENS,
    min_top_p: float | None = None,
) -> torch.Tensor:
    """One token per row of `logits [N, V]` (fp32/fp16/bf16, rows contiguous): `[N]` int64.

    Per-row settings: `temperature` float32 (<= 0: greedy), `top_k` int32 (<= 0: off), `top_p` float32
    (1: off), `min_p` float32 (0: off), `seeds` int64 (the row's noise: same seed, same logits, same token).
    A filter no row uses may be None. `method` picks the kernel (`SAMPLING_METHODS`: the same token
    either way); `min_split_tokens` sizes race_first's split passes (it does not change the token);
    `min_top_p`, the smallest of `top_p` when the caller knows it on the host, guides "auto" (None: 1
    without `top_p`, else taken as low).
    """
    if min_top_p is None:
        min_top_p = 1.0 if top_p is None else 0.0
    method = resolve_sampling_method(method, logits.shape[0], greedy=False, min_top_p=min_top_p)
    if not use_kernels(logits):
        return sample_tokens_ref(logits, temperature, top_k, top_p, min_p, seeds)
    out = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
    if method == "race_first" and top_k is None and min_p is None:
        kernel_ops().race_first_sampling(out, logits, temperature, top_p, seeds, min_split_tokens)
    else:
        kernel_ops().radix_sampling(out, logits, temperature, top_k, top_p, min_p, seeds)
    return out


def argmax_tokens(
    logits: torch.Tensor, method: str = "auto", min_split_tokens: int = RACE_MIN_SPLIT_TOKENS
) -> torch.Tensor:
    """The first argmax of each row of `logits [N, V]` (a greedy step): `[N]` int64. "select" runs
    torch's reduction; "race_first" (on a GPU) the first pass of race_first_sampling alone, one launch."""
    method = resolve_sampling_method(method, logits.shape[0], greedy=True)
    if method == "race_first" and use_kernels(logits):
        out = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
        kernel_ops().race_first_sampling(out, logits, None, None, None, min_split_tokens)
        return out
    return logits.argmax(dim=-1)
