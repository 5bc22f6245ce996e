"""Contract exactlogp-v2: the numeric specification, written as plain torch.

Every backend must reproduce these bits; this module is the definition. Stages:

  1. y = fp32(x) / tau                       IEEE fp32 division (tau rounded to fp32)
  2. M = max of valid y over the whole row    exact; one all_reduce(MAX) across ranks
  3. e = exp_c(y - M) for y - M >= -64        binary64 + - * and exact 2^n scaling only
  4. Q(e), Q(e * (M - y)): two int64 limbs    exact fixed point on a 2^-84 grid
  5. int64 sums per row (the partials pass)   exact in any order
  6. one all_reduce(SUM) of int64 [N, 8]      exact under any collective algorithm
  7. finalize: S, log S, outputs in fp64      rounded once to fp32

Stages 3-5 are "the partials pass"; its per-row result is "the record".

Each elementwise step is a single correctly rounded IEEE operation or exact, so the
result does not depend on the order of anything: see docs/numerics.md.
"""

from __future__ import annotations

import math
import struct
from typing import NamedTuple

import torch

CONTRACT = "exactlogp-v2"

# --- constants (docs/numerics.md pins and derives each one) ---

MAX_VOCAB = 1 << 20  # keeps every int64 limb sum below 2^62
CUTOFF = -64.0  # terms with y - M < CUTOFF quantize to 0 and are skipped
MAGIC = float.fromhex("0x1.8p+52")  # (t + MAGIC) - MAGIC == rint_even(t) for |t| < 2^51
FRAC_BITS = 42  # each limb carries 42 fraction bits: the grid is 2^-84
LIMB_SCALE = float.fromhex("0x1p+42")
LIMB_UNIT = float.fromhex("0x1p-42")
LIMB2_UNIT = float.fromhex("0x1p-84")
LIMB_MASK = (1 << FRAC_BITS) - 1

# exp_c: k = rint(d * 32 / ln2), d = k ln2 / 32 + r, exp(d) = 2^(k >> 5) * T[k & 31] * P(r)
INV_LN2_32 = float.fromhex("0x1.71547652b82fep+5")
LN2_32_HI = float.fromhex("0x1.62e42fefa4000p-6")  # 39 significant bits: k * HI is exact
LN2_32_LO = float.fromhex("-0x1.8432a1b0e2634p-48")
EXP2_TABLE = tuple(
    float.fromhex(h)
    for h in (
        "0x1.0000000000000p+0", "0x1.059b0d3158574p+0", "0x1.0b5586cf9890fp+0",
        "0x1.11301d0125b51p+0", "0x1.172b83c7d517bp+0", "0x1.1d4873168b9aap+0",
        "0x1.2387a6e756238p+0", "0x1.29e9df51fdee1p+0", "0x1.306fe0a31b715p+0",
        "0x1.371a7373aa9cbp+0", "0x1.3dea64c123422p+0", "0x1.44e086061892dp+0",
        "0x1.4bfdad5362a27p+0", "0x1.5342b569d4f82p+0", "0x1.5ab07dd485429p+0",
        "0x1.6247eb03a5585p+0", "0x1.6a09e667f3bcdp+0", "0x1.71f75e8ec5f74p+0",
        "0x1.7a11473eb0187p+0", "0x1.82589994cce13p+0", "0x1.8ace5422aa0dbp+0",
        "0x1.93737b0cdc5e5p+0", "0x1.9c49182a3f090p+0", "0x1.a5503b23e255dp+0",
        "0x1.ae89f995ad3adp+0", "0x1.b7f76f2fb5e47p+0", "0x1.c199bdd85529cp+0",
        "0x1.cb720dcef9069p+0", "0x1.d5818dcfba487p+0", "0x1.dfc97337b9b5fp+0",
        "0x1.ea4afa2a490dap+0", "0x1.f50765b6e4540p+0",
    )
)  # fmt: skip
# Taylor coefficients 1/i!, i = 6 .. 0, each the correctly rounded binary64 value.
EXP_POLY = tuple(1.0 / math.factorial(i) for i in range(6, -1, -1))

