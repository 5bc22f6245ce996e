"""Processed logprobs: the exact min-p / top-k / top-p cut, the same at any TP degree.

The cut is defined on the fp32 values y of the contract and on its exact masses
q = Q(exp_c(y - M)) (integers on the 2^-84 grid), docs/numerics.md section 13:

    min-p   keep q >= min_p 2^84                  (elementwise, exact limbs)
    top-k   keep y >= the k-th largest y kept      (radix select of counts)
    top-p   keep y >= the largest t whose upper     (radix select of masses)
            set's mass reaches p S

Each radix select runs 4 rounds of 256 bins over a 32-bit key of y that orders like the
values; each round is one int64 all_reduce(SUM) of the bins, exact in any order, so every
rank finds the same thresholds and no rank gathers the vocabulary. Without a TP group a
sort of the candidates finds the same thresholds in fewer steps (_sorted_select). The processed logprob
is then the log-softmax over the kept set: `selected_logprobs` with the keep mask,
summed from the kept columns alone.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
from typing import NamedTuple

import torch

from . import agreement, autograd, contract, distributed, validation
from .api import LogprobResult, eager_only, selected_logprobs
from .backends.base import num_rows, row_view, take_rows
from .call import device_of, make_call

BLOCK_ROWS = 32  # rows cut together: a function of nothing but N, alike on every rank
LARGE_BLOCK_ROWS = 512  # rows cut together where no scan is needed (a function of N alone)
_BITS = 42
_MASK = (1 << _BITS) - 1
_NONE_ID = 1 << 62  # no argmax on this shard
_ROW_NAMES = ("top_k", "top_p", "top_p", "min_p", "min_p", "temperature", "uniforms",
              "uniforms", "uniforms", "uniforms")  # fmt: skip


class SamplingMask(NamedTuple):
    """This rank's kept columns and the cut's compact per-row form (the target's shape):
    a real column j is kept when `y_j >= threshold` and, with `min_p > 0`, its mass
    `q_j >= min_p 2^84` (NaN / +inf columns are kept so that the row is reported bad)."""

    keep_mask: torch.Tensor  # (..., V_local) bool
    threshold: torch.Tensor  # (...) fp32: y threshold (-inf: no top-k / top-p cut)
    min_p: torch.Tensor  # (...) fp32: the min-p applied (0: none)
    row_max: torch.Tensor  # (...) fp32: M, the exact global max of y
    greedy: torch.Tensor  # (...) bool: temperature-0 rows (no cut, y at temperature 1)


class ProcessedLogprobs(LogprobResult):
    """A LogprobResult (three values when unpacked) that also carries which targets lie
    outside the kept set: `dropped` (bool, the target's shape; their logprob is -inf with
    a zero gradient) and `num_dropped` (0-d int64 tensor), and `mask` (SamplingMask,
    built on first read: until then the result keeps the cut and a view of the logits)."""

    dropped: torch.Tensor
    num_dropped: torch.Tensor

    @functools.cached_property
    def mask(self) -> SamplingMask:
        """The cut's SamplingMask, built on first read (the keep mask is (..., V_local))."""
        return self._build_mask()


# --- argument checks ---


def _per_row(name, value, target, dtype):
    if value.dim() != 0 and value.shape != target.shape:
        raise ValueError(
            f"{name} tensor shape {tuple(value.shape)} must be () or equal target shape "
            f"{tuple(target.shape)}"
        )
    if value.device != target.device:
        raise ValueError(f"{name} is on {value.device} but target is on {target.device}")
    return value.detach().expand(target.shape).reshape(-1).to(dtype).contiguous()


def check_top_k(top_k, target):
    """None (no cut) or an int >= 1, or an (N,) int64 tensor (<= 0: no cut in that row)."""
    if top_k is None:
        return None
    if isinstance(top_k, torch.Tensor):
        if top_k.is_floating_point() or top_k.is_complex() or top_k.dtype == torch.bool:
            raise TypeError(f"top_k tensor must have an integer dtype, got {top_k.dtype}")
        k = _per_row("top_k", top_k, target, torch.int64)
        if k.numel() and bool((k < -1).any()):
            raise ValueError(f"top_k must be >= -1 (-1 and 0: no cut), got {int(k.min())}")
        return k
    if isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral):
        raise TypeError(f"top_k must be an int, a tensor or None, got {type(top_k).__name__} "
                        f"{top_k!r}")  # fmt: skip
    if top_k < -1:
        raise ValueError(f"top_k must be >= -1 (-1 and 0: no cut), got {top_k}")
    return None if top_k <= 0 else int(top_k)


def _check_fraction(name, value, target, low_open):
    """None, an fp32-rounded float, or an (N,) fp32 tensor, in (0, 1] or [0, 1]."""
    interval = "(0, 1]" if low_open else "[0, 1]"
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        if not value.is_floating_point():
            raise TypeError(f"{name} tensor must be floating point, got {value.dtype}")
        v = _per_row(name, value, target, torch.float32)
        ok = (v > 0) if low_open else (v >= 0)
        if v.numel() and not bool((ok & (v <= 1)).all()):
            bad = v[~(ok & (v <= 1))][0].item()
            raise ValueError(f"{name} must be in {interval} in float32, got {bad!r}")
        return v
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a float, a tensor or None, got {type(value).__name__}")
    v = contract.fp32_temperature(value)
    if not ((v > 0 if low_open else v >= 0) and v <= 1):
        raise ValueError(f"{name} must be in {interval} in float32, got {value!r}")
    return v


def check_top_p(top_p, target):
    p = _check_fraction("top_p", top_p, target, True)
    return None if isinstance(p, float) and p == 1.0 else p


def check_min_p(min_p, target):
    m = _check_fraction("min_p", min_p, target, False)
    return None if isinstance(m, float) and m == 0.0 else m


def _scalar_field(v, per_row_code, none_code=0):
    if v is None:
        return none_code
    if isinstance(v, torch.Tensor):
        return per_row_code
    return contract.fp32_bits(v) if isinstance(v, float) else int(v)


def _check_temperature(temperature, target):
    """(temperature the contract divides by: a float or (N,) fp32; greedy (N,) bool)."""
    n = target.numel()
    if isinstance(temperature, torch.Tensor):
        t = validation.check_temperature(temperature, target).rows
        greedy = t == 0
        return torch.where(greedy, torch.ones_like(t), t), greedy
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real):
        raise TypeError(f"temperature must be a float or a tensor, got {type(temperature)}")
    if temperature == 0:
        return 1.0, torch.ones(n, dtype=torch.bool, device=target.device)
    validation.check_temperature(temperature, target)
    return contract.fp32_temperature(temperature), torch.zeros(
        n, dtype=torch.bool, device=target.device
    )


# --- integers in two 42-bit limbs (value = hi 2^42 + lo) ---


def _norm(hi, lo):
    return hi + (lo >> _BITS), lo & _MASK  # floor division: exact for negative lo too


def _ge(a_hi, a_lo, b_hi, b_lo):
    a_hi, a_lo = _norm(a_hi, a_lo)
    b_hi, b_lo = _norm(b_hi, b_lo)
    return (a_hi > b_hi) | ((a_hi == b_hi) & (a_lo >= b_lo))


