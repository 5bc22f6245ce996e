"""The cut of one block of rows: min-p, then top-k, then top-p, on exact integers.

A block's candidates (cut/candidates.py) go through the exact steps of docs/numerics.md
section 13 -- min-p on the masses q, top-k on counts, top-p on masses, each threshold
found by cut/integers.select -- and the block keeps its kept columns as a list, or where
that list would outweigh a mask, the block's keep mask.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from .. import distributed
from . import integers
from .candidates import floors, scan, top_k_candidates

NONE_ID = 1 << 62  # no argmax on this shard
DENSE_SHARE = 32  # a kept list of more than 1 / DENSE_SHARE of the columns: a mask instead


@dataclass(frozen=True, eq=False)
class Shard:
    """What every block of one cut reads besides its rows."""

    call: object  # the Call, with its CutOptions (call.cut)
    x: torch.Tensor  # the logits' row_view, detached
    real: torch.Tensor  # (1, V_local) bool: not padding
    padded: bool
    row_max: torch.Tensor  # (N,) fp32, global
    whole: torch.Tensor | None  # (N, 2) limbs of each row's whole mass (top-p alone rows)
    chunk_max: torch.Tensor | None  # (N, chunks) fp32: Backend.chunk_max, for top-k


class Block(NamedTuple):
    """One block's part of the cut: the kept columns of its cut rows as a list, or where
    that list would outweigh a mask (more than 1 / DENSE_SHARE of the block's columns,
    at ~20 bytes an entry against 1), the block's whole keep mask instead (lists empty)."""

    rows: slice
    r: torch.Tensor  # (K,) int64 row in the block
    c: torch.Tensor  # (K,) int64 local column
    y: torch.Tensor  # (K,) fp32
    cut: torch.Tensor  # (nb,) bool: rows with a cut (the others keep every real column)
    bad: torch.Tensor | None  # (nb, V_local) bool: NaN / +inf real columns (kept), or None
    keep: torch.Tensor | None = None  # (nb, V_local) bool: the block's keep mask (bad too)


class Params(NamedTuple):
    """The cut's parameters on a block of rows: each (nb,) values, None where the call has
    no such cut; and the rows where each applies."""

    m: torch.Tensor | None
    k: torch.Tensor | None
    p: torch.Tensor | None
    m_on: torch.Tensor  # (nb,) bool
    k_on: torch.Tensor
    p_on: torch.Tensor

    @property
    def any_on(self) -> torch.Tensor:
        return self.m_on | self.k_on | self.p_on

    @property
    def pure(self) -> torch.Tensor:
        """Rows with top-p alone: their S is the whole row's mass."""
        return self.p_on & ~self.k_on & ~self.m_on


def params(call, row_max: torch.Tensor, rows: slice) -> Params:
    """The parameters of rows [start, stop): a row has a cut when it is not greedy, its
    max is finite and its value is not the parameter's "no cut"."""
    options, dev = call.cut, row_max.device
    cut_row = torch.isfinite(row_max[rows])
    greedy = call.temperature.greedy
    if greedy is not None:
        cut_row &= ~greedy[rows]
    out = []
    for param, on in ((options.min_p, torch.gt), (options.top_k, torch.gt),
                      (options.top_p, torch.lt)):  # fmt: skip
        if not param.given:
            out.append((None, torch.zeros_like(cut_row)))
            continue
        v = param.block(rows, dev)
        out.append((v, cut_row & on(v, 0 if param.name != "top_p" else 1)))
    (m, m_on), (k, k_on), (p, p_on) = out
    return Params(m, k, p, m_on, k_on, p_on)


def cut_block(shard: Shard, rows: slice, keep_y: bool, scan_ok: bool):
    """The cut of one block of rows: (Block, the threshold keys (nb,) (0: none), the
    lowest local argmax id + vocab_start (nb,), the block's y when keep_y); None where the
    block would need a scan of all its columns and `scan_ok` is False."""
    prm = params(shard.call, shard.row_max, rows)
    nb, dev = rows.stop - rows.start, shard.row_max.device
    thr_key = torch.zeros(nb, dtype=torch.int64, device=dev)  # key 0: below -inf
    arg = torch.full((nb,), NONE_ID, dtype=torch.int64, device=dev)
    empty = torch.zeros(0, dtype=torch.int64, device=dev)
    kept = (empty, empty, torch.zeros(0, dtype=torch.float32, device=dev))
    y = ok = bad = None
    any_on = prm.any_on
    if bool(any_on.any()):  # alike on every rank: the selects are collectives
        found = _cut_rows(shard, rows, prm, scan_ok)
        if found is None:
            return None
        (*kept, thr_key, arg), (y, ok, bad) = found
    if keep_y and y is None:
        y, ok, bad = scan(shard, rows)
    if keep_y:
        arg = _argmax_of_uncut(shard, rows, y, ok, ~any_on, arg)
    if bad is not None and not bool(bad.any()):
        bad = None
    return _block(shard, rows, kept, any_on, bad), thr_key, arg, y if keep_y else None


