"""The exact cut of one call across the ranks of its TP group.

    1. local max      Backend.chunk_max (top-k: the chunk maxima give the row max too)
                      or Backend.row_max
    2. global max     autograd.global_max: one all_reduce(MAX), the agreement riding it
                      (with the cut's per-row parameters hashed); ranks that disagree stop
                      here, all alike (autograd.stop_disagreeing)
    3. whole masses   top-p-alone rows: the partials pass and one int64 all_reduce(SUM)
    4. blocks         each block's candidates and exact selects (cut/blocks.py), in blocks
                      that are a function of N alone, so every rank meets the same rounds
    5. flags          one int64 all_reduce(MAX): the lowest id of the max, whether the
                      owner's target was cut, whether a row holds NaN / +inf

docs/numerics.md section 13 defines the cut; this computes it without gathering.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .. import agreement, autograd, contract, distributed, validation
from ..backends.base import num_rows, row_view
from . import integers
from .blocks import NONE_ID, Block, Shard, cut_block, kept_at, params
from .candidates import CHUNK, scan
from .options import ROW_WORD_NAMES, row_word_text

BLOCK_ROWS = 32  # rows cut together: a function of nothing but N, alike on every rank
LARGE_BLOCK_ROWS = 512  # rows cut together where no scan is needed (a function of N alone)


class Cut(NamedTuple):
    """One call's cut on this rank. `shard` is None where the ranks disagree (then every
    row is BAD_RANKS and nothing was cut)."""

    shard: Shard | None
    blocks: list[Block]
    row_max: torch.Tensor  # (N,) fp32: M (NaN where the ranks disagree)
    threshold: torch.Tensor  # (N,) fp32: the top-k / top-p threshold on y, -inf: none
    argmax: torch.Tensor  # (N,) int64: the lowest global id of the max; -1 if none
    dropped: torch.Tensor  # (N,) bool: the target lies outside the kept set
    bad: torch.Tensor  # (N,) int64 contract.BAD_* flags of the rows sample cannot draw
    ys: list  # sample: per block of BLOCK_ROWS, (rows slice, y (nb, V_local) fp32)

    @property
    def poisoned(self) -> bool:
        return self.shard is None


def cut(call, logits: torch.Tensor, target: torch.Tensor, keep_y: bool = False) -> Cut:
    """The cut of the call's rows (`call.cut`, `call.temperature`); keep_y: keep every
    block's y for sample's draw. Raises on every rank (validate=True) where the ranks
    disagree; else returns a poisoned Cut on every rank."""
    x = row_view(logits.detach())
    n, v_local = num_rows(x), x.shape[-1]
    t = target.reshape(-1).to(torch.int64)
    plan, group = call.plan, call.group
    local_max, chunk_max = _local_max(call, x)
    row_hash = None
    if group.distributed:
        row_hash = call.cut.row_hash(call.temperature.greedy, n, x.device)
    row_max, ranks = autograd.global_max(local_max, t, call.temperature, call, row_hash)
    if ranks is not None and bool(ranks.poison.any()):  # alike on every rank
        return _disagree(call, ranks, n, x.device)
    row_max = row_max.contiguous()
    real = contract.valid_columns(v_local, plan.vocab_start, plan.vocab_size, None, x.device)
    padded = plan.vocab_size is not None and plan.vocab_start + v_local > plan.vocab_size
    whole = _whole_masses(call, x, t, row_max)
    shard = Shard(call, x, real, padded, row_max, whole, chunk_max)
    parts = _cut_blocks(shard, n, keep_y)
    return _finish(shard, parts, t, keep_y)


def _local_max(call, x: torch.Tensor):
    """(this shard's row max (N,) fp32, the chunk maxima (N, chunks) or None). top-k reads
    the maxima of chunks of columns; where none is NaN or +inf, the temperature is valid
    and the largest is not a zero (chunk_max gives +0 for -0), the largest of a row's is
    its max (one read of the logits for both)."""
    backend, plan, tau = call.backend, call.plan, call.temperature
    if not call.cut.top_k.given or not num_rows(x) or not plan.real_columns(x.shape[-1]):
        return backend.row_max(x, tau, None, plan), None
    chunk_max = backend.chunk_max(x, tau, plan, CHUNK)
    local_max = chunk_max.amax(1)
    clean = (chunk_max < float("inf")).all(1) & (local_max != 0)
    bad_tau = tau.bad()
    if bad_tau is not None:
        clean &= ~bad_tau
    if not bool(clean.all()):
        local_max = torch.where(clean, local_max, backend.row_max(x, tau, None, plan))
    return local_max, chunk_max


def _disagree(call, ranks, n: int, device) -> Cut:
    """Where the ranks disagree: raise on every rank (validate=True), else the poisoned
    Cut, after the collectives that ranks running another function still make."""
    if call.validate:
        raise ValueError(validation.ranks_message(ranks, call, _row_words(call, n, device)))
    autograd.stop_disagreeing(call, ranks, n)
    nan = torch.full((n,), float("nan"), dtype=torch.float32, device=device)
    none = torch.zeros(n, dtype=torch.bool, device=device)
    bad = torch.full((n,), contract.BAD_RANKS, dtype=torch.int64, device=device)
    argmax = torch.full((n,), -1, dtype=torch.int64, device=device)
    return Cut(None, [], nan, nan, argmax, none, bad, [])


def _row_words(call, n: int, device):
    """The messages' view of the cut's per-row values: (names, row -> this rank's words,
    words -> their text)."""
    words = call.cut.row_words(call.temperature.greedy, n, device)
    return ROW_WORD_NAMES, lambda row: words[row], row_word_text


def _whole_masses(call, x, t, row_max):
    """(N, 2) int64 limbs of each row's whole mass S (the backend's partials pass and one
    int64 SUM) when some row has a top-p cut alone; else None (alike on every rank)."""
    if not call.cut.top_p.given:
        return None
    if not bool(params(call, row_max, slice(0, row_max.shape[0])).pure.any()):
        return None
    record = call.backend.partials(x, t, call.temperature, None, row_max, call.plan)
    whole = record[:, [contract.COL_E_HI, contract.COL_E_LO]].contiguous()
    return distributed.all_reduce_sum_(whole, call.group)


def _cut_blocks(shard: Shard, n: int, keep_y: bool) -> list:
    """Every block's (rows, cut_block's result). A block first tries the shortcut on
    LARGE_BLOCK_ROWS rows at once, and where it does not apply (with a TP group: on any
    rank) its blocks of BLOCK_ROWS are cut: blocks that are a function of N alone, so that
    every rank meets the same collectives (sample: blocks of BLOCK_ROWS, scanned)."""
    step = BLOCK_ROWS if keep_y else LARGE_BLOCK_ROWS
    out = []
    for s in range(0, n, step):
        rows = slice(s, min(s + step, n))
        done = cut_block(shard, rows, keep_y, scan_ok=step == BLOCK_ROWS)
        if done is not None:
            out.append((rows, done))
            continue
        for a in range(rows.start, rows.stop, BLOCK_ROWS):
            part = slice(a, min(a + BLOCK_ROWS, rows.stop))
            out.append((part, cut_block(shard, part, keep_y, scan_ok=True)))
    return out


def _finish(shard: Shard, parts: list, t: torch.Tensor, keep_y: bool) -> Cut:
    """The blocks' thresholds and argmax ids, and one int64 all_reduce(MAX) of the lowest
    argmax id, whether the owner's target was cut and whether a row holds NaN / +inf."""
    call, x = shard.call, shard.x
    n, dev = t.shape[0], x.device
    threshold = torch.full((n,), float("-inf"), dtype=torch.float32, device=dev)
    local_arg = torch.full((n,), NONE_ID, dtype=torch.int64, device=dev)
    nonfinite = torch.zeros(n, dtype=torch.int64, device=dev)
    blocks, ys = [], []
    for rows, (block, thr_key, arg, y) in parts:
        blocks.append(block)
        local_arg[rows] = arg
        threshold[rows] = torch.where(thr_key > 0, integers.key_value(thr_key), threshold[rows])
        nonfinite[rows] = _nonfinite(shard, rows, block, y)
        if keep_y:
            ys.append((rows, y))
    plan = call.plan
    owned = plan.target_columns(t, x.shape[-1])
    cut_off = ((owned >= 0) & ~kept_at(blocks, owned)).to(torch.int64)
    flags = distributed.all_reduce_max_(torch.stack([-local_arg, cut_off, nonfinite]), call.group)
    argmax = torch.where(flags[0] == -NONE_ID, -1, -flags[0])
    bad = torch.where(flags[2] > 0, contract.BAD_NONFINITE, 0)
    bad |= torch.where(shard.row_max == float("-inf"), contract.BAD_NO_VALID_COLUMN, 0)
    bad_tau = call.temperature.bad()
    if bad_tau is not None:
        bad |= torch.where(bad_tau, contract.BAD_TEMPERATURE, 0)
    return Cut(shard, blocks, shard.row_max, threshold, argmax, flags[1] > 0, bad, ys)


def _nonfinite(shard: Shard, rows: slice, block: Block, y) -> torch.Tensor:
    """(nb,) int64: 1 where the row holds a NaN or +inf (after the temperature) in a real
    column of this shard. A scanned block knows (Block.bad), and a block cut from its
    chunk maxima holds none (the shortcut applies only then); a block neither scanned nor
    cut (rows without a cut, outside sample) is scanned here where the call reports such
    rows (sample, sampling_mask: processed_logprobs' finalize reports them itself)."""
    bad = block.bad
    known = bad is not None or y is not None or bool(block.cut.any())
    if not known and shard.call.fields.kind != agreement.KIND_PROCESSED:
        _, _, bad = scan(shard, rows)
    if bad is None:
        return torch.zeros(rows.stop - rows.start, dtype=torch.int64, device=shard.x.device)
    return bad.any(1).to(torch.int64)