def _min_mass(m: torch.Tensor):
    """ceil(m 2^84) as two limbs, for fp32 m in [0, 1] (exact in binary64)."""
    c = torch.ceil(m.to(torch.float64) * float(1 << 84))
    hi = torch.floor(c * contract.LIMB_UNIT)
    return hi.to(torch.int64), (c - hi * contract.LIMB_SCALE).to(torch.int64)


# --- keys: 32-bit integers that order like the fp32 values (-0 as +0) ---


def _keys(y: torch.Tensor) -> torch.Tensor:
    b = y.view(torch.int32).to(torch.int64)
    b = torch.where(y == 0, torch.zeros_like(b), b)
    return torch.where(b >= 0, b + (1 << 31), -1 - b)


def _key_value(key: torch.Tensor) -> torch.Tensor:
    b = torch.where(key >= (1 << 31), key - (1 << 31), -1 - key)
    return b.to(torch.int32).view(torch.float32)


def _masses(d: torch.Tensor):
    """(hi, lo) int64 limbs of q = Q(exp_c(d)) for binary64 d; 0 outside [-64, 0]."""
    return contract.term_limbs(d)


def _radix_select(rows, keys, weights, n, group, need_of_total):
    """The per-row threshold key t: the largest key whose upper set {key >= t} weighs at
    least need (a row's need from its total, `need_of_total`), by 4 rounds of 256 bins.

    rows, keys: (m,) int64 elements; weights: (m, W) int64 (W = 1: counts; W = 2: limbs).
    Returns (threshold key (n,), found (n,) bool: the row's total reaches its need)."""
    w = weights.shape[1]
    prefix = torch.zeros(n, dtype=torch.int64, device=keys.device)
    need = found = None
    for shift in (24, 16, 8, 0):
        bins = (keys >> shift) & 255
        hist = torch.zeros(n * 256, w, dtype=torch.int64, device=keys.device)
        hist.index_add_(0, rows * 256 + bins, weights)
        hist = distributed.all_reduce_sum_(hist.view(n, 256, w), group)
        cum = hist.flip(1).cumsum(1).flip(1)  # cum[b] = sum over bins >= b
        if need is None:
            need = need_of_total(cum[:, 0])  # (n, W)
        if w == 1:
            ok = cum[..., 0] >= need[:, :1]
        else:
            ok = _ge(cum[..., 0], cum[..., 1], need[:, :1], need[:, 1:])
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
            need = torch.stack(_norm(need[:, 0], need[:, 1]), dim=1)
        prefix = prefix | (b << shift)
        keep = bins == b[rows]
        rows, keys, weights = rows[keep], keys[keep], weights[keep]
    return prefix, found


def _sorted_select(rows, keys, weights, n, need_of_total):
    """_radix_select's result where the whole vocabulary is here (no TP group), in fewer
    steps: each row's elements sorted by key, largest first; the threshold is the key of
    the first element whose running weight (ties or not) reaches the need. No larger t has
    W{key >= t} >= need (those sets hold only elements before it, which weigh less), and
    W{key >= its key} >= need: the largest such t, which the radix rounds find. Returns
    (threshold key (n,), 0 where not found; found (n,) bool)."""
    w = weights.shape[1]
    dev = keys.device
    total = torch.zeros(n, w, dtype=torch.int64, device=dev).index_add_(0, rows, weights)
    need = need_of_total(total)
    order = torch.argsort(rows * (1 << 32) + ((1 << 32) - 1 - keys))  # rows up, keys down
    rows, keys, weights = rows[order], keys[order], weights[order]
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
        ok = _ge(cum[:, 0], cum[:, 1], need[rows, 0], need[rows, 1])
    pos = torch.arange(len(keys), device=dev)
    first = torch.full((n,), len(keys), dtype=torch.int64, device=dev).scatter_reduce_(
        0, rows[ok], pos[ok], "amin"
    )
    found = first < len(keys)
    threshold = torch.zeros(n, dtype=torch.int64, device=dev)
    threshold[found] = keys[first[found]]
    return threshold, found


SORT_MAX_ELEMENTS = 1 << 16  # more candidates than this: the radix rounds (fewer passes)


def _select_threshold(group, count: int):
    """The exact selection of a cut over `count` candidates: the radix rounds across a TP
    group or for many candidates (their passes are linear; a sort of 131072 keys took ~5x
    the rounds' time here), else one sort (fewer, smaller steps)."""
    if group.distributed or count > SORT_MAX_ELEMENTS:
        return lambda *args: _radix_select(*args[:4], group, args[4])
    return _sorted_select