def _cut_rows(shard: Shard, rows: slice, prm: Params, scan_ok: bool):
    """The exact steps on a block with some cut row: ((r, c, y, threshold keys, lowest
    argmax id), (y, ok, bad) of the block's scan, or Nones), or None (needs a scan)."""
    group = shard.call.group
    fast = None
    if shard.chunk_max is not None:
        fast = top_k_candidates(shard, rows, prm.k, prm.k_on & ~prm.m_on, prm.any_on)
    if not scan_ok and group.distributed:  # every rank takes the shortcut, or none
        flag = torch.full((1,), float(fast is None), device=shard.row_max.device)
        if bool(distributed.all_reduce_max_(flag, group)[0] > 0):
            return None
    if fast is None and not scan_ok:
        return None
    y = ok = bad = None
    if fast is None:
        y, ok, bad = scan(shard, rows)
    # rows with top-p alone start from the columns above M - 16, and a row whose columns
    # there do not reach p S (found is False, alike on every rank) is cut again from all
    relax = torch.zeros_like(prm.m_on)
    while True:
        cand = fast if fast is not None else _above_floors(shard, rows, prm, y, ok, relax)
        arg = _lowest_max_id(shard, rows, cand)
        r, c, yc, thr_key, retry = select(shard, rows, cand, prm, relax)
        if fast is None and bool(retry.any()):
            relax |= retry
            continue
        return (r, c, yc, thr_key, arg), (y, ok, bad)


def _above_floors(shard: Shard, rows: slice, prm: Params, y, ok, relax):
    """(r, c, y) of the scanned block's columns at or above each row's floor."""
    mx = shard.row_max[rows]
    mx64 = mx.to(torch.float64)
    floor = floors(y, ok, mx64, prm.m, prm.m_on, prm.k, prm.k_on)
    near = (mx64 - 16.0).to(torch.float32)
    floor = torch.where(prm.pure & ~relax, near, floor)
    floor = torch.where(prm.any_on, floor, float("inf"))  # no cut: no column
    sel = y >= floor.unsqueeze(-1)
    r, c = torch.nonzero(sel if ok is None else sel & ok, as_tuple=True)
    return r, c, y[r, c]


def _lowest_max_id(shard: Shard, rows: slice, cand) -> torch.Tensor:
    """(nb,) the lowest vocab id among the candidates equal to M (every value equal to M
    is above every floor); NONE_ID where none."""
    r, c, yc = cand
    nb = rows.stop - rows.start
    at = yc == shard.row_max[rows][r]
    start = shard.call.plan.vocab_start
    out = torch.full((nb,), NONE_ID, dtype=torch.int64, device=yc.device)
    return out.scatter_reduce_(0, r[at], c[at] + start, "amin")


def _argmax_of_uncut(shard: Shard, rows: slice, y, ok, uncut, arg) -> torch.Tensor:
    """`arg` with the lowest id of M on the rows without a cut (sample's greedy rows)."""
    need = uncut & torch.isfinite(shard.row_max[rows])
    if not y.shape[-1] or not bool(need.any()):
        return arg
    ycl = y if ok is None else torch.where(ok, y, float("-inf"))
    a = ycl.argmax(-1)
    hit = ycl.gather(1, a.unsqueeze(-1)).squeeze(-1) == shard.row_max[rows]
    return torch.where(hit & need, a + shard.call.plan.vocab_start, arg)


