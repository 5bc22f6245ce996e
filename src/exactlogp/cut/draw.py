"""sample's draw: the inverse CDF over global ids on the exact masses of the kept set.

With u in [0, 1) per row and S3 the kept set's mass, U = floor(u S3); the drawn token is
the smallest global id j of the kept set with sum {q_i : i kept, i <= j} > U
(docs/numerics.md section 13). Each block of rows: every rank's kept mass per row and its
vocab_start in one int64 all_reduce(SUM); the rank whose ids hold U walks its own kept
columns; one more int64 SUM tells every rank the id.
"""

from __future__ import annotations

import torch

from .. import distributed
from . import integers
from .blocks import keep_mask
from .driver import Cut


def draw(cut: Cut, uniforms: torch.Tensor) -> torch.Tensor:
    """(N,) int64 token ids, alike on every rank: the argmax on greedy rows (the lowest
    id on ties), else the inverse CDF; -1 where a row has nothing to draw (no finite
    value). The caller reports bad rows (Cut.bad)."""
    shard = cut.shard
    greedy = shard.call.temperature.greedy
    out = cut.argmax.clone()
    keep = keep_mask(cut.blocks, out.shape[0], shard)
    for rows, y in cut.ys:
        drawn = _draw_block(shard, keep[rows], y, cut.row_max[rows], uniforms[rows])
        uncut = cut.argmax[rows]
        out[rows] = drawn if greedy is None else torch.where(greedy[rows], uncut, drawn)
    return out


def _draw_block(shard, kept, y, row_max, u) -> torch.Tensor:
    """(nb,) the ids drawn in one block of rows (kept, y: (nb, V_local); u (nb,) float64)."""
    group, start = shard.call.group, shard.call.plan.vocab_start
    nb, device = y.shape[0], y.device
    r, c = torch.nonzero(kept & (y < float("inf")), as_tuple=True)  # row-major: ids ascend
    qh, ql = integers.masses(y[r, c].to(torch.float64) - row_max.to(torch.float64)[r])
    # every rank's mass per row, and its vocab_start in the extra row: one int64 SUM
    tot = torch.zeros(group.size, nb + 1, 2, dtype=torch.int64, device=device)
    tot[group.rank, :nb, 0].index_add_(0, r, qh)
    tot[group.rank, :nb, 1].index_add_(0, r, ql)
    tot[group.rank, nb, 0] = start
    tot = distributed.all_reduce_sum_(tot, group)
    starts = [int(v) for v in tot[:, nb, 0].tolist()]
    order = sorted(range(group.size), key=lambda rank: starts[rank])
    ends = torch.searchsorted(r, torch.arange(nb + 1, device=device)).tolist()
    pick = torch.zeros(nb, dtype=torch.int64, device=device)
    per_row = tot[:, :nb].permute(1, 0, 2).tolist()
    for i, (uv, masses) in enumerate(zip(u.tolist(), per_row, strict=True)):
        left, rank = _owner(uv, [h * (1 << integers.BITS) + lo for h, lo in masses], order)
        if rank != group.rank:  # another rank's ids, or S = 0: nothing to draw
            continue
        lo_i, hi_i = ends[i], ends[i + 1]
        ch, cl = qh[lo_i:hi_i].cumsum(0), ql[lo_i:hi_i].cumsum(0)  # each limb < 2^62
        uh = torch.full_like(ch, left >> integers.BITS)
        ul = torch.full_like(cl, left & integers.MASK)
        above = ~integers.ge(uh, ul, ch, cl)  # cumulative mass > U
        j = int(above.to(torch.int64).argmax())
        pick[i] = int(c[lo_i + j]) + start + 1  # + 1: 0 means "another rank"
    pick = distributed.all_reduce_sum_(pick, group)
    return torch.where(pick > 0, pick - 1, torch.full_like(pick, -1))


def _owner(u: float, masses: list[int], order: list[int]) -> tuple[int, int | None]:
    """(U minus the mass of the ranks before, the rank whose ids hold U = floor(u S)),
    the ranks in the order of their ids; rank None where S = 0."""
    num, den = float(u).as_integer_ratio()
    left = (sum(masses) * num) // den
    for rank in order:
        if left < masses[rank]:
            return left, rank
        left -= masses[rank]
    return left, None