def _ceil_fraction(p: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """(n, 2) limbs of ceil(p S) for fp32 p and S = the (n, 2) limbs: Python integers."""
    out = []
    for pv, (hi, lo) in zip(p.tolist(), total.tolist(), strict=True):  # the host sync
        num, den = float(pv).as_integer_ratio()
        need = -((-(hi * (1 << _BITS) + lo) * num) // den)
        out.append((need >> _BITS, need & _MASK))
    return torch.tensor(out, dtype=torch.int64, device=total.device).view(-1, 2)


# --- the cut ---


class _Setup(NamedTuple):
    """What every block of rows of one cut shares."""

    x: torch.Tensor  # the logits' row_view
    call: object  # the Call
    k: object  # None, an int, or (N,) int64
    p: object  # None, a float, or (N,) fp32
    m: object  # None, a float, or (N,) fp32
    greedy: torch.Tensor  # (N,) bool
    group: object
    start: int  # this rank's vocab_start
    real: torch.Tensor  # (1, V_local) bool: not padding
    padded: bool
    row_max: torch.Tensor  # (N,) fp32, global
    s_full: torch.Tensor | None  # (N, 2) limbs of each row's whole mass (top-p alone)
    cmax: torch.Tensor | None  # (N, chunks) fp32: Backend.chunk_max, for top-k


class _Block(NamedTuple):
    """One block's part of the cut: the kept columns of its cut rows as a list, or where
    that list would outweigh a mask (more than 1 / DENSE_SHARE of the block's columns,
    at ~20 bytes an entry against 1), the block's whole keep mask instead (lists empty)."""

    rows: slice
    r: torch.Tensor  # (K,) int64 row in the block
    c: torch.Tensor  # (K,) int64 local column
    y: torch.Tensor  # (K,) fp32
    cut: torch.Tensor  # (nb,) bool: rows with a cut (the others keep every real column)
    bad: torch.Tensor | None  # (nb, V_local) bool: NaN / +inf real columns (kept), or None
    keep: torch.Tensor | None = None  # (nb, V_local) bool: the block's keep mask, or None


DENSE_SHARE = 32


class _Cut(NamedTuple):
    blocks: list  # _Block per block of rows
    threshold: torch.Tensor  # (N,) fp32
    row_max: torch.Tensor  # (N,) fp32
    argmax: torch.Tensor  # (N,) int64 lowest global id of the max; -1 if none
    dropped: torch.Tensor  # (N,) bool: target outside the kept set
    poison: torch.Tensor  # (N,) bool: the ranks disagree
    check: object  # agreement.RankCheck or None
    y_blocks: list  # per block: (rows slice, y, M as fp64) for sample
    setup: _Setup | None


def _keep_mask(cut: _Cut, n: int, v_local: int, device) -> torch.Tensor:
    """(N, V_local) bool: this rank's kept columns, from the cut's lists."""
    keep = torch.zeros(n, v_local, dtype=torch.bool, device=device)
    for b in cut.blocks:
        if b.keep is not None:
            keep[b.rows] = b.keep
            continue
        kept = keep[b.rows]  # a view
        kept[b.r, b.c] = True
        if b.bad is not None:
            kept |= b.bad
        if not bool(b.cut.all()):
            kept[~b.cut] = cut.setup.real
    return keep


def _at(x: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """x[row, col] of a row_view ((N, V) or (B, T, V) rows) at global rows: no copy of x."""
    if x.dim() == 2:
        return x[rows, cols]
    return x[rows // x.shape[1], rows % x.shape[1], cols]


def _tau_of(call, rows: torch.Tensor):
    """The temperature of each of `rows` (global): the float, or (len,) fp32."""
    t = call.temperature
    return t.scalar if t.rows is None else t.rows[rows]


def _cut(
    logits, target, *, temperature, top_k, top_p, min_p, tp_group, vocab_start, vocab_size,
    ignore_index, validate, backend, uniforms=None, keep_y=False,
):  # fmt: skip
    group = distributed.resolve(tp_group)
    device = device_of(logits, group)

    def build(**_):
        validation.check_logits(logits)
        k = check_top_k(top_k, target)
        p = check_top_p(top_p, target)
        m = check_min_p(min_p, target)
        tau, greedy = _check_temperature(temperature, target)
        fields = dict(
            top_k=_scalar_field(k, -2), top_p=_scalar_field(p, -1), min_p=_scalar_field(m, -1)
        )
        call = make_call(
            source=logits, num_cols=logits.shape[-1], target=target, group=group,
            vocab_start=vocab_start, vocab_size=vocab_size,
            temperature=tau if not isinstance(tau, torch.Tensor) else tau.view(target.shape),
            has_keep_mask=False, ignore_index=ignore_index, with_entropy=False,
            validate=validate, backend=backend, kind=agreement.KIND_SAMPLING,
            extra_fields=fields,
        )  # fmt: skip
        return call, k, p, m, tau, greedy

    built = agreement.checked(group, validate, device, lambda: _Built(build()))
    call, k, p, m, tau, greedy = built.value
    x = row_view(logits.detach())
    n, v_local = num_rows(x), x.shape[-1]
    t = target.reshape(-1).to(torch.int64)
    start, vsize = call.plan.vocab_start, call.plan.vocab_size
    real = contract.valid_columns(v_local, start, vsize, None, x.device)  # (1, V)
    padded = vsize is not None and start + v_local > vsize

    # top-k reads the maxima of chunks of columns; where none is NaN or +inf, the
    # temperature is valid and the largest is not a zero (chunk_max gives +0 for -0), the
    # largest of a row's is its max (one read of the logits for both)
    cmax = None
    if k is not None and n and call.plan.real_columns(v_local):
        cmax = call.backend.chunk_max(x, call.temperature, call.plan, CHUNK)
        local_max = cmax.amax(1)
        clean = (cmax < float("inf")).all(1) & (local_max != 0)
        bad_tau = call.temperature.bad()
        if bad_tau is not None:
            clean &= ~bad_tau
        if not bool(clean.all()):
            other = call.backend.row_max(x, call.temperature, None, call.plan)
            local_max = torch.where(clean, local_max, other)
    else:
        local_max = call.backend.row_max(x, call.temperature, None, call.plan)

    # the max, with every rank's per-row parameters in the agreement's (v, -v) pairs
    check = None
    if group.distributed:
        row_fields = _row_fields(n, k, p, m, greedy, uniforms, x.device)
        payload = agreement.max_payload(
            local_max, t, call.temperature, call.call_key, group, call.layout, row_fields
        )
        reduced = distributed.all_reduce_max_(payload, group)
        row_max, check = agreement.read_max(reduced, n, group, vsize, row_fields)
        if bool(check.poison.any()):  # alike on every rank: every rank stops here
            if validate:
                raise ValueError(_ranks_text(check, target.shape))
            return _poisoned(n, x.device, check), None
    else:
        row_max = local_max
    row_max = row_max.contiguous()

    setup = _Setup(
        x, call, k, p, m, greedy, group, start, real, padded, row_max,
        _full_masses(x, t, call, row_max, greedy, k, p, m, group), cmax,
    )  # fmt: skip
    threshold = torch.full((n,), float("-inf"), dtype=torch.float32, device=x.device)
    local_arg = torch.full((n,), _NONE_ID, dtype=torch.int64, device=x.device)
    blocks, ys = [], []
    # a block first tries the shortcut on LARGE_BLOCK_ROWS rows at once, and where it does
    # not apply (with a TP group: on any rank) its blocks of BLOCK_ROWS are cut: blocks that
    # are a function of N alone, so that every rank meets the same collectives
    step = BLOCK_ROWS if keep_y else LARGE_BLOCK_ROWS
    for s in range(0, n, step):
        rows = slice(s, min(s + step, n))
        done = _cut_block(setup, rows, keep_y, scan=step == BLOCK_ROWS)
        if done is None:  # the large block needs a scan: its blocks of BLOCK_ROWS do it
            small = range(rows.start, rows.stop, BLOCK_ROWS)
            parts = [slice(a, min(a + BLOCK_ROWS, rows.stop)) for a in small]
            done = [_cut_block(setup, part, keep_y, scan=True) for part in parts]
        for block, thr_key, arg, y in [done] if isinstance(done, tuple) else done:
            part = block.rows
            blocks.append(block)
            local_arg[part] = arg
            threshold[part] = torch.where(thr_key > 0, _key_value(thr_key), threshold[part])
            if keep_y:
                ys.append((part, y, row_max[part].to(torch.float64)))

    # the lowest argmax id and whether the owner cut the target: one int64 MAX
    owned = contract.owned_target_columns(t, start, v_local, vsize, ignore_index)
    kept = _kept_at(blocks, owned, setup)
    flags = torch.stack([-local_arg, ((owned >= 0) & ~kept).to(torch.int64)])
    flags = distributed.all_reduce_max_(flags, group)
    argmax = torch.where(flags[0] == -_NONE_ID, -1, -flags[0])
    poison = torch.zeros(n, dtype=torch.bool, device=x.device)
    cut = _Cut(blocks, threshold, row_max, argmax, flags[1] > 0, poison, check, ys, setup)
    return cut, (call, k, p, m, tau, greedy)


def _kept_at(blocks, owned: torch.Tensor, setup: _Setup) -> torch.Tensor:
    """(N,) bool: whether each row's column `owned` (-1: none) is kept on this rank."""
    n = owned.shape[0]
    hit = torch.zeros(n, dtype=torch.bool, device=owned.device)
    for b in blocks:
        g = b.r + b.rows.start
        at = b.c == owned[g]
        hit[g[at]] = True
        rows = torch.arange(b.rows.start, b.rows.stop, device=owned.device)
        mine = owned[b.rows]
        at_mine = mine.clamp(min=0).unsqueeze(-1)
        whole = ~b.cut & (mine >= 0)
        for mask in (b.bad, b.keep):
            if mask is not None:
                whole |= (mine >= 0) & mask.gather(1, at_mine).squeeze(-1)
        hit[rows[whole]] = True
    return hit


def _cut_block(su: _Setup, rows: slice, keep_y: bool, scan: bool):
    """The cut of one block of rows: (_Block, the threshold keys (nb,) (0: none), the
    lowest local argmax id + start (nb,), the block's y when keep_y); None where the
    block would need a scan of all its columns and `scan` is False."""
    x, k, p, m = su.x, su.k, su.p, su.m
    dev = x.device
    nb = rows.stop - rows.start
    mx = su.row_max[rows]
    mx64 = mx.to(torch.float64)
    cut_row = ~su.greedy[rows] & torch.isfinite(mx)
    off = torch.zeros(nb, dtype=torch.bool, device=dev)
    mv = kv = pv = None
    m_on = k_on = p_on = off
    if m is not None:
        mv = _rows_of(m, rows, nb, dev, torch.float32)
        m_on = cut_row & (mv > 0)
    if k is not None:
        kv = _rows_of(k, rows, nb, dev, torch.int64)
        k_on = cut_row & (kv > 0)
    if p is not None:
        pv = _rows_of(p, rows, nb, dev, torch.float32)
        p_on = cut_row & (pv < 1)
    any_on = m_on | k_on | p_on
    thr_key = torch.zeros(nb, dtype=torch.int64, device=dev)  # key 0: below -inf
    arg = torch.full((nb,), _NONE_ID, dtype=torch.int64, device=dev)
    empty = torch.zeros(0, dtype=torch.int64, device=dev)
    r, c, yc = empty, empty, torch.zeros(0, dtype=torch.float32, device=dev)
    y = ok = bad = None
    if bool(any_on.any()):  # alike on every rank: the rounds are collectives
        # rows with top-p alone: S is the whole row's mass (s_full); their columns start
        # above M - 16, and a row whose columns there do not reach p S (found is False,
        # alike on every rank) is cut again from all its columns
        pure = p_on & ~k_on & ~m_on
        relax = off.clone()
        fast = None
        if su.cmax is not None:
            fast = _topk_candidates(su, rows, kv, k_on & ~m_on, any_on)
        if not scan and su.group.distributed:  # every rank takes the shortcut, or none
            flag = torch.full((1,), float(fast is None), device=dev)
            if bool(distributed.all_reduce_max_(flag, su.group)[0] > 0):
                return None
        if fast is None:
            if not scan:
                return None
            y, ok, bad = _scan(su, rows)
        while True:
            if fast is not None:
                r, c, yc = fast
            else:
                floor = _floors(y, ok, mx64, mv if m is not None else False, m_on,
                                kv if k is not None else False, k_on)  # fmt: skip
                near = (mx64 - 16.0).to(torch.float32)
                floor = torch.where(pure & ~relax, near, floor)
                floor = torch.where(any_on, floor, float("inf"))  # no cut: no column
                sel = y >= floor.unsqueeze(-1)
                r, c = torch.nonzero(sel if ok is None else sel & ok, as_tuple=True)
                yc = y[r, c]
            # the lowest id of the max: every value equal to M is above every floor
            at = yc == mx[r]
            arg = torch.full((nb,), _NONE_ID, dtype=torch.int64, device=dev).scatter_reduce_(
                0, r[at], c[at] + su.start, "amin"
            )
            r, c, yc, thr_key, retry = _select(
                su, rows, (r, c, yc), mx, (mv, kv, pv), (m_on, k_on, p_on), (pure, relax)
            )
            if fast is None and bool(retry.any()):
                relax |= retry
                continue
            break
    if keep_y and y is None:
        y, ok, bad = _scan(su, rows)
    need_arg = ~any_on & torch.isfinite(mx) if keep_y else None
    if x.shape[-1] and need_arg is not None and bool(need_arg.any()):  # rows without a cut
        ycl = y if ok is None else torch.where(ok, y, float("-inf"))
        a = ycl.argmax(-1)
        at = ycl.gather(1, a.unsqueeze(-1)).squeeze(-1) == mx
        arg = torch.where(at & need_arg, a + su.start, arg)
    if bad is not None and not bool(bad.any()):
        bad = None
    block = _Block(rows, r, c, yc, any_on, bad)
    if r.numel() > nb * x.shape[-1] // DENSE_SHARE:  # a wide kept set: the mask is smaller
        keep = torch.zeros(nb, x.shape[-1], dtype=torch.bool, device=dev)
        keep[r, c] = True
        if bad is not None:
            keep |= bad
        keep[~any_on] = su.real
        none = torch.zeros(0, dtype=torch.float32, device=dev)  # not yc[:0]: a view of it
        block = _Block(rows, empty, empty, none, any_on, None, keep)
    return block, thr_key, arg, y if keep_y else None  # a big-block caller holds them all


def _scan(su: _Setup, rows: slice):
    """The block's y (nb, V_local) fp32, and where NaN / +inf or padding occur the masks
    (ok: real and finite or -inf; bad: real and NaN or +inf), else None, None."""
    tau = su.call.temperature.take(rows).column()
    y = contract.scaled_logits(take_rows(su.x, rows), tau)
    # amax is NaN or +inf exactly when one is present
    if su.padded or y.shape[-1] == 0 or not bool(y.amax() < float("inf")):
        lt = y < float("inf")  # finite or -inf
        return y, lt & su.real, su.real & ~lt
    return y, None, None


def _select(su: _Setup, rows: slice, cand, mx, values, on, pure_relax):
    """min-p, then top-k, then top-p on the candidates (r, c, yc) of a block: the kept
    ones, the threshold keys (nb,), and the top-p-alone rows (`pure`, not yet `relax`ed)
    whose candidates did not reach p S (to cut again from all their columns)."""
    r, c, yc = cand
    mv, kv, pv = values
    m_on, k_on, p_on = on
    pure, relax = pure_relax
    nb = rows.stop - rows.start
    dev = yc.device
    mx64 = mx.to(torch.float64)
    thr_key = torch.zeros(nb, dtype=torch.int64, device=dev)
    retry = torch.zeros(nb, dtype=torch.bool, device=dev)
    if mv is not None:  # min-p on the exact masses
        mh, ml = _min_mass(mv)
        qh, ql = _masses(yc.to(torch.float64) - mx64[r])
        alive = ~m_on[r] | _ge(qh, ql, mh[r], ml[r])
        r, c, yc = r[alive], c[alive], yc[alive]
    key = _keys(yc)
    if kv is not None:  # top-k: counts
        sel = k_on[r]
        ones = torch.ones(int(sel.sum()), 1, dtype=torch.int64, device=dev)
        tk, found = _select_threshold(su.group, len(ones))(
            r[sel], key[sel], ones, nb, lambda total: kv.view(-1, 1)
        )
        thr_key = torch.where(k_on & found, tk, thr_key)
        alive = key >= thr_key[r]
        r, c, yc, key = r[alive], c[alive], yc[alive], key[alive]
    if pv is None:
        return r, c, yc, thr_key, retry
    # top-p: masses
    sel = p_on[r]
    qh, ql = _masses(yc[sel].to(torch.float64) - mx64[r[sel]])
    whole = su.s_full[rows] if su.s_full is not None else None

    def need(total):
        if whole is not None:
            total = torch.where(pure.unsqueeze(-1), whole, total)
        return _ceil_fraction(pv, total)

    weights = torch.stack([qh, ql], 1)
    tp, found = _select_threshold(su.group, len(weights))(r[sel], key[sel], weights, nb, need)
    retry = p_on & pure & ~found & ~relax
    thr_key = torch.where(p_on & found, torch.maximum(tp, thr_key), thr_key)
    alive = key >= thr_key[r]
    return r[alive], c[alive], yc[alive], thr_key, retry


class _Built:
    """agreement.checked wants an object with `.fields` and `.layout` (a Call's)."""

    def __init__(self, value):
        self.value = value
        self.fields = value[0].fields
        self.layout = value[0].layout


def _full_masses(x, t, call, row_max, greedy, k, p, m, group):
    """(N, 2) int64 limbs of each row's whole mass S (the backend's partials pass and one
    int64 SUM) when some row has a top-p cut alone; else None (alike on every rank)."""
    if p is None:
        return None
    n = row_max.shape[0]
    cut_row = ~greedy & torch.isfinite(row_max)
    pure = cut_row & (_rows_of(p, slice(0, n), n, x.device, torch.float32) < 1)
    if k is not None:
        pure &= ~(_rows_of(k, slice(0, n), n, x.device, torch.int64) > 0)
    if m is not None:
        pure &= ~(_rows_of(m, slice(0, n), n, x.device, torch.float32) > 0)
    if not bool(pure.any()):
        return None
    record = call.backend.partials(x, t, call.temperature, None, row_max, call.plan)
    whole = record[:, [contract.COL_E_HI, contract.COL_E_LO]].contiguous()
    return distributed.all_reduce_sum_(whole, group)


def _rows_of(value, rows, nb, device, dtype):
    """A parameter's values for a block of rows: (nb,) of the per-row tensor or the scalar."""
    if isinstance(value, torch.Tensor):
        return value[rows]
    return torch.full((nb,), value, dtype=dtype, device=device)


CHUNK = 128  # columns per chunk of the top-k shortcut
CANDIDATE_CHUNKS = 4  # the shortcut reads at most this many chunks per row and unit of k


def _topk_candidates(su: _Setup, rows: slice, kv, rows_k, any_on):
    """The columns top-k can keep, found from the maxima of chunks of CHUNK columns
    (Backend.chunk_max): the k-th largest chunk maximum is a value that k distinct
    columns reach, so the k-th largest y is not below it, and every column at or above it
    lies in a chunk whose maximum is. Returns (rows, columns, y) of every column whose y
    is >= that value, or None when the shortcut does not apply (a row with another cut,
    fewer than 2k chunks, or a NaN or +inf in the block: then the caller scans it)."""
    if not bool((rows_k == any_on).all()):
        return None
    cy = su.cmax[rows]
    chunks = cy.shape[1]
    kmax = int(kv[rows_k].max())
    if chunks < 2 * kmax or not bool((cy < float("inf")).all()):
        return None
    bad_tau = su.call.temperature.bad()  # y of a bad temperature is not monotonic in x
    if bad_tau is not None and bool(bad_tau[rows].any()):
        return None
    vals = torch.topk(cy, kmax, dim=-1).values  # sorted, largest first
    kth = vals.gather(1, (kv.clamp(1, kmax) - 1).unsqueeze(-1))
    if bool((rows_k & (kth[:, 0] == float("-inf"))).any()):
        return None  # fewer than k chunks with a finite value: every column would pass
    kth = torch.where(rows_k.unsqueeze(-1), kth, float("inf"))
    rr, cc = torch.nonzero(cy >= kth, as_tuple=True)
    if rr.numel() > CANDIDATE_CHUNKS * kmax * cy.shape[0]:
        return None  # ties across many chunks: the block's scan keeps memory bounded
    x, dev = su.x, cy.device
    real = su.call.plan.real_columns(x.shape[-1])
    full = real // CHUNK
    tail = cc == full  # the last, partial chunk
    out_r, out_c, out_y = [], [], []
    for part, width in ((~tail, CHUNK), (tail, real - full * CHUNK)):
        r, ch = rr[part], cc[part]
        if r.numel() == 0:
            continue
        g = r + rows.start
        if width == CHUNK:
            vals = _whole_chunks(x, g, ch)
        else:
            col = full * CHUNK + torch.arange(width, device=dev)
            vals = _at(x, g.unsqueeze(-1), col.unsqueeze(0))
        tau = _tau_of(su.call, g)
        # a first filter on the logits themselves (no conversion of every value), then
        # y of the few that pass
        at = (vals >= _raw_floor(kth[r], tau, vals.dtype)).view(-1).nonzero().squeeze(1)
        piece = at // width
        y = contract.scaled_logits(
            vals.view(-1)[at], tau[piece] if isinstance(tau, torch.Tensor) else tau
        )
        hit = y >= kth[r[piece], 0]
        at, piece = at[hit], piece[hit]
        out_r.append(r[piece])
        out_c.append(ch[piece] * CHUNK + at % width)
        out_y.append(y[hit])
    if not out_r:
        empty = torch.zeros(0, dtype=torch.int64, device=dev)
        return empty, empty, torch.zeros(0, dtype=torch.float32, device=dev)
    return torch.cat(out_r), torch.cat(out_c), torch.cat(out_y)


def _whole_chunks(x: torch.Tensor, rows: torch.Tensor, chunks: torch.Tensor) -> torch.Tensor:
    """(m, CHUNK) logits of whole chunk `chunks[i]` of global row `rows[i]` of a row_view:
    one copy of CHUNK contiguous values per chunk (index_select over an overlapping view
    of the logits' memory, as integers of their width), not one index per value."""
    if x.stride(-1) != 1:
        view = x.unfold(-1, CHUNK, CHUNK)  # (..., chunks, CHUNK)
        if x.dim() == 2:
            return view[rows, chunks]
        return view[rows // x.shape[1], rows % x.shape[1], chunks]
    if x.dim() == 2:
        start = rows * x.stride(0)
    else:
        start = (rows // x.shape[1]) * x.stride(0) + (rows % x.shape[1]) * x.stride(1)
    start = start + chunks * CHUNK
    extent = 1 + sum((n - 1) * st for n, st in zip(x.shape, x.stride(), strict=True))
    bits = x.view(_SAME_WIDTH[x.element_size()])
    windows = bits.as_strided((extent - CHUNK + 1, CHUNK), (1, 1), x.storage_offset())
    return torch.index_select(windows, 0, start).view(x.dtype)


_SAME_WIDTH = {2: torch.int16, 4: torch.int32}


def _raw_floor(kth: torch.Tensor, tau, dtype: torch.dtype) -> torch.Tensor:
    """(m, 1) in the logits' dtype: a bound below which no logit x has y = fl(x / tau) >=
    kth. IEEE division is off by at most 2^-24 relative (2^-150 absolute below the normal
    range), so y >= kth needs x >= tau kth - tau |kth| 2^-24 - tau 2^-150; the bound is
    taken 2^-6 relative and 2^-20 (fp16) or 2^-120 absolute lower still, so that rounding
    it to the dtype (half an ulp: 2^-9 relative at most; 2^-25 / 2^-134 absolute in the
    subnormals) keeps it below. +-inf stay as they are."""
    t = tau.unsqueeze(-1).to(torch.float64) if isinstance(tau, torch.Tensor) else tau
    b = kth.to(torch.float64) * t
    tiny = (2.0**-20 if dtype == torch.float16 else 2.0**-120) * (
        t.clamp(min=1.0) if isinstance(t, torch.Tensor) else max(t, 1.0)
    )
    low = torch.where(torch.isfinite(b), b - b.abs() * 2.0**-6 - tiny, b)
    return low.to(dtype)


def _floors(y, ok, mx64, mv, m_on, kv, k_on):
    """(nb,) fp32 per-row lower bounds of the values the exact cut can keep (a superset:
    the exact steps decide). min-p: q >= m 2^84 needs y - M >= log m - tiny (exp_c is
    within 2^-51 of exp, the grid adds 2^-85); the bound is taken 2^-10 (1 + |M| + |log m|)
    lower. top-k without min-p: the k-th largest y of this shard (the global k-th largest
    is not below it). -inf where neither applies."""
    nb = y.shape[0]
    floor = torch.full((nb,), float("-inf"), dtype=torch.float64, device=y.device)
    if mv is not False:
        lm = torch.log(mv.to(torch.float64).clamp(min=1e-300))
        bound = mx64 + lm - (1.0 + mx64.abs() + lm.abs()) * 2.0**-10
        usable = m_on & (mv >= 2.0**-40)
        floor = torch.where(usable, bound, floor)
    if kv is not False:
        rows_k = k_on & ~m_on
        if bool(rows_k.any()):
            kmax = int(kv[rows_k].max())
            if kmax <= y.shape[1] // 4:
                ycl = y if ok is None else torch.where(ok, y, float("-inf"))
                vals = torch.topk(ycl, kmax, dim=-1, sorted=True).values
                lk = vals.gather(1, (kv.clamp(1, kmax) - 1).unsqueeze(-1)).squeeze(-1)
                floor = torch.where(rows_k, lk.to(torch.float64), floor)
    return floor.to(torch.float32)


def _row_fields(n, k, p, m, greedy, uniforms, device):
    """(k, N) per-row integers below 2^24 for the agreement: top_k, the 16-bit halves of
    the fp32 bits of top_p and min_p, whether the row is greedy (temperature 0), and the
    16-bit pieces of the float64 bits of the uniforms."""
    parts = []
    kk = k if isinstance(k, torch.Tensor) else torch.full((n,), 0 if k is None else k)
    parts.append(kk.to(device).clamp(-1, 1 << 23))
    for v in (p, m):
        vv = v if isinstance(v, torch.Tensor) else torch.full((n,), 0.0 if v is None else v)
        bits = vv.to(device, torch.float32).view(torch.int32).to(torch.int64)
        parts += [(bits >> 16) & 0xFFFF, bits & 0xFFFF]
    parts.append(greedy.to(device, torch.int64))
    if uniforms is not None:
        bits = uniforms.view(torch.int64)
        parts += [(bits >> s) & 0xFFFF for s in (48, 32, 16, 0)]
    return torch.stack(parts).to(torch.float32)


def _ranks_text(check, shape) -> str:
    rows = torch.nonzero(check.rows).flatten()
    if len(rows):
        r = int(rows[0])
        field = int(torch.nonzero(check.differs[:, r])[0])
        names = agreement.ROW_FIELD_NAMES[:3] + _ROW_NAMES
        idx = list(torch.unravel_index(torch.tensor(r), tuple(shape))) if shape else []
        where = "[" + ", ".join(str(int(i)) for i in idx) + "]"
        return (
            f"the ranks of tp_group disagree on the {names[field]} of row{where}: every "
            "rank must pass the same rows, targets, temperatures and sampling parameters"
        )
    return "the ranks of tp_group disagree on the call (its options or the vocab shards)"


def _poisoned(n, device, check) -> _Cut:
    nan = torch.full((n,), float("nan"), dtype=torch.float32, device=device)
    return _Cut(
        [], nan, nan, torch.full((n,), -1, dtype=torch.int64, device=device),
        torch.zeros(n, dtype=torch.bool, device=device),
        torch.ones(n, dtype=torch.bool, device=device), check, [], None,
    )  # fmt: skip


def _mask_result(cut: _Cut, logits, target, options) -> SamplingMask:
    shape = tuple(target.shape)
    device = cut.threshold.device
    if options is None:
        m = torch.full(shape, float("nan"), device=device)
        greedy = torch.zeros(shape, dtype=torch.bool, device=device)
    else:
        mv = options[3]
        m = (
            mv.view(shape)
            if isinstance(mv, torch.Tensor)
            else torch.full(shape, 0.0 if mv is None else mv, device=device)
        )
        greedy = options[5].view(shape)
        m = torch.where(greedy, torch.zeros_like(m), m)
    keep = _keep_mask(cut, target.numel(), logits.shape[-1], device)
    return SamplingMask(
        keep.view(*shape, logits.shape[-1]), cut.threshold.view(shape), m,
        cut.row_max.view(shape), greedy,
    )  # fmt: skip


# --- public functions ---


@eager_only
def sampling_mask(
    vocab_parallel_logits: torch.Tensor,
    *,
    temperature: float | torch.Tensor = 1.0,
    top_k: int | torch.Tensor | None = None,
    top_p: float | torch.Tensor | None = None,
    min_p: float | torch.Tensor | None = None,
    tp_group=None,
    vocab_start: int | None = None,
    vocab_size: int | None = None,
    validate: bool = True,
) -> SamplingMask:
    """This rank's columns of the exact min-p / top-k / top-p cut (docs/numerics.md §13).

    Parameters as `processed_logprobs`; each sampling parameter a scalar or one per row
    (a tensor shaped like the logits without their last dimension). Returns a
    SamplingMask: the keep mask and the per-row compact form."""
    rows = vocab_parallel_logits.shape[:-1]
    target = torch.zeros(rows, dtype=torch.int64, device=vocab_parallel_logits.device)
    group = distributed.resolve(tp_group)
    with distributed.serialized(group):
        cut, options = _cut(
            vocab_parallel_logits, target, temperature=temperature, top_k=top_k, top_p=top_p,
            min_p=min_p, tp_group=tp_group, vocab_start=vocab_start, vocab_size=vocab_size,
            ignore_index=-1, validate=validate, backend="auto",
        )  # fmt: skip
    return _mask_result(cut, vocab_parallel_logits, target, options)


@eager_only
def processed_logprobs(
    vocab_parallel_logits: torch.Tensor,
    target: torch.Tensor,
    *,
    temperature: float | torch.Tensor = 1.0,
    top_k: int | torch.Tensor | None = None,
    top_p: float | torch.Tensor | None = None,
    min_p: float | torch.Tensor | None = None,
    tp_group=None,
    vocab_start: int | None = None,
    vocab_size: int | None = None,
    ignore_index: int = -100,
    with_entropy: bool = False,
    validate: bool = True,
    backend="auto",
) -> ProcessedLogprobs:
    """The log-softmax over the kept set of the exact cut (temperature, min-p, top-k,
    top-p; docs/numerics.md §13): what a sampler with these parameters draws from.

    Args as `selected_logprobs`, plus:
        temperature: a float or one per row; 0 is a greedy row (no cut, temperature 1).
        top_k: int (None, 0, -1: no cut; k larger than the vocabulary keeps all).
        top_p: float in (0, 1] (None, 1: no cut).
        min_p: float in [0, 1] (None, 0: no cut).

    A target outside the kept set gives logprob -inf with a zero gradient and is counted
    in `result.num_dropped` (`result.dropped` per row); `validate=True` does not raise on
    it (data, not a bad call). Unpacks as (logprobs, entropy, lse).

    Sampling parameters outside their range raise ValueError (TypeError for a wrong type)
    whatever `validate` is; per-row tensors are checked with a host sync. Per-row values
    that differ between the ranks of `tp_group` raise on every rank (validate=True) or
    give NaN everywhere (validate=False), as for `selected_logprobs`.
    """
    group = distributed.resolve(tp_group)
    with distributed.serialized(group):
        cut, options = _cut(
            vocab_parallel_logits, target, temperature=temperature, top_k=top_k, top_p=top_p,
            min_p=min_p, tp_group=tp_group, vocab_start=vocab_start, vocab_size=vocab_size,
            ignore_index=ignore_index, validate=validate, backend=backend,
        )  # fmt: skip
    shape = tuple(target.shape)

    def mask():
        return _mask_result(cut, vocab_parallel_logits, target, options)

    if options is None:  # the ranks disagree (validate=False): NaN everywhere
        res = selected_logprobs(
            vocab_parallel_logits, target, tp_group=tp_group, vocab_start=vocab_start,
            vocab_size=vocab_size, ignore_index=ignore_index, with_entropy=with_entropy,
            validate=False, backend=backend,
        )  # fmt: skip
        nan = torch.full(shape, float("nan"), device=res.lse.device)
        out = ProcessedLogprobs(
            res.logprobs * nan, None if res.entropy is None else res.entropy * nan,
            res.lse * nan,
        )  # fmt: skip
        return _with_cut(out, torch.zeros(shape, dtype=torch.bool, device=nan.device), mask)
    t = target.reshape(-1).to(torch.int64)
    dropped = cut.dropped
    t_used = torch.where(dropped, cut.argmax, t)
    su = cut.setup
    call = dataclasses.replace(
        su.call, plan=dataclasses.replace(su.call.plan, with_entropy=with_entropy)
    )
    with distributed.serialized(group):
        if torch.is_grad_enabled() and vocab_parallel_logits.requires_grad:
            rows = row_view(vocab_parallel_logits)
            lp, entropy, lse = _ProcessedFunction.apply(rows, cut, t_used, call, validate)
        else:
            fin = _processed_forward(cut, t_used, call, validate).fin
            lp, entropy, lse = fin.logprobs, fin.entropy, fin.lse
    lp, lse = lp.view(shape), lse.view(shape)
    entropy = entropy.view(shape) if with_entropy else None
    dropped = dropped.view(shape)
    lp = torch.where(dropped & ~torch.isnan(lp), float("-inf"), lp)  # a bad row stays NaN
    return _with_cut(ProcessedLogprobs(lp, entropy, lse), dropped, mask)


def _with_cut(out: ProcessedLogprobs, dropped, mask) -> ProcessedLogprobs:
    """`out` with its dropped targets and its SamplingMask (or what builds it on first
    read of `out.mask`)."""
    out.dropped = dropped
    out.num_dropped = dropped.sum()
    if isinstance(mask, SamplingMask):
        out.__dict__["mask"] = mask
    else:
        out._build_mask = mask
    return out


def _processed_forward(cut: _Cut, target, call, validate: bool) -> autograd.Forward:
    """The log-softmax over the kept set, from the kept lists: the record of a cut row
    sums its kept columns' terms (exact integers, so the order and the columns left out,
    whose terms are not in the sum, change nothing), the same record as the partials pass
    over the keep mask; rows without a cut take that pass. `call`: the cut's, with the
    caller's with_entropy."""
    su = cut.setup
    x, plan = su.x, call.plan
    n, v_local = target.shape[0], x.shape[-1]
    m64 = su.row_max.to(torch.float64)
    if any(b.keep is not None for b in cut.blocks):  # wide kept sets: the mask's pass
        keep = _keep_mask(cut, n, v_local, x.device).view(x.shape)
        record = call.backend.partials(x, target, call.temperature, keep, su.row_max, plan)
        return _finish_record(cut, record, target, call, validate)
    if all(bool(b.cut.all()) for b in cut.blocks):
        record = torch.zeros(n, contract.NUM_COLS, dtype=torch.int64, device=x.device)
        owned = plan.target_columns(target, v_local)
        g = torch.nonzero(owned >= 0).flatten()
        tau = _tau_of(call, g)
        y_t = contract.scaled_logits(_at(x, g, owned[g]), tau)
        record[g, contract.COL_TARGET_BITS] = y_t.view(torch.int32).to(torch.int64)
        record[:, contract.COL_OWNERS] = (owned >= 0).to(torch.int64)
    else:
        record = call.backend.partials(x, target, call.temperature, None, su.row_max, plan)
        owned = plan.target_columns(target, v_local)
    kept = _kept_at(cut.blocks, owned, su)
    record[:, contract.COL_TARGET_MASKED] = ((owned >= 0) & ~kept).to(torch.int64)
    cols = [contract.COL_E_HI, contract.COL_E_LO, contract.COL_W_HI, contract.COL_W_LO]
    with_entropy = plan.with_entropy
    cols = cols[: 4 if with_entropy else 2]
    for b in cut.blocks:
        if not bool(b.cut.any()):
            continue
        nb = b.rows.stop - b.rows.start
        limbs = contract.term_limbs(b.y.to(torch.float64) - m64[b.r + b.rows.start], with_entropy)
        sums = torch.zeros(nb, len(cols), dtype=torch.int64, device=x.device)
        sums.index_add_(0, b.r, torch.stack(limbs, 1))
        part = record[b.rows]  # a view
        for i, col in enumerate(cols):
            part[:, col] = torch.where(b.cut, sums[:, i], part[:, col])
        nonfinite = b.bad.sum(1) if b.bad is not None else torch.zeros_like(sums[:, 0])
        part[:, contract.COL_NONFINITE] = torch.where(
            b.cut, nonfinite, part[:, contract.COL_NONFINITE]
        )
    return _finish_record(cut, record, target, call, validate)


def _finish_record(cut: _Cut, record, target, call, validate: bool) -> autograd.Forward:
    """Stages 6-7 of the processed forward: the record summed over the ranks, finalized,
    and (validate=True) the bad-row check."""
    su, plan = cut.setup, call.plan
    if su.group.distributed and target.shape[0]:
        distributed.all_reduce_sum_(record, su.group)
    ranks = cut.check
    fin = call.backend.finalize(
        su.row_max, record, target, plan.vocab_size, plan.ignore_index,
        call.temperature.bad(), None if ranks is None else ranks.poison,
    )  # fmt: skip
    if validate:
        validation.raise_for_bad_rows(fin.bad, record, target, call, ranks)
    return autograd.Forward(su.row_max, fin, record, ranks)


class _ProcessedFunction(torch.autograd.Function):
    """_processed_forward, and in backward the gradient of selected_logprobs over the keep
    mask (backend.grad from the same row statistics: the same bits), the mask built then."""

    @staticmethod
    def forward(ctx, logits, cut, target, call, validate):
        ctx.call, ctx.cut = call, cut
        return autograd.save_forward(
            ctx, (logits, target), _processed_forward(cut, target, call, validate)
        )

    @staticmethod
    @autograd.once_differentiable
    def backward(ctx, g_logprobs, g_entropy, g_lse):
        inputs, stats, temperature = autograd.saved_grad_stats(ctx, (g_logprobs, g_entropy, g_lse))
        logits, target = inputs
        call = ctx.call
        keep = _keep_mask(ctx.cut, target.shape[0], logits.shape[-1], logits.device)
        grad = call.backend.grad(
            logits, target, temperature, keep.view(logits.shape), stats, call.plan
        )
        return grad.view(logits.shape), None, None, None, None


@eager_only
def sample(
    vocab_parallel_logits: torch.Tensor,
    *,
    generator: torch.Generator | None = None,
    uniforms: torch.Tensor | None = None,
    temperature: float | torch.Tensor = 1.0,
    top_k: int | torch.Tensor | None = None,
    top_p: float | torch.Tensor | None = None,
    min_p: float | torch.Tensor | None = None,
    tp_group=None,
    vocab_start: int | None = None,
    vocab_size: int | None = None,
    validate: bool = True,
) -> torch.Tensor:
    """Token ids (the logits' shape without the last dimension, int64, alike on every
    rank) drawn from the exact processed distribution by the inverse CDF on the exact
    masses (docs/numerics.md §13): the token is a function of the logits' bits and the
    uniform. `uniforms`: float64 in [0, 1), one per row; else drawn from `generator`
    (every rank must draw the same: seed it alike). Greedy rows (temperature 0) give the
    argmax, the lowest id on ties. -1 where the ranks disagree (validate=False) or a row
    has no finite value."""
    rows = vocab_parallel_logits.shape[:-1]
    device = vocab_parallel_logits.device
    if uniforms is None:
        if generator is not None and not isinstance(generator, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator, got {type(generator)}")
        uniforms = torch.rand(rows, dtype=torch.float64, generator=generator, device=device)
    elif not isinstance(uniforms, torch.Tensor) or uniforms.dtype != torch.float64:
        raise TypeError(f"uniforms must be a float64 tensor, got {_describe(uniforms)}")
    elif tuple(uniforms.shape) != tuple(rows):
        raise ValueError(f"uniforms shape {tuple(uniforms.shape)} must be {tuple(rows)}")
    elif uniforms.numel() and not bool(((uniforms >= 0) & (uniforms < 1)).all()):
        raise ValueError("uniforms must lie in [0, 1)")
    u = uniforms.reshape(-1).contiguous()
    target = torch.zeros(rows, dtype=torch.int64, device=device)
    group = distributed.resolve(tp_group)
    with distributed.serialized(group):
        cut, options = _cut(
            vocab_parallel_logits, target, temperature=temperature, top_k=top_k, top_p=top_p,
            min_p=min_p, tp_group=tp_group, vocab_start=vocab_start, vocab_size=vocab_size,
            ignore_index=-1, validate=validate, backend="auto", uniforms=u, keep_y=True,
        )  # fmt: skip
        if options is None:
            return cut.argmax.view(rows)
        return _draw(cut, options, u, group, vocab_parallel_logits).view(rows)


def _describe(v) -> str:
    if isinstance(v, torch.Tensor):
        return f"a {v.dtype} tensor of shape {tuple(v.shape)}"
    return type(v).__name__


def _draw(cut: _Cut, options, u, group, logits) -> torch.Tensor:
    """Inverse CDF over global ids on the exact masses of the kept set."""
    greedy = options[5]
    device = cut.threshold.device
    out = cut.argmax.clone()
    size = group.size
    keep = _keep_mask(cut, out.shape[0], logits.shape[-1], device)
    start = cut.setup.start
    for rows, y, mx64 in cut.y_blocks:
        kept = keep[rows]
        nb = y.shape[0]
        r, c = torch.nonzero(kept & (y < float("inf")), as_tuple=True)  # row-major: ids ascend
        qh, ql = _masses(y[r, c].to(torch.float64) - mx64[r])
        # every rank's mass per row, and its vocab_start in the extra row: one int64 SUM
        tot = torch.zeros(size, nb + 1, 2, dtype=torch.int64, device=device)
        tot[group.rank, :nb, 0].index_add_(0, r, qh)
        tot[group.rank, :nb, 1].index_add_(0, r, ql)
        tot[group.rank, nb, 0] = start
        tot = distributed.all_reduce_sum_(tot, group)
        starts = [int(v) for v in tot[:, nb, 0].tolist()]
        order = sorted(range(size), key=lambda rank: starts[rank])
        ends = torch.searchsorted(r, torch.arange(nb + 1, device=device)).tolist()
        pick = torch.zeros(nb, dtype=torch.int64, device=device)
        per_row = tot[:, :nb].permute(1, 0, 2).tolist()
        for i, (uv, masses) in enumerate(zip(u[rows].tolist(), per_row, strict=True)):
            masses = [h * (1 << _BITS) + lo for h, lo in masses]
            num, den = float(uv).as_integer_ratio()
            left = (sum(masses) * num) // den  # U = floor(u S), then minus the ranks before
            for rank in order:
                if left < masses[rank]:
                    break
                left -= masses[rank]
            else:
                continue  # S = 0: nothing to draw
            if rank != group.rank:
                continue
            lo_i, hi_i = ends[i], ends[i + 1]
            ch, cl = qh[lo_i:hi_i].cumsum(0), ql[lo_i:hi_i].cumsum(0)  # each limb < 2^62
            uh = torch.full_like(ch, left >> _BITS)
            ul = torch.full_like(cl, left & _MASK)
            above = ~_ge(uh, ul, ch, cl)  # cumulative mass > U
            j = int(above.to(torch.int64).argmax())
            pick[i] = int(c[lo_i + j]) + start + 1  # + 1: 0 means "another rank"
        pick = distributed.all_reduce_sum_(pick, group)
        drawn = torch.where(pick > 0, pick - 1, torch.full_like(pick, -1))
        out[rows] = torch.where(greedy[rows], cut.argmax[rows], drawn)
    return out
