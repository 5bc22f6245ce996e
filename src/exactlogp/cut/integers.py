"""Exact integer steps of the cut: limbs, order-keeping keys, and the threshold selects.

The masses q of contract exactlogp-v2 are integers on the 2^-84 grid held in two 42-bit
limbs (value = hi 2^42 + lo); the values y are ranked by a 32-bit key that orders like
them. A cut's threshold is the largest key whose upper set weighs at least a row's need
(k for top-k, ceil(p S) for top-p): across a TP group by radix rounds, each one int64
all_reduce(SUM) of bins (exact in any order), or, with the whole vocabulary here, by one
sort of the candidates. docs/numerics.md section 13.
"""

from __future__ import annotations

import torch

from .. import contract, distributed

BITS = contract.FRAC_BITS
MASK = contract.LIMB_MASK
SORT_MAX_ELEMENTS = 1 << 16  # more candidates than this: the radix rounds (fewer passes)


# --- integers in two 42-bit limbs (value = hi 2^42 + lo) ---


def norm(hi, lo):
    return hi + (lo >> BITS), lo & MASK  # floor division: exact for negative lo too


def ge(a_hi, a_lo, b_hi, b_lo):
    a_hi, a_lo = norm(a_hi, a_lo)
    b_hi, b_lo = norm(b_hi, b_lo)
    return (a_hi > b_hi) | ((a_hi == b_hi) & (a_lo >= b_lo))


def min_mass(m: torch.Tensor):
    """ceil(m 2^84) as two limbs, for fp32 m in [0, 1] (exact in binary64)."""
    c = torch.ceil(m.to(torch.float64) * float(1 << 84))
    hi = torch.floor(c * contract.LIMB_UNIT)
    return hi.to(torch.int64), (c - hi * contract.LIMB_SCALE).to(torch.int64)


# --- keys: 32-bit integers that order like the fp32 values (-0 as +0) ---


def keys(y: torch.Tensor) -> torch.Tensor:
    b = y.view(torch.int32).to(torch.int64)
    b = torch.where(y == 0, torch.zeros_like(b), b)
    return torch.where(b >= 0, b + (1 << 31), -1 - b)


def key_value(key: torch.Tensor) -> torch.Tensor:
    b = torch.where(key >= (1 << 31), key - (1 << 31), -1 - key)
    return b.to(torch.int32).view(torch.float32)


def masses(d: torch.Tensor):
    """(hi, lo) int64 limbs of q = Q(exp_c(d)) for binary64 d; 0 outside [-64, 0]."""
    return contract.term_limbs(d)


def radix_select(rows, key, weights, n, group, need_of_total):
    """The per-row threshold key t: the largest key whose upper set {key >= t} weighs at
    least need (a row's need from its total, `need_of_total`), by 4 rounds of 256 bins.

    rows, key: (m,) int64 elements; weights: (m, W) int64 (W = 1: counts; W = 2: limbs).
    Returns (threshold key (n,), found (n,) bool: the row's total reaches its need)."""
    w = weights.shape[1]
    prefix = torch.zeros(n, dtype=torch.int64, device=key.device)
    need = found = None
    for shift in (24, 16, 8, 0):
        bins = (key >> shift) & 255
        hist = torch.zeros(n * 256, w, dtype=torch.int64, device=key.device)
        hist.index_add_(0, rows * 256 + bins, weights)
        hist = distributed.all_reduce_sum_(hist.view(n, 256, w), group)
        cum = hist.flip(1).cumsum(1).flip(1)  # cum[b] = sum over bins >= b
        if need is None:
            need = need_of_total(cum[:, 0])  # (n, W)
        if w == 1:
            ok = cum[..., 0] >= need[:, :1]
        else:
            ok = ge(cum[..., 0], cum[..., 1], need[:, :1], need[:, 1:])
        count = ok.sum(1)  # ok is true for bins 0 .. b*: cum does not grow with b
        if found is None:
            found = count > 0
        b = (count - 1).clamp(min=0)
        above = torch.where(
            (b < 255).unsqueeze(-1),
            cum.gather(1, (b + 1).clamp(max=255).view(n, 1, 1).expand(n, 1, w)).squeeze(1),
            torch.zeros_like(need),
        )
        need = need - above
        if w == 2:
            need = torch.stack(norm(need[:, 0], need[:, 1]), dim=1)
        prefix = prefix | (b << shift)
        keep = bins == b[rows]
        rows, key, weights = rows[keep], key[keep], weights[keep]
    return prefix, found


def sorted_select(rows, key, weights, n, need_of_total):
    """radix_select's result where the whole vocabulary is here (no TP group), in fewer
    steps: each row's elements sorted by key, largest first; the threshold is the key of
    the first element whose running weight (ties or not) reaches the need. No larger t has
    W{key >= t} >= need (those sets hold only elements before it, which weigh less), and
    W{key >= its key} >= need: the largest such t, which the radix rounds find. Returns
    (threshold key (n,), 0 where not found; found (n,) bool)."""
    w = weights.shape[1]
    dev = key.device
    total = torch.zeros(n, w, dtype=torch.int64, device=dev).index_add_(0, rows, weights)
    need = need_of_total(total)
    order = torch.argsort(rows * (1 << 32) + ((1 << 32) - 1 - key))  # rows up, key down
    rows, key, weights = rows[order], key[order], weights[order]
    cum = weights.cumsum(0)
    counts = torch.bincount(rows, minlength=n)
    starts = counts.cumsum(0) - counts
    before = torch.zeros(n, w, dtype=torch.int64, device=dev)  # weight of the rows before
    has = starts > 0
    before[has] = cum[starts[has] - 1]
    cum = cum - before[rows]
    if w == 1:
        ok = cum[:, 0] >= need[rows, 0]
    else:
        ok = ge(cum[:, 0], cum[:, 1], need[rows, 0], need[rows, 1])
    pos = torch.arange(len(key), device=dev)
    first = torch.full((n,), len(key), dtype=torch.int64, device=dev).scatter_reduce_(
        0, rows[ok], pos[ok], "amin"
    )
    found = first < len(key)
    threshold = torch.zeros(n, dtype=torch.int64, device=dev)
    threshold[found] = key[first[found]]
    return threshold, found


def select(rows, key, weights, n, group, need_of_total):
    """The exact threshold of a cut over its candidates (radix_select's result): the radix
    rounds across a TP group or for many candidates (their passes are linear; a sort of
    131072 keys took ~5x the rounds' time here), else one sort (fewer, smaller steps)."""
    if group.distributed or key.shape[0] > SORT_MAX_ELEMENTS:
        return radix_select(rows, key, weights, n, group, need_of_total)
    return sorted_select(rows, key, weights, n, need_of_total)


def ceil_fraction(p: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """(n, 2) limbs of ceil(p S) for fp32 p and S = the (n, 2) limbs: Python integers."""
    out = []
    for pv, (hi, lo) in zip(p.tolist(), total.tolist(), strict=True):  # the host sync
        num, den = float(pv).as_integer_ratio()
        need = -((-(hi * (1 << BITS) + lo) * num) // den)
        out.append((need >> BITS, need & MASK))
    return torch.tensor(out, dtype=torch.int64, device=total.device).view(-1, 2)
