"""Processed logprobs: the exact min-p / top-k / top-p cut, the same at any TP degree.

The cut is defined on the fp32 values y of the contract and on its exact masses
q = Q(exp_c(y - M)) (integers on the 2^-84 grid), docs/numerics.md section 13:

    min-p   keep q >= min_p 2^84                  (elementwise, exact limbs)
    top-k   keep y >= the k-th largest y kept      (radix select of counts)
    top-p   keep y >= the largest t whose upper     (radix select of masses)
            set's mass reaches p S

Each radix select runs 4 rounds of 256 bins over a 32-bit key of y that orders like the
values; each round is one int64 all_reduce(SUM) of the bins, exact in any order, so every
rank finds the same thresholds and no rank gathers the vocabulary. The processed logprob
is then `selected_logprobs` over the kept set.
"""

from __future__ import annotations

import numbers
from typing import NamedTuple

import torch

from . import agreement, contract, distributed, validation
from .api import LogprobResult, eager_only, selected_logprobs
from .backends.base import num_rows, row_view, take_rows
from .call import device_of, make_call

BLOCK_ROWS = 32  # rows cut together: a function of nothing but N, alike on every rank
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
    a zero gradient) and `num_dropped` (0-d int64 tensor), and `mask` (SamplingMask)."""

    dropped: torch.Tensor
    num_dropped: torch.Tensor
    mask: SamplingMask


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
    term = (d >= contract.CUTOFF) & (d <= 0.0)
    dz = torch.where(term, d, torch.zeros_like(d))
    e = torch.where(term, contract.exp_c(dz), torch.zeros_like(d))
    return contract.quantize(e)


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


def _ceil_fraction(p: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """(n, 2) limbs of ceil(p S) for fp32 p and S = the (n, 2) limbs: Python integers."""
    out = []
    for pv, (hi, lo) in zip(p.tolist(), total.tolist(), strict=True):  # the host sync
        num, den = float(pv).as_integer_ratio()
        need = -((-(hi * (1 << _BITS) + lo) * num) // den)
        out.append((need >> _BITS, need & _MASK))
    return torch.tensor(out, dtype=torch.int64, device=total.device).view(-1, 2)


# --- the cut ---


class _Cut(NamedTuple):
    keep: torch.Tensor  # (N, V_local) bool
    threshold: torch.Tensor  # (N,) fp32
    row_max: torch.Tensor  # (N,) fp32
    argmax: torch.Tensor  # (N,) int64 lowest global id of the max; -1 if none
    dropped: torch.Tensor  # (N,) bool: target outside the kept set
    poison: torch.Tensor  # (N,) bool: the ranks disagree
    check: object  # agreement.RankCheck or None
    y_blocks: list  # per block: (rows slice, y, M as fp64, kept) for sample
    start: int  # this rank's vocab_start


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
    x = row_view(logits)
    n, v_local = num_rows(x), x.shape[-1]
    t = target.reshape(-1).to(torch.int64)
    start, vsize = call.plan.vocab_start, call.plan.vocab_size
    real = contract.valid_columns(v_local, start, vsize, None, x.device)  # (1, V)
    tau_col = tau.unsqueeze(-1) if isinstance(tau, torch.Tensor) else tau

    def scaled(rows):
        tc = tau_col[rows] if isinstance(tau_col, torch.Tensor) else tau_col
        return contract.scaled_logits(take_rows(x, rows), tc)

    blocks = [slice(s, min(s + BLOCK_ROWS, n)) for s in range(0, n, BLOCK_ROWS)]
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
            return _poisoned(n, v_local, x.device, check)
    else:
        row_max = local_max
    row_max = row_max.contiguous()

    keep = torch.zeros(n, v_local, dtype=torch.bool, device=x.device)
    threshold = torch.full((n,), float("-inf"), dtype=torch.float32, device=x.device)
    local_arg = torch.full((n,), _NONE_ID, dtype=torch.int64, device=x.device)
    owned = contract.owned_target_columns(t, start, v_local, vsize, ignore_index)
    padded = vsize is not None and start + v_local > vsize
    ys = []
    s_full = _full_masses(x, t, call, row_max, greedy, k, p, m, group)
    for rows in blocks:
        y = ok = bad = None
        nb = rows.stop - rows.start
        mx = row_max[rows]
        mx64 = mx.to(torch.float64)
        cut_row = ~greedy[rows] & torch.isfinite(mx)
        m_on = k_on = p_on = torch.zeros(nb, dtype=torch.bool, device=x.device)
        if m is not None:
            mv = _rows_of(m, rows, nb, x.device, torch.float32)
            m_on = cut_row & (mv > 0)
        if k is not None:
            kv = _rows_of(k, rows, nb, x.device, torch.int64)
            k_on = cut_row & (kv > 0)
        if p is not None:
            pv = _rows_of(p, rows, nb, x.device, torch.float32)
            p_on = cut_row & (pv < 1)
        any_on = m_on | k_on | p_on
        thr_key = torch.zeros(nb, dtype=torch.int64, device=x.device)  # key 0: below -inf
        if bool(any_on.any()):  # alike on every rank: the rounds are collectives
            # rows with top-p alone: S is the whole row's mass (s_full); their columns
            # start above M - 16, and a row whose columns there do not reach p S (found
            # is False, alike on every rank) is cut again from all its columns
            pure = p_on & ~k_on & ~m_on
            relax = torch.zeros(nb, dtype=torch.bool, device=x.device)
            fast = None
            if k is not None and not padded and v_local:
                tc = tau_col[rows] if isinstance(tau_col, torch.Tensor) else tau_col
                fast = _topk_candidates(take_rows(x, rows), tc, kv, k_on & ~m_on, any_on)
            if fast is None:
                y = scaled(rows)
                # NaN / +inf (kept, so that the row is reported bad) and padding need
                # masks; amax is NaN or +inf exactly when one is present
                if padded or v_local == 0 or not bool(y.amax() < float("inf")):
                    lt = y < float("inf")  # finite or -inf
                    ok, bad = lt & real, real & ~lt
            while True:
                thr_key.zero_()
                if fast is not None:
                    r, c, yc = fast
                else:
                    floor = _floors(
                        y, ok, mx64, m is not None and mv, m_on, k is not None and kv, k_on
                    )
                    near = (mx64 - 16.0).to(torch.float32)
                    floor = torch.where(pure & ~relax, near, floor)
                    floor = torch.where(any_on, floor, float("inf"))  # no cut: no column
                    sel = y >= floor.unsqueeze(-1)
                    r, c = torch.nonzero(sel if ok is None else sel & ok, as_tuple=True)
                    yc = y[r, c]
                # the lowest id of the max: every value equal to M is above every floor
                at = yc == mx[r]
                local_arg[rows] = (
                    torch.full((nb,), _NONE_ID, dtype=torch.int64, device=x.device)
                    .scatter_reduce_(0, r[at], c[at] + start, "amin")
                )  # fmt: skip
                if m is not None:  # min-p on the exact masses
                    mh, ml = _min_mass(mv)
                    qh, ql = _masses(yc.to(torch.float64) - mx64[r])
                    alive = ~m_on[r] | _ge(qh, ql, mh[r], ml[r])
                    r, c, yc = r[alive], c[alive], yc[alive]
                key = _keys(yc)
                if k is not None:  # top-k: counts
                    sel = k_on[r]
                    ones = torch.ones(int(sel.sum()), 1, dtype=torch.int64, device=x.device)
                    tk, found = _radix_select(
                        r[sel], key[sel], ones, nb, group, lambda total, kv=kv: kv.view(-1, 1)
                    )
                    thr_key = torch.where(k_on & found, tk, thr_key)
                    alive = key >= thr_key[r]
                    r, c, yc, key = r[alive], c[alive], yc[alive], key[alive]
                if p is None:
                    break
                # top-p: masses
                sel = p_on[r]
                qh, ql = _masses(yc[sel].to(torch.float64) - mx64[r[sel]])
                whole = s_full[rows] if s_full is not None else None

                def need(total, pv=pv, whole=whole, pure=pure):
                    if whole is not None:
                        total = torch.where(pure.unsqueeze(-1), whole, total)
                    return _ceil_fraction(pv, total)

                tp, found = _radix_select(
                    r[sel], key[sel], torch.stack([qh, ql], 1), nb, group, need
                )
                retry = p_on & pure & ~found & ~relax
                if fast is None and bool(retry.any()):
                    relax |= retry
                    continue
                thr_key = torch.where(p_on & found, torch.maximum(tp, thr_key), thr_key)
                alive = key >= thr_key[r]
                r, c = r[alive], c[alive]
                break
            kept = keep[rows]  # a view, all False
            kept[r, c] = True
            if bad is not None:
                kept |= bad
            if not bool(any_on.all()):
                kept[~any_on] = real
        else:
            kept = keep[rows]
            kept.copy_(real.expand(nb, v_local))
        threshold[rows] = torch.where(
            thr_key > 0, _key_value(thr_key), torch.full_like(mx, float("-inf"))
        )
        if keep_y and y is None:
            y = scaled(rows)
            if padded or v_local == 0 or not bool(y.amax() < float("inf")):
                lt = y < float("inf")
                ok, bad = lt & real, real & ~lt
        need_arg = ~any_on & torch.isfinite(mx) if keep_y else None
        if v_local and need_arg is not None and bool(need_arg.any()):  # rows without a cut
            ycl = y if ok is None else torch.where(ok, y, float("-inf"))
            a = ycl.argmax(-1)
            at = ycl.gather(1, a.unsqueeze(-1)).squeeze(-1) == mx
            local_arg[rows] = torch.where(at & need_arg, a + start, local_arg[rows])
        if keep_y:
            ys.append((rows, y, mx64, kept))

    # the lowest argmax id and whether the owner cut the target: one int64 MAX
    own = owned >= 0
    t_kept = keep.gather(1, owned.clamp(min=0).unsqueeze(-1)).squeeze(-1) if v_local else own
    flags = torch.stack([-local_arg, (own & ~t_kept).to(torch.int64)])
    flags = distributed.all_reduce_max_(flags, group)
    argmax = torch.where(flags[0] == -_NONE_ID, -1, -flags[0])
    poison = torch.zeros(n, dtype=torch.bool, device=x.device)
    return _Cut(keep, threshold, row_max, argmax, flags[1] > 0, poison, check, ys, start), (
        call,
        k,
        p,
        m,
        tau,
        greedy,
    )


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


def _topk_candidates(xb, tau, kv, rows_k, any_on):
    """The columns top-k can keep, found from the maxima of chunks of CHUNK columns:
    the k-th largest chunk maximum is a value that k distinct columns reach, so the k-th
    largest y is not below it, and every column at or above it lies in a chunk whose
    maximum is (a positive temperature keeps the order of the raw logits). Returns
    (rows, columns, y) of every column whose y is >= that value, or None when the
    shortcut does not apply (a row with another cut, fewer chunks than k, or a NaN or
    +inf among the values it reads: then the caller scans the whole block)."""
    if not bool((rows_k == any_on).all()):
        return None
    nb, v = xb.shape
    kmax = int(kv[rows_k].max())
    full = v // CHUNK
    if full + (v % CHUNK > 0) < 2 * kmax:
        return None
    main = xb[:, : full * CHUNK].reshape(nb, full, CHUNK)
    cmax = main.float().amax(-1)  # NaN propagates
    if v % CHUNK:
        cmax = torch.cat([cmax, xb[:, full * CHUNK :].float().amax(-1, keepdim=True)], 1)
    cy = contract.scaled_logits(cmax, tau)  # the y of each chunk's largest column
    if not bool((cy < float("inf")).all()):  # a NaN or +inf y: the row is bad, scan it
        return None
    vals = torch.topk(cy, kmax, dim=-1).values  # sorted, largest first
    kth = vals.gather(1, (kv.clamp(1, kmax) - 1).unsqueeze(-1))
    kth = torch.where(rows_k.unsqueeze(-1), kth, float("inf"))
    rr, cc = torch.nonzero(cy >= kth, as_tuple=True)
    tail = cc == full  # the last, partial chunk
    rows, cols, ys = [], [], []
    for part, width in ((~tail, CHUNK), (tail, v - full * CHUNK)):
        r, ch = rr[part], cc[part]
        if r.numel() == 0:
            continue
        span = torch.arange(width, device=xb.device)
        col = ch.unsqueeze(-1) * CHUNK + span  # (m, width)
        vals = xb[r.unsqueeze(-1), col]
        t = tau[r] if isinstance(tau, torch.Tensor) else tau
        y = contract.scaled_logits(vals, t)
        hit = y >= kth[r]
        rows.append(r.unsqueeze(-1).expand_as(col)[hit])
        cols.append(col[hit])
        ys.append(y[hit])
    if not rows:
        empty = torch.zeros(0, dtype=torch.int64, device=xb.device)
        return empty, empty, torch.zeros(0, dtype=torch.float32, device=xb.device)
    return torch.cat(rows), torch.cat(cols), torch.cat(ys)


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


def _poisoned(n, v_local, device, check):
    nan = torch.full((n,), float("nan"), dtype=torch.float32, device=device)
    return _Cut(
        torch.zeros(n, v_local, dtype=torch.bool, device=device), nan, nan,
        torch.full((n,), -1, dtype=torch.int64, device=device),
        torch.zeros(n, dtype=torch.bool, device=device),
        torch.ones(n, dtype=torch.bool, device=device), check, [], 0,
    ), None  # fmt: skip


def _mask_result(cut: _Cut, logits, target, options) -> SamplingMask:
    shape = tuple(target.shape)
    if options is None:
        m = torch.full(shape, float("nan"), device=cut.threshold.device)
        greedy = torch.zeros(shape, dtype=torch.bool, device=cut.threshold.device)
    else:
        mv = options[3]
        m = (
            mv.view(shape)
            if isinstance(mv, torch.Tensor)
            else torch.full(shape, 0.0 if mv is None else mv, device=cut.threshold.device)
        )
        greedy = options[5].view(shape)
        m = torch.where(greedy, torch.zeros_like(m), m)
    return SamplingMask(
        cut.keep.view(*shape, logits.shape[-1]),
        cut.threshold.view(shape), m, cut.row_max.view(shape), greedy,
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
    mask = _mask_result(cut, vocab_parallel_logits, target, options)
    shape = tuple(target.shape)
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
        out.dropped = torch.zeros(shape, dtype=torch.bool, device=nan.device)
        out.num_dropped = out.dropped.sum()
        out.mask = mask
        return out
    tau = options[4]
    t = target.reshape(-1).to(torch.int64)
    dropped = cut.dropped
    t_used = torch.where(dropped, cut.argmax, t).view(shape).to(target.dtype)
    tau_arg = tau.view(shape) if isinstance(tau, torch.Tensor) else tau
    res = selected_logprobs(
        vocab_parallel_logits, t_used, tp_group=tp_group, vocab_start=vocab_start,
        vocab_size=vocab_size, temperature=tau_arg, keep_mask=mask.keep_mask,
        ignore_index=ignore_index, with_entropy=with_entropy, validate=validate,
        backend=backend,
    )  # fmt: skip
    dropped = dropped.view(shape)
    lp = torch.where(dropped, torch.full_like(res.logprobs, float("-inf")), res.logprobs)
    out = ProcessedLogprobs(lp, res.entropy, res.lse)
    out.dropped = dropped
    out.num_dropped = dropped.sum()
    out.mask = mask
    return out


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
    device = cut.keep.device
    out = cut.argmax.clone()
    size = group.size
    for rows, y, mx64, kept in cut.y_blocks:
        nb = y.shape[0]
        r, c = torch.nonzero(kept & (y < float("inf")), as_tuple=True)  # row-major: ids ascend
        qh, ql = _masses(y[r, c].to(torch.float64) - mx64[r])
        # every rank's mass per row, and its vocab_start in the extra row: one int64 SUM
        tot = torch.zeros(size, nb + 1, 2, dtype=torch.int64, device=device)
        tot[group.rank, :nb, 0].index_add_(0, r, qh)
        tot[group.rank, :nb, 1].index_add_(0, r, ql)
        tot[group.rank, nb, 0] = cut.start
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
            pick[i] = int(c[lo_i + j]) + cut.start + 1  # + 1: 0 means "another rank"
        pick = distributed.all_reduce_sum_(pick, group)
        drawn = torch.where(pick > 0, pick - 1, torch.full_like(pick, -1))
        out[rows] = torch.where(greedy[rows], cut.argmax[rows], drawn)
    return out