# contract log: log S = k ln2 + 2 atanh(g / (2 + g)), g = m - 1, m in [sqrt(1/2), sqrt(2))
LN2_HI = float.fromhex("0x1.62e42fefa3800p-1")  # k * LN2_HI is exact for |k| < 2^11
LN2_LO = float.fromhex("0x1.ef35793c76730p-45")
SQRT_HALF = float.fromhex("0x1.6a09e667f3bcdp-1")
# 1/(2i+1) for i = 11 .. 1, correctly rounded.
LOG_POLY = tuple(1.0 / (2 * i + 1) for i in range(11, 0, -1))

# --- the int64 row record carried by the one all_reduce(SUM) ---

COL_E_HI, COL_E_LO = 0, 1  # limb sums of e_j
COL_W_HI, COL_W_LO = 2, 3  # limb sums of w_j = e_j * (M - y_j) (zero unless entropy)
COL_TARGET_BITS = 4  # int32 bit pattern of y_target, from the owning rank only
COL_OWNERS = 5  # number of ranks whose real columns hold the target
COL_TARGET_MASKED = 6  # owners whose keep_mask drops the target column
COL_NONFINITE = 7  # NaN / +inf among valid (real, kept) columns
NUM_COLS = 8

# --- per-row problems found by finalize (bit flags) ---

BAD_TARGET_RANGE = 1
BAD_TARGET_OWNER = 2
BAD_TARGET_MASKED = 4
BAD_NONFINITE = 8
BAD_NO_VALID_COLUMN = 16
BAD_TEMPERATURE = 32
BAD_RANKS = 64  # the ranks of the TP group disagree (a per-row value, or the call itself)
BAD_KEPT_SET = 128  # replay: the row's kept ids are malformed (flagged by exactlogp.replay)


# --- 1. upcast and temperature ---


def fp32_temperature(tau: float) -> float:
    """The scalar temperature the contract uses: tau rounded to fp32 (RNE; past the fp32
    range, +-inf)."""
    tau = float(tau)
    try:
        return struct.unpack("<f", struct.pack("<f", tau))[0]  # a C cast: round to nearest even
    except OverflowError:  # finite, but rounds past the largest fp32
        return math.copysign(math.inf, tau)


def fp32_bits(value: float) -> int:
    """The bit pattern of an fp32 value (a float already rounded to fp32) as a signed int32."""
    return struct.unpack("<i", struct.pack("<f", value))[0]


def scaled_logits(x: torch.Tensor, temperature: float | torch.Tensor) -> torch.Tensor:
    """y = fp32(x) / tau with IEEE fp32 division; tau is a float or an fp32 (n, 1) tensor."""
    y = x.to(torch.float32)
    if not isinstance(temperature, torch.Tensor):
        if temperature == 1.0:
            return y  # a division by exactly 1.0 is the identity
        # a device tensor, not a Python scalar: CUDA turns `tensor / scalar` into a
        # multiplication by the reciprocal, which is not the IEEE division
        temperature = torch.full((), temperature, dtype=torch.float32, device=y.device)
    return y / temperature


def valid_columns(
    num_cols: int,
    vocab_start: int,
    vocab_size: int | None,
    keep_mask: torch.Tensor | None,
    device: torch.device,
) -> torch.Tensor:
    """(n, V_local) or (1, V_local) bool: real (not padding) and kept columns."""
    cols = torch.arange(vocab_start, vocab_start + num_cols, device=device)
    real = (
        (cols < vocab_size) if vocab_size is not None else torch.ones_like(cols, dtype=torch.bool)
    )
    real = real.unsqueeze(0)
    return real if keep_mask is None else real & keep_mask


