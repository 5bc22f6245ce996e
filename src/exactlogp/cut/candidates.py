"""The columns a block's cut can keep: a superset found per shard and per row, read
without scanning every column where that is possible (docs/numerics.md section 13).

- top-k without min-p: the columns >= the k-th largest of this shard's chunk maxima
  (Backend.chunk_max), read from the chunks whose maximum reaches it;
- else the block's scan (its y, and where NaN / +inf or padding occur, masks of them),
  with per-row floors below which the exact steps cannot keep a column.

The exact steps (cut/blocks.py) then decide, so the result does not depend on the superset.
"""

from __future__ import annotations

import torch

from .. import contract
from ..backends.base import take_rows

CHUNK = 128  # columns per chunk of the top-k shortcut
CANDIDATE_CHUNKS = 4  # the shortcut reads at most this many chunks per row and unit of k
_SAME_WIDTH = {2: torch.int16, 4: torch.int32}


def at(x: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """x[row, col] of a row_view ((N, V) or (B, T, V) rows) at global rows: no copy of x."""
    if x.dim() == 2:
        return x[rows, cols]
    return x[rows // x.shape[1], rows % x.shape[1], cols]


def scan(shard, rows: slice):
    """The block's y (nb, V_local) fp32, and where NaN / +inf or padding occur the masks
    (ok: real and finite or -inf; bad: real and NaN or +inf), else None, None. `shard`:
    cut/blocks.Shard."""
    tau = shard.call.temperature.take(rows).column()
    y = contract.scaled_logits(take_rows(shard.x, rows), tau)
    # amax is NaN or +inf exactly when one is present
    if shard.padded or y.shape[-1] == 0 or not bool(y.amax() < float("inf")):
        lt = y < float("inf")  # finite or -inf
        return y, lt & shard.real, shard.real & ~lt
    return y, None, None


def floors(y, ok, mx64, mv, m_on, kv, k_on):
    """(nb,) fp32 per-row lower bounds of the values the exact cut can keep (a superset:
    the exact steps decide). min-p: q >= m 2^84 needs y - M >= log m - tiny (exp_c is
    within 2^-51 of exp, the grid adds 2^-85); the bound is taken 2^-10 (1 + |M| + |log m|)
    lower. top-k without min-p: the k-th largest y of this shard (the global k-th largest
    is not below it). -inf where neither applies. mv, kv: (nb,) values, or None where the
    parameter is absent."""
    nb = y.shape[0]
    floor = torch.full((nb,), float("-inf"), dtype=torch.float64, device=y.device)
    if mv is not None:
        lm = torch.log(mv.to(torch.float64).clamp(min=1e-300))
        bound = mx64 + lm - (1.0 + mx64.abs() + lm.abs()) * 2.0**-10
        usable = m_on & (mv >= 2.0**-40)
        floor = torch.where(usable, bound, floor)
    if kv is not None:
        rows_k = k_on & ~m_on
        if bool(rows_k.any()):
            kmax = int(kv[rows_k].max())
            if kmax <= y.shape[1] // 4:
                ycl = y if ok is None else torch.where(ok, y, float("-inf"))
                vals = torch.topk(ycl, kmax, dim=-1, sorted=True).values
                lk = vals.gather(1, (kv.clamp(1, kmax) - 1).unsqueeze(-1)).squeeze(-1)
                floor = torch.where(rows_k, lk.to(torch.float64), floor)
    return floor.to(torch.float32)


def top_k_candidates(shard, rows: slice, kv, rows_k, any_on):
    """The columns top-k can keep, found from the maxima of chunks of CHUNK columns
    (Backend.chunk_max): the k-th largest chunk maximum is a value that k distinct
    columns reach, so the k-th largest y is not below it, and every column at or above it
    lies in a chunk whose maximum is. Returns (rows, columns, y) of every column whose y
    is >= that value, or None when the shortcut does not apply (a row with another cut,
    fewer than 2k chunks, or a NaN or +inf in the block: then the caller scans it)."""
    if not bool((rows_k == any_on).all()):
        return None
    cy = shard.chunk_max[rows]
    kmax = int(kv[rows_k].max())
    if cy.shape[1] < 2 * kmax or not bool((cy < float("inf")).all()):
        return None
    bad_tau = shard.call.temperature.bad()  # y of a bad temperature is not monotonic in x
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
    return _read_chunks(shard, rows, rr, cc, kth)


def _read_chunks(shard, rows: slice, rr, cc, kth):
    """(rows, columns, y) of the columns >= kth[r] in chunk cc[i] of block row rr[i]:
    a first filter on the logits themselves (no conversion of every value), then y of
    the few that pass."""
    x, dev = shard.x, kth.device
    real = shard.call.plan.real_columns(x.shape[-1])
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
            vals = at(x, g.unsqueeze(-1), col.unsqueeze(0))
        tau = shard.call.temperature.of_rows(g)
        hit = (vals >= _raw_floor(kth[r], tau, vals.dtype)).view(-1).nonzero().squeeze(1)
        piece = hit // width
        y = contract.scaled_logits(vals.view(-1)[hit], tau[piece])
        keep = y >= kth[r[piece], 0]
        hit, piece = hit[keep], piece[keep]
        out_r.append(r[piece])
        out_c.append(ch[piece] * CHUNK + hit % width)
        out_y.append(y[keep])
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


def _raw_floor(kth: torch.Tensor, tau: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(m, 1) in the logits' dtype: a bound below which no logit x has y = fl(x / tau) >=
    kth (tau: (m,) fp32). IEEE division is off by at most 2^-24 relative (2^-150 absolute
    below the normal range), so y >= kth needs x >= tau kth - tau |kth| 2^-24 - tau 2^-150;
    the bound is taken 2^-6 relative and 2^-20 (fp16) or 2^-120 absolute lower still, so
    that rounding it to the dtype (half an ulp: 2^-9 relative at most; 2^-25 / 2^-134
    absolute in the subnormals) keeps it below. +-inf stay as they are."""
    t = tau.unsqueeze(-1).to(torch.float64)
    b = kth.to(torch.float64) * t
    tiny = (2.0**-20 if dtype == torch.float16 else 2.0**-120) * t.clamp(min=1.0)
    low = torch.where(torch.isfinite(b), b - b.abs() * 2.0**-6 - tiny, b)
    return low.to(dtype)