def _block(shard: Shard, rows: slice, kept, any_on, bad) -> Block:
    """The Block of these kept lists, or of the block's keep mask where it is smaller."""
    r, c, yc = kept
    nb, v_local = rows.stop - rows.start, shard.x.shape[-1]
    if r.numel() <= nb * v_local // DENSE_SHARE:
        return Block(rows, r, c, yc, any_on, bad)
    keep = torch.zeros(nb, v_local, dtype=torch.bool, device=r.device)
    keep[r, c] = True
    if bad is not None:
        keep |= bad
    keep[~any_on] = shard.real
    empty = r[:0].clone()
    none = torch.zeros(0, dtype=torch.float32, device=r.device)  # not yc[:0]: a view of it
    return Block(rows, empty, empty, none, any_on, bad, keep)


def select(shard: Shard, rows: slice, cand, prm: Params, relax):
    """min-p, then top-k, then top-p on the candidates (r, c, y) of a block: the kept
    ones, the threshold keys (nb,), and the top-p-alone rows (not yet relaxed) whose
    candidates did not reach p S (to cut again from all their columns)."""
    r, c, yc = cand
    nb, dev = rows.stop - rows.start, yc.device
    mx64 = shard.row_max[rows].to(torch.float64)
    thr_key = torch.zeros(nb, dtype=torch.int64, device=dev)
    retry = torch.zeros(nb, dtype=torch.bool, device=dev)
    group = shard.call.group
    if prm.m is not None:  # min-p on the exact masses
        mh, ml = integers.min_mass(prm.m)
        qh, ql = integers.masses(yc.to(torch.float64) - mx64[r])
        alive = ~prm.m_on[r] | integers.ge(qh, ql, mh[r], ml[r])
        r, c, yc = r[alive], c[alive], yc[alive]
    key = integers.keys(yc)
    if prm.k is not None:  # top-k: counts
        sel = prm.k_on[r]
        ones = torch.ones(int(sel.sum()), 1, dtype=torch.int64, device=dev)
        need = prm.k.view(-1, 1)
        tk, found = integers.select(r[sel], key[sel], ones, nb, group, lambda total: need)
        thr_key = torch.where(prm.k_on & found, tk, thr_key)
        alive = key >= thr_key[r]
        r, c, yc, key = r[alive], c[alive], yc[alive], key[alive]
    if prm.p is None:
        return r, c, yc, thr_key, retry
    # top-p: masses
    sel = prm.p_on[r]
    qh, ql = integers.masses(yc[sel].to(torch.float64) - mx64[r[sel]])
    whole = shard.whole[rows] if shard.whole is not None else None

    def need(total):
        if whole is not None:
            total = torch.where(prm.pure.unsqueeze(-1), whole, total)
        return integers.ceil_fraction(prm.p, total)

    weights = torch.stack([qh, ql], 1)
    tp, found = integers.select(r[sel], key[sel], weights, nb, group, need)
    retry = prm.p_on & prm.pure & ~found & ~relax
    thr_key = torch.where(prm.p_on & found, torch.maximum(tp, thr_key), thr_key)
    alive = key >= thr_key[r]
    return r[alive], c[alive], yc[alive], thr_key, retry


# --- what a cut kept ---


def keep_mask(blocks, n: int, shard: Shard) -> torch.Tensor:
    """(N, V_local) bool: this rank's kept columns, from the blocks' lists and masks."""
    keep = torch.zeros(n, shard.x.shape[-1], dtype=torch.bool, device=shard.x.device)
    for b in blocks:
        if b.keep is not None:
            keep[b.rows] = b.keep
            continue
        kept = keep[b.rows]  # a view
        kept[b.r, b.c] = True
        if b.bad is not None:
            kept |= b.bad
        if not bool(b.cut.all()):
            kept[~b.cut] = shard.real
    return keep


def kept_at(blocks, owned: torch.Tensor) -> torch.Tensor:
    """(N,) bool: whether each row's column `owned` (-1: none) is kept on this rank."""
    n = owned.shape[0]
    hit = torch.zeros(n, dtype=torch.bool, device=owned.device)
    for b in blocks:
        g = b.r + b.rows.start
        hit[g[b.c == owned[g]]] = True
        rows = torch.arange(b.rows.start, b.rows.stop, device=owned.device)
        mine = owned[b.rows]
        at_mine = mine.clamp(min=0).unsqueeze(-1)
        whole = ~b.cut & (mine >= 0)
        for mask in (b.bad, b.keep):
            if mask is not None:
                whole |= (mine >= 0) & mask.gather(1, at_mine).squeeze(-1)
        hit[rows[whole]] = True
    return hit