def masked_row_max(y: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Max over valid columns; NaN and +inf do not take part (they are counted instead)."""
    ok = valid & (y != float("inf")) & ~torch.isnan(y)
    neg_inf = torch.full((), float("-inf"), dtype=y.dtype, device=y.device)
    y = torch.where(ok, y, neg_inf)
    if y.shape[-1] == 0:
        return torch.full(y.shape[:-1], float("-inf"), dtype=y.dtype, device=y.device)
    return y.amax(dim=-1)


# --- 3. contract exponential ---


def pow2(n: torch.Tensor) -> torch.Tensor:
    """2^n as binary64 for int64 n in the normal range, built from its bit pattern."""
    return ((n + 1023) << 52).view(torch.float64)


_tables: dict[torch.device, torch.Tensor] = {}


def exp2_table(device: torch.device) -> torch.Tensor:
    """EXP2_TABLE as an fp64 tensor on `device` (kernels that take it as an argument too)."""
    if device not in _tables:  # one host-to-device copy per device, not one per call
        _tables[device] = torch.tensor(EXP2_TABLE, dtype=torch.float64, device=device)
    return _tables[device]


def exp_c(d: torch.Tensor) -> torch.Tensor:
    """exp(d) for binary64 d in [CUTOFF, 0], from IEEE + - * and exact scaling only."""
    t = d * INV_LN2_32
    kd = (t + MAGIC) - MAGIC  # round half to even; |t| < 2^12
    k = kd.to(torch.int64)
    r = (d - kd * LN2_32_HI) - kd * LN2_32_LO  # Cody-Waite: |r| <= ln2/64 (+ tiny)
    p = torch.full_like(r, EXP_POLY[0])
    for c in EXP_POLY[1:]:
        p = p * r + c  # Horner; torch never fuses this into an FMA
    return (exp2_table(d.device)[k & 31] * p) * pow2(k >> 5)


# --- 4. quantize ---


def quantize(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """v in [0, 1] -> (hi, lo) int64 with hi*2^-42 + lo*2^-84 == rint_even(v * 2^84) * 2^-84."""
    s = v * LIMB_SCALE  # exact
    hi = s.to(torch.int64)  # truncation == floor, since s >= 0
    rem = s - hi.to(torch.float64)  # exact
    lo = ((rem * LIMB_SCALE + MAGIC) - MAGIC).to(torch.int64)  # rint_even, exact
    return hi, lo


def term_limbs(d: torch.Tensor, with_entropy: bool = False, valid: torch.Tensor | None = None):
    """The limbs of each column's terms, d = fp64(y) - fp64(M) (any shape): (hi, lo) of
    e = Q(exp_c(d)) where CUTOFF <= d <= 0 (and `valid`), else 0 -- NaN and +-inf fail a
    compare -- and with_entropy also (hi, lo) of Q(e * (-d)). The partials pass sums them;
    the exact cut (exactlogp.cut) weighs and sums the kept columns by them."""
    term = (d >= CUTOFF) & (d <= 0.0)
    if valid is not None:
        term = valid & term
    dz = torch.where(term, d, torch.zeros_like(d))  # exp_c sees only [CUTOFF, 0]
    e = torch.where(term, exp_c(dz), torch.zeros_like(d))
    if not with_entropy:
        return quantize(e)
    return (*quantize(e), *quantize(e * (-dz)))


# --- which shard holds a target ---


def owned_target_columns(
    target: torch.Tensor,  # (N,) int64 global ids
    vocab_start: int,
    num_cols: int,
    vocab_size: int | None,
    ignore_index: int,
) -> torch.Tensor:
    """(N,) int64: the target's local column where this shard holds it, else -1.

    The one ownership rule: a shard holds a target when the row is not ignored and the
    target is one of its real columns (vocab_start <= target < vocab_start + num_cols,
    and target < vocab_size).
    """
    local = target - vocab_start
    owned = (target != ignore_index) & (local >= 0) & (local < num_cols)
    if vocab_size is not None:
        owned &= target < vocab_size
    return torch.where(owned, local, torch.full_like(local, -1))


# --- 3-5. the partials pass over one block of rows ---


def partials(
    y: torch.Tensor,  # (n, V_local) fp32, already scaled
    valid: torch.Tensor,  # (n or 1, V_local) bool
    row_max: torch.Tensor,  # (n,) fp32, global
    target: torch.Tensor,  # (n,) int64, global ids
    keep_mask: torch.Tensor | None,  # (n, V_local) bool
    vocab_start: int,
    vocab_size: int | None,
    ignore_index: int,
    with_entropy: bool,
) -> torch.Tensor:
    """(n, NUM_COLS) int64: the exact per-row record of this shard."""
    n, num_cols = y.shape
    out = torch.zeros(n, NUM_COLS, dtype=torch.int64, device=y.device)

    d = y.to(torch.float64) - row_max.to(torch.float64).unsqueeze(-1)
    limbs = term_limbs(d, with_entropy, valid)
    for col, limb in zip(
        (COL_E_HI, COL_E_LO, COL_W_HI, COL_W_LO)[: len(limbs)], limbs, strict=True
    ):
        out[:, col] = limb.sum(-1)

    nonfinite = valid & (torch.isnan(y) | (y == float("inf")))
    out[:, COL_NONFINITE] = nonfinite.sum(-1)

    local_t = owned_target_columns(target, vocab_start, num_cols, vocab_size, ignore_index)
    owner = local_t >= 0
    idx = local_t.clamp(min=0).unsqueeze(-1)
    if num_cols > 0:
        y_t = y.gather(-1, idx).squeeze(-1)
        bits = y_t.view(torch.int32).to(torch.int64)
        out[:, COL_TARGET_BITS] = torch.where(owner, bits, torch.zeros_like(bits))
        if keep_mask is not None:
            dropped = owner & ~keep_mask.gather(-1, idx).squeeze(-1)
            out[:, COL_TARGET_MASKED] = dropped.to(torch.int64)
    out[:, COL_OWNERS] = owner.to(torch.int64)
    return out


# --- 7. finalize ---


def two_sum(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    s = a + b
    bb = s - a
    return s, (a - (s - bb)) + (b - bb)


def limbs_to_double_double(hi: torch.Tensor, lo: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """hi*2^-42 + lo*2^-84 (int64, >= 0) -> (vh, vl), vh = fl(value), vh + vl == value."""
    hi = hi + (lo >> FRAC_BITS)  # carry: now lo < 2^42 and the value is unchanged
    lo = lo & LIMB_MASK
    a = hi.to(torch.float64)  # round to nearest even
    r = hi - a.to(torch.int64)  # exact, |r| <= 2^9
    t = r * (1 << FRAC_BITS) + lo  # exact, |t| < 2^53
    return two_sum(a * LIMB_UNIT, t.to(torch.float64) * LIMB2_UNIT)


def log_c(sh: torch.Tensor, sl: torch.Tensor) -> torch.Tensor:
    """log(sh + sl) for sh >= 1, |sl| <= ulp(sh)/2; relative error ~2^-52 even near S = 1."""
    m, k = torch.frexp(sh)  # sh = m 2^k, m in [0.5, 1)
    small = m < SQRT_HALF
    m = torch.where(small, m * 2.0, m)
    k = torch.where(small, k - 1, k).to(torch.float64)
    g = m - 1.0  # exact (Sterbenz)
    s = g / (2.0 + g)
    s2 = s + s
    z = s * s
    poly = torch.full_like(z, LOG_POLY[0])
    for c in LOG_POLY[1:]:
        poly = poly * z + c
    tail = k * LN2_LO + sl / sh  # log(1 + sl/sh) == sl/sh to 2^-105
    return k * LN2_HI + (s2 + (s2 * (poly * z) + tail))


class RowStats(NamedTuple):
    """The per-row statistics backward needs from forward (fields of Finalized)."""

    s_hi: torch.Tensor
    s_lo: torch.Tensor
    log_s: torch.Tensor
    entropy64: torch.Tensor
    bad: torch.Tensor
    ignored: torch.Tensor


class Finalized(NamedTuple):
    logprobs: torch.Tensor  # (N,) fp32
    entropy: torch.Tensor  # (N,) fp32 (zeros unless entropy was accumulated)
    lse: torch.Tensor  # (N,) fp32
    s_hi: torch.Tensor  # (N,) fp64, fl(S): backward's p_j = e_j / s_hi
    s_lo: torch.Tensor  # (N,) fp64, S - s_hi exactly: backward's 1 - p_t
    log_s: torch.Tensor  # (N,) fp64
    entropy64: torch.Tensor  # (N,) fp64, before rounding
    bad: torch.Tensor  # (N,) int64 bit flags BAD_*, 0 for ignored rows unless BAD_RANKS
    ignored: torch.Tensor  # (N,) bool


def finalize(
    row_max: torch.Tensor,  # (N,) fp32, global max
    record: torch.Tensor,  # (N, NUM_COLS) int64, summed over all ranks
    target: torch.Tensor,  # (N,) int64
    vocab_size: int | None,
    ignore_index: int,
    bad_temperature: torch.Tensor | None,  # (N,) bool
    ranks_disagree: torch.Tensor | None = None,  # (N,) bool, from the agreement fields
) -> Finalized:
    ignored = target == ignore_index
    owners = record[:, COL_OWNERS]
    bad = torch.zeros_like(target)
    out_of_range = target < 0
    if vocab_size is not None:
        out_of_range |= target >= vocab_size
    bad |= torch.where(out_of_range, BAD_TARGET_RANGE, 0)
    bad |= torch.where(~out_of_range & (owners != 1), BAD_TARGET_OWNER, 0)
    bad |= torch.where(record[:, COL_TARGET_MASKED] != 0, BAD_TARGET_MASKED, 0)
    bad |= torch.where(record[:, COL_NONFINITE] != 0, BAD_NONFINITE, 0)
    bad |= torch.where(row_max == float("-inf"), BAD_NO_VALID_COLUMN, 0)
    if bad_temperature is not None:
        bad |= torch.where(bad_temperature, BAD_TEMPERATURE, 0)
    bad = torch.where(ignored, 0, bad)
    if ranks_disagree is not None:  # poisons ignored rows too: nothing of the call holds
        bad |= torch.where(ranks_disagree, BAD_RANKS, 0)

    # Bad and ignored rows may have S = 0; give them S = 1 so log_c stays in its domain
    # (their outputs are replaced below, their gradients are NaN or zero).
    skip = (bad != 0) | ignored
    e_hi = torch.where(skip, 1 << FRAC_BITS, record[:, COL_E_HI])
    e_lo = torch.where(skip, 0, record[:, COL_E_LO])
    sh, sl = limbs_to_double_double(e_hi, e_lo)
    log_s = log_c(sh, sl)
    wh, _ = limbs_to_double_double(record[:, COL_W_HI], record[:, COL_W_LO])

    m64 = row_max.to(torch.float64)
    y_t = record[:, COL_TARGET_BITS].to(torch.int32).view(torch.float32).to(torch.float64)
    logprob64 = (y_t - m64) - log_s
    lse64 = m64 + log_s
    entropy64 = log_s + wh / sh

    nan = torch.full((), float("nan"), dtype=torch.float64, device=log_s.device)
    zero = torch.zeros((), dtype=torch.float64, device=log_s.device)

    def _finish(v: torch.Tensor) -> torch.Tensor:
        v = torch.where(ignored, zero, v)
        return torch.where(bad != 0, nan, v).to(torch.float32)

    return Finalized(
        logprobs=_finish(logprob64),
        entropy=_finish(entropy64),
        lse=_finish(lse64),
        s_hi=sh,
        s_lo=sl,
        log_s=log_s,
        entropy64=entropy64,
        bad=bad,
        ignored=ignored,
    )


# --- backward: elementwise from the saved per-row statistics ---


class GradStats(NamedTuple):
    """Per-row statistics saved by forward and the upstream gradients, all (N,)."""

    row_max: torch.Tensor  # fp32
    s_hi: torch.Tensor  # fp64, fl(S)
    s_lo: torch.Tensor  # fp64, S - s_hi
    log_s: torch.Tensor  # fp64
    entropy64: torch.Tensor  # fp64
    coef_a: torch.Tensor  # fp64, g_lse - g_logprob; 0 on rows without a gradient
    coef_b: torch.Tensor  # fp64, g_entropy; 0 on rows without a gradient
    coef_t: torch.Tensor  # fp64, g_logprob; 0 on rows without a gradient
    coef_l: torch.Tensor  # fp64, g_lse; 0 on rows without a gradient
    row_nan: torch.Tensor  # bool, rows whose gradient is NaN in every column
    silent: torch.Tensor  # bool, rows without a gradient: +0 in every column

    def rows(self, index: slice) -> GradStats:
        return GradStats(*(t[index] for t in self))


def grad_stats(
    row_max: torch.Tensor,  # (N,) fp32
    fin,  # Finalized, or anything with its s_hi, s_lo, log_s, entropy64, bad, ignored
    g_logprobs: torch.Tensor | None,  # (N,) upstream gradients; None: 0
    g_entropy: torch.Tensor | None,
    g_lse: torch.Tensor | None,
) -> GradStats:
    """GradStats from forward's per-row statistics and the upstream gradients.

    A row without a gradient -- ignored, or all its upstream gradients 0 -- gets +0 in
    every column; a bad row (NaN outputs) gets NaN in every column only when a gradient
    flows into it, so a NaN row that the loss masks out poisons nothing.
    """

    def per_row(g):
        if g is None or g.numel() == 0:
            return torch.zeros_like(fin.s_hi)
        return torch.where(fin.ignored, 0.0, g.to(torch.float64))

    g_lp, g_ent, g_l = per_row(g_logprobs), per_row(g_entropy), per_row(g_lse)
    silent = (g_lp == 0) & (g_ent == 0) & (g_l == 0)
    return GradStats(
        row_max=row_max, s_hi=fin.s_hi, s_lo=fin.s_lo, log_s=fin.log_s,
        entropy64=fin.entropy64, coef_a=g_l - g_lp, coef_b=g_ent, coef_t=g_lp, coef_l=g_l,
        row_nan=(fin.bad != 0) & ~silent, silent=silent,
    )  # fmt: skip


def grad_temperature(stats: GradStats, temperature: float | torch.Tensor):
    """The temperature backward divides by: a row without a gradient never uses its own
    (it is taken as 1), so a per-row tau <= 0 or NaN there gives +0, not NaN."""
    if isinstance(temperature, torch.Tensor):
        return torch.where(stats.silent, 1.0, temperature)
    return temperature


def grad_block(
    y: torch.Tensor,  # (n, V_local) fp32, scaled
    valid: torch.Tensor,  # (n or 1, V_local) bool
    stats: GradStats,  # (n,) each
    target_local: torch.Tensor,  # (n,) int64: the owned target column, -1 where not owned here
    temperature: float | torch.Tensor,  # float or (n, 1) fp32
    with_entropy: bool,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """d(outputs)/dx for one block of rows, in out_dtype (via fp32).

    Column j != t:  g_j = p_j * (a - b * q_j), q_j = log p_j + H  (g_j = p_j * a without
    entropy), with p_j = e_j / fl(S) and log p_j = d_j - log S.
    The target t:   g_t = c * (1 - p_t) + p_t * (l - b * q_t), with 1 - p_t from the exact
    S: ((s_hi - e_t) + s_lo) / s_hi, so a near-certain token keeps full relative precision.
    Then g /= tau; +0 where there is no term (the target keeps c * 1); NaN in every column
    of a NaN row.
    """
    col = lambda v: v.unsqueeze(-1)  # noqa: E731
    d = y.to(torch.float64) - col(stats.row_max.to(torch.float64))
    term = valid & (d >= CUTOFF) & (d <= 0.0)
    dz = torch.where(term, d, torch.zeros_like(d))
    e = torch.where(term, exp_c(dz), torch.zeros_like(d))
    p = e / col(stats.s_hi)
    if with_entropy:
        bq = col(stats.coef_b) * ((dz - col(stats.log_s)) + col(stats.entropy64))
        g = p * (col(stats.coef_a) - bq)
        g_t = p * (col(stats.coef_l) - bq)
    else:
        g = p * col(stats.coef_a)
        g_t = p * col(stats.coef_l)
    g = torch.where(term, g, torch.zeros_like(g))  # +0, never -0, without a term
    one_minus_p = ((col(stats.s_hi) - e) + col(stats.s_lo)) / col(stats.s_hi)
    g_t = col(stats.coef_t) * one_minus_p + g_t
    cols = torch.arange(y.shape[-1], device=y.device)
    g = torch.where(cols.unsqueeze(0) == col(target_local), g_t, g)
    if isinstance(temperature, torch.Tensor):
        g = g / temperature.to(torch.float64)
    elif temperature != 1.0:  # a device tensor: see scaled_logits
        g = g / torch.full((), temperature, dtype=torch.float64, device=g.device)
    g = torch.where(col(stats.row_nan), torch.full_like(g, float("nan")), g)
    return g.to(torch.float32).to(out_dtype)
