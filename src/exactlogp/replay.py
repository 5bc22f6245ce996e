"""Replay: the logprobs over the kept set a rollout engine returned, exactly.

A sampler's top-k / top-p / min-p cut keeps a set of tokens per generated token; vLLM
(`--return-sampling-mask`) and SGLang (`return_sampling_mask`) return it, and the trainer
replays the rollout's processed logprobs over it. Here the set arrives as CSR -- the
kept global token ids of row r are kept_ids[kept_offsets[r]:kept_offsets[r + 1]], sorted
and unique (vLLM's layout) -- and

    replay_logprobs(logits, target, kept_ids, kept_offsets, ...)
        == selected_logprobs(logits, target, keep_mask=<the same set, dense>)

bit for bit (forward and gradients) on every row whose target is kept, at any TP degree:
each rank reads only the kept ids in its shard -- O(N + nnz) memory and reads of the
logits, no [N, V] mask, nothing gathered -- and the exact integer sums of contract
exactlogp-v2 do not depend on which columns were left out. A target outside its row's
kept set gives logprob -inf with a zero gradient and is counted (`dropped`), as
processed_logprobs does; the entropy and lse of that row are those of its kept set.

    1. checks          this rank's arguments; validate=True: the CSR's values too (a
                       host sync), so that every rank raises before any collective
    2. kept entries    this shard's (row, column) pairs; y there; the local max
    3. global max      autograd.global_max, each row's hash of its kept ids riding it
    4. record          the kept entries' exact terms, summed per row; one int64 SUM
    5. finish          finalize; rows whose kept set is malformed (validate=False) NaN
"""

from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

import torch

from . import agreement, autograd, contract, distributed, validation
from .api import KeptLogprobs, eager_only, flat_int64
from .backends.base import row_view
from .call import Call, device_of, make_call
from .linear import LinearSelectedLogprobsFunction, linear_call
from .prepared import unwrap

# why a row's kept set is malformed (bits of KeptSet.problems)
BAD_OFFSETS, BAD_ORDER, BAD_RANGE, BAD_EMPTY = 1, 2, 4, 8
_PROBLEMS = {
    BAD_OFFSETS: "kept_offsets{idx} = {lo}, {hi} do not bound a row of kept_ids (offsets "
    "must start at 0, never decrease and end at len(kept_ids) = {nnz})",
    BAD_ORDER: "kept_ids of row{idx} are not strictly increasing (sorted, without "
    "duplicates: vLLM's layout; sort an SGLang row first)",
    BAD_RANGE: "kept_ids of row{idx} hold {bad}, outside the vocabulary [0, {end})",
    BAD_EMPTY: "the kept set of row{idx} is empty, and its target is not ignore_index",
}


class KeptSet(NamedTuple):
    """The kept sets of N rows as this rank checked them, on the logits' device."""

    ids: torch.Tensor  # (nnz,) int64 global token ids
    offsets: torch.Tensor  # (N + 1,) int64
    row: torch.Tensor  # (nnz,) int64: the row of each id
    problems: torch.Tensor  # (N,) int64 BAD_* bits; 0 where the row's set is well formed

    @property
    def num_rows(self) -> int:
        return self.offsets.shape[0] - 1

    def local(self, start: int, real: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows, local columns) of the kept ids in [start, start + real): this shard's."""
        mine = (self.ids >= start) & (self.ids < start + real)
        return self.row[mine], self.ids[mine] - start

    def holds(self, target: torch.Tensor) -> torch.Tensor:
        """(N,) bool: each row's target is one of its kept ids (rows sorted: one search)."""
        want = torch.arange(self.num_rows, device=target.device) * (1 << 32) + target
        if not self.ids.numel():
            return torch.zeros_like(want, dtype=torch.bool)
        key = self.row * (1 << 32) + self.ids
        at = torch.searchsorted(key, want).clamp(max=key.shape[0] - 1)
        return key[at] == want

    def first(self) -> torch.Tensor:
        """(N,) int64: each row's smallest kept id (-1 where none)."""
        lo, hi = self.offsets[:-1], self.offsets[1:]
        if not self.ids.numel():
            return torch.full_like(lo, -1)
        has = (hi > lo) & (lo >= 0) & (lo < self.ids.shape[0])
        return torch.where(has, self.ids[lo.clamp(0, self.ids.shape[0] - 1)], -1)

    def row_hash(self) -> torch.Tensor:
        """(2, N) int64 below 2^24: the hash of each row's ids (they ride the MAX)."""
        pos = torch.arange(self.ids.shape[0], device=self.ids.device) - self.offsets[self.row]
        return agreement.segment_hash(self.ids, self.row, pos, self.num_rows)

    def shard(self, start: int, real: int) -> ShardEntries:
        """This shard's kept entries, for masks of blocks of rows or of columns."""
        r, c = self.local(start, real)
        order = torch.argsort(c, stable=True)
        return ShardEntries(r, c, r[order], c[order])

    def malformed(self, fin, ranks):
        """fin with NaN in the rows whose kept set is malformed (BAD_KEPT_SET): those the
        checks flagged, and with a TP group and no vocab_size, those holding an id past the
        last shard (its end known from the shards that rode the MAX)."""
        bad = self.problems != 0
        if ranks is not None:
            bad |= _rows_with(self.ids >= ranks.vocab_end, self.row, self.num_rows) > 0
        nan = torch.full((), float("nan"), device=bad.device)
        return fin._replace(
            logprobs=torch.where(bad, nan, fin.logprobs),
            entropy=torch.where(bad, nan, fin.entropy), lse=torch.where(bad, nan, fin.lse),
            bad=fin.bad | torch.where(bad, contract.BAD_KEPT_SET, 0),
        )  # fmt: skip


class ShardEntries(NamedTuple):
    """One shard's kept entries (row, local column), in row order and in column order:
    the dense keep mask of a block of rows or of columns, never of the whole shard."""

    r: torch.Tensor  # (m,) int64, ascending
    c: torch.Tensor  # (m,) int64
    r_by_col: torch.Tensor  # the same entries, columns ascending
    c_by_col: torch.Tensor

    def rows_mask(self, rows: slice, width: int) -> torch.Tensor:
        """(nb, width) bool: the kept columns of rows [start, stop)."""
        lo, hi = torch.searchsorted(
            self.r, torch.tensor([rows.start, rows.stop], device=self.r.device)
        ).tolist()
        out = torch.zeros(rows.stop - rows.start, width, dtype=torch.bool, device=self.r.device)
        out[self.r[lo:hi] - rows.start, self.c[lo:hi]] = True
        return out

    def cols_mask(self, cols: slice, n: int, index: torch.Tensor | None = None) -> torch.Tensor:
        """(n, stop - start) bool: which of columns [start, stop) each row keeps; `index`:
        the rows (n,) of the call these n rows are (else the call's first n)."""
        bounds = torch.tensor([cols.start, cols.stop], device=self.c_by_col.device)
        lo, hi = torch.searchsorted(self.c_by_col, bounds).tolist()
        r, c = self.r_by_col[lo:hi], self.c_by_col[lo:hi] - cols.start
        out = torch.zeros(n, cols.stop - cols.start, dtype=torch.bool, device=r.device)
        if index is not None:
            where = torch.full((int(index.max()) + 1 if index.numel() else 0,), -1,
                               dtype=torch.int64, device=r.device)  # fmt: skip
            where[index] = torch.arange(index.shape[0], device=r.device)
            inside = r < where.shape[0]
            r, c = r[inside], c[inside]
            r = where[r]
            r, c = r[r >= 0], c[r >= 0]
        out[r, c] = True
        return out


def kept_set(kept_ids, kept_offsets, target, device, vocab_end, ignore_index) -> KeptSet:
    """The KeptSet of the caller's CSR (types and shapes checked here, values flagged per
    row: `vocab_end` the end of the vocabulary where this rank knows it, else None)."""
    for name, t in (("kept_ids", kept_ids), ("kept_offsets", kept_offsets)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(
                f"{name} must be a torch.Tensor (int32 or int64); lists and numpy arrays "
                f"go through exactlogp.integrations.kept_csr, got {type(t).__name__}"
            )
        if t.dtype not in (torch.int32, torch.int64) or t.dim() != 1:
            raise TypeError(f"{name} must be a 1-D int32 or int64 tensor, got {t.dtype} "
                            f"of shape {tuple(t.shape)}")  # fmt: skip
        if t.device != device:
            raise ValueError(f"{name} is on {t.device} but must be on {device}")
    n = target.numel()
    if kept_offsets.shape[0] != n + 1:
        raise ValueError(
            f"kept_offsets must hold one offset per row and one more ({n + 1} for "
            f"{n} rows), got {kept_offsets.shape[0]}"
        )
    ids, offsets = kept_ids.to(torch.int64), kept_offsets.to(torch.int64)
    nnz = ids.shape[0]
    lo, hi = offsets[:-1], offsets[1:]
    # where an offset decreases, the rows whose ranges overlap an earlier one are
    # malformed; the running maximum keeps the search for each id's row well defined
    reach = torch.cummax(hi, 0).values if n else hi
    whole = torch.arange(nnz, device=device)
    row = torch.searchsorted(reach, whole, right=True).clamp(max=max(n - 1, 0))
    before = torch.cat([offsets[:1], reach[:-1]])
    bad_offsets = (hi < lo) | (lo < 0) | (hi > nnz) | (lo < before)
    if n:
        bad_offsets[0] |= offsets[0] != 0
        bad_offsets[-1] |= offsets[-1] != nnz
    problems = torch.where(bad_offsets, BAD_OFFSETS, 0)
    if nnz:
        later = (row[1:] == row[:-1]) & (ids[1:] <= ids[:-1])
        problems |= _rows_with(later, row[1:], n) * BAD_ORDER
        problems |= _rows_with(outside(ids, vocab_end), row, n) * BAD_RANGE
    empty = (hi == lo) & (target.reshape(-1) != ignore_index)
    problems |= torch.where(empty & ~bad_offsets, BAD_EMPTY, 0)
    return KeptSet(ids, offsets, row, problems)


def outside(ids: torch.Tensor, vocab_end) -> torch.Tensor:
    """ids outside [0, vocab_end) (vocab_end None: negative ids only)."""
    return ids < 0 if vocab_end is None else (ids < 0) | (ids >= vocab_end)


def _rows_with(flag: torch.Tensor, row: torch.Tensor, n: int) -> torch.Tensor:
    """(N,) int64 1 where some element of the row is flagged."""
    out = torch.zeros(n, dtype=torch.int64, device=flag.device)
    return out.index_add_(0, row[flag], torch.ones_like(row[flag])).clamp(max=1)


def problem_text(kept: KeptSet, call: Call, vocab_end) -> str | None:
    """The first malformed row's problem as a message, or None (one host sync)."""
    bad = torch.nonzero(kept.problems).flatten()
    if not len(bad):
        return None
    r = int(bad[0])
    bits = int(kept.problems[r])
    code = next(c for c in (BAD_OFFSETS, BAD_ORDER, BAD_RANGE, BAD_EMPTY) if bits & c)
    idx = validation.index_text(r, call.target_shape)
    lo, hi = (int(v) for v in kept.offsets[r : r + 2])
    mine = kept.ids[kept.row == r]
    far = mine[outside(mine, vocab_end)]
    text = _PROBLEMS[code].format(
        idx=idx, lo=lo, hi=hi, nnz=kept.ids.shape[0], end=vocab_end,
        bad=int(far[0]) if len(far) else None,
    )  # fmt: skip
    more = len(bad) - 1
    return text + (f" ({more} more malformed row{'s' if more > 1 else ''})" if more else "")


# --- the call ---


def _replay_call(logits, target, kept_ids, kept_offsets, group, options: dict) -> Call:
    """This rank's checks, made collective (agreement.checked): the Call with its KeptSet
    (call.kept). validate=True checks the kept sets' values here, before any collective."""

    def build() -> Call:
        validation.check_logits(logits)
        validation.check_target(target, logits)
        call = make_call(
            source=logits, num_cols=logits.shape[-1], target=target, group=group,
            has_keep_mask=False, grads=agreement.grads_field(logits),
            kind=agreement.KIND_REPLAY, **options,
        )  # fmt: skip
        return with_kept(call, kept_ids, kept_offsets, target, logits.device)

    return agreement.checked(group, options["validate"], device_of(logits, group), build)


def with_kept(call: Call, kept_ids, kept_offsets, target, device) -> Call:
    """`call` with the KeptSet of the caller's CSR; validate=True: its values checked
    (one host sync), a ValueError naming the first malformed row."""
    end = call.plan.vocab_size
    if end is None and not call.group.distributed:
        end = call.num_cols
    kept = kept_set(kept_ids, kept_offsets, target, device, end, call.plan.ignore_index)
    if call.validate:
        text = problem_text(kept, call, end)
        if text is not None:
            raise ValueError(text + "; pass validate=False to get NaN in such rows instead")
    return replace(call, kept=kept)


def targets(call: Call, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """((N,) bool: the targets outside their row's kept set, (N,) int64: the targets the
    passes use -- those, or each such row's smallest kept id, whose gradient is 0)."""
    t = flat_int64(target)
    kept = call.kept
    dropped = ~kept.holds(t) & (t != call.plan.ignore_index) & (kept.problems == 0)
    return dropped, torch.where(dropped, kept.first(), t)


def kept_result(call: Call, dropped, logprobs, entropy, lse) -> KeptLogprobs:
    """The (N,) outputs in the target's shape: a dropped target's logprob -inf (a bad
    row's stays NaN)."""
    shape = call.target_shape
    dropped = dropped.view(shape)
    lp = logprobs.view(shape)
    lp = torch.where(dropped & ~torch.isnan(lp), float("-inf"), lp)
    return KeptLogprobs(
        lp, entropy.view(shape) if call.with_entropy else None, lse.view(shape), dropped,
        dropped.sum(),
    )  # fmt: skip


# --- the passes ---


def _entries(x, call: Call):
    """(rows, local columns, y) of this shard's kept entries (y fp32, the temperature's)."""
    plan = call.plan
    r, c = call.kept.local(plan.vocab_start, plan.real_columns(x.shape[-1]))
    return r, c, contract.scaled_logits(at(x, r, c), call.temperature.of_rows(r))


def forward(x, target: torch.Tensor, call: Call) -> autograd.Forward:
    """Stages 2-5 on the row view `x`: the forward of selected_logprobs over the kept sets
    (`target`: a kept id in every row that is not ignored)."""
    kept, plan, tau = call.kept, call.plan, call.temperature
    n = target.shape[0]
    r, c, y = _entries(x, call)
    finite = (y != float("inf")) & ~torch.isnan(y)  # NaN and +inf are counted, not maxed
    local_max = torch.full((n,), float("-inf"), device=y.device)
    local_max.scatter_reduce_(0, r[finite], y[finite], "amax")
    row_hash = kept.row_hash() if call.group.distributed else None
    row_max, ranks = autograd.global_max(local_max, target, tau, call, row_hash)
    record = torch.zeros(n, contract.NUM_COLS, dtype=torch.int64, device=y.device)
    d = y.to(torch.float64) - row_max.to(torch.float64)[r]
    limbs = contract.term_limbs(d, plan.with_entropy)
    for col, limb in zip(_SUM_COLS, limbs, strict=False):
        record[:, col].index_add_(0, r, limb)
    record[:, contract.COL_NONFINITE].index_add_(0, r, (~finite).to(torch.int64))
    owned = plan.target_columns(target, x.shape[-1])
    g = torch.nonzero(owned >= 0).flatten()
    y_t = contract.scaled_logits(at(x, g, owned[g]), tau.of_rows(g))
    record[g, contract.COL_TARGET_BITS] = y_t.view(torch.int32).to(torch.int64)
    record[:, contract.COL_OWNERS] = (owned >= 0).to(torch.int64)
    record = autograd.combine(record, call)
    fwd = autograd.finish(row_max, record, target, tau, call, ranks)
    return fwd._replace(fin=kept.malformed(fwd.fin, ranks))


_SUM_COLS = (contract.COL_E_HI, contract.COL_E_LO, contract.COL_W_HI, contract.COL_W_LO)


class ReplayFunction(torch.autograd.Function):
    """forward(); backward: selected_logprobs' gradient over the kept set, computed on the
    kept entries alone (contract.grad_block, the definition every backend's gradient
    reproduces bit for bit), +0 elsewhere, NaN across a bad row a gradient flows into."""

    @staticmethod
    def forward(ctx, x, target, call):
        ctx.call = call
        fwd = forward(x, target, call)
        if call.validate:
            autograd.validate_rows(fwd, target, call)
        return autograd.save_forward(ctx, (x, target), fwd)

    @staticmethod
    @autograd.once_differentiable
    def backward(ctx, g_logprobs, g_entropy, g_lse):
        (x, target), stats, tau = autograd.saved_grad_stats(ctx, (g_logprobs, g_entropy, g_lse))
        call = ctx.call
        r, c, y = _entries(x, call)
        owned = call.plan.target_columns(target, x.shape[-1])
        per = contract.GradStats(*(s[r] for s in stats))
        tau_e = tau.of_rows(r).unsqueeze(-1) if tau.per_row else tau.scalar
        g = contract.grad_block(
            y.unsqueeze(-1), torch.ones(1, 1, dtype=torch.bool, device=y.device), per,
            torch.where(c == owned[r], 0, -1), tau_e, call.plan.with_entropy, x.dtype,
        )  # fmt: skip
        out = torch.zeros(x.shape, dtype=x.dtype, device=x.device)
        if x.dim() == 2:
            out[r, c] = g[:, 0]
            out[stats.row_nan] = float("nan")
        else:
            t_len = x.shape[1]
            out[r // t_len, r % t_len, c] = g[:, 0]
            nan_rows = torch.nonzero(stats.row_nan).flatten()
            out[nan_rows // t_len, nan_rows % t_len] = float("nan")
        return out, None, None


def at(x: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """x[row, col] of a row_view ((N, V) or (B, T, V) rows) at global rows: no copy of x."""
    if x.dim() == 2:
        return x[rows, cols]
    return x[rows // x.shape[1], rows % x.shape[1], cols]


# --- the public function ---


@eager_only
def replay_logprobs(
    vocab_parallel_logits: torch.Tensor,
    target: torch.Tensor,
    kept_ids: torch.Tensor,
    kept_offsets: torch.Tensor,
    *,
    temperature: float | torch.Tensor = 1.0,
    tp_group=None,
    vocab_start: int | None = None,
    vocab_size: int | None = None,
    ignore_index: int = -100,
    with_entropy: bool = False,
    validate: bool = True,
    backend="auto",
) -> KeptLogprobs:
    """The log-softmax over the kept set a rollout engine returned (docs/numerics.md
    section 14): `selected_logprobs(..., keep_mask=<that set>)` without the mask.

    Args as `selected_logprobs`, plus:
        kept_ids: (nnz,) int32 / int64 global token ids, row after row; each row's sorted
            and unique (vLLM's SamplingMask; exactlogp.integrations.kept_csr builds this
            from the lists vLLM and SGLang return). Every rank passes the whole set (ids
            of other shards are skipped, never gathered).
        kept_offsets: (N + 1,) int32 / int64: row r holds kept_ids[offsets[r]:offsets[r+1]]
            (N: the rows of target); an ignored row's set may be empty.

    Returns a KeptLogprobs: logprobs, entropy, lse (fp32, target's shape; unpacks as the
    three) and the targets outside their kept set (`dropped`, `num_dropped`: logprob
    -inf, zero gradient; not an error). A malformed kept set -- offsets that do not
    bound a row, ids not strictly increasing, an id outside the vocabulary, an empty set
    on a row that is not ignored -- raises a ValueError naming the argument and the first
    such row (validate=True), else gives NaN in that row. The ranks of `tp_group` must
    pass the same kept sets (a row's ids ride the MAX as a hash: every rank raises, or
    every output is NaN).
    """
    group = distributed.resolve(tp_group)
    options = dict(vocab_start=vocab_start, vocab_size=vocab_size, temperature=temperature,
                   ignore_index=ignore_index, with_entropy=with_entropy, validate=validate,
                   backend=backend)  # fmt: skip
    with distributed.serialized(group):
        call = _replay_call(vocab_parallel_logits, target, kept_ids, kept_offsets, group,
                            options)  # fmt: skip
        x = row_view(vocab_parallel_logits)
        dropped, t_used = targets(call, target)
        if torch.is_grad_enabled() and vocab_parallel_logits.requires_grad:
            lp, entropy, lse = ReplayFunction.apply(x, t_used, call)
        else:
            fwd = forward(x, t_used, call)
            if call.validate:
                autograd.validate_rows(fwd, t_used, call)
            lp, entropy, lse = fwd.fin.logprobs, fwd.fin.entropy, fwd.fin.lse
    return kept_result(call, dropped, lp, entropy, lse)


@eager_only
def linear_replay_logprobs(
    hidden: torch.Tensor,
    weight,
    target: torch.Tensor,
    kept_ids: torch.Tensor,
    kept_offsets: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    tp_group=None,
    vocab_start: int | None = None,
    vocab_size: int | None = None,
    temperature: float | torch.Tensor = 1.0,
    logit_scale: float = 1.0,
    ignore_index: int = -100,
    with_entropy: bool = False,
    validate: bool = True,
    backend="auto",
) -> KeptLogprobs:
    """replay_logprobs of the exact logits linear_logits(hidden, weight, bias, logit_scale)
    -- bitwise the same outputs and gradients -- from the hidden states, as
    linear_selected_logprobs computes them: in blocks of rows, without [N, V] logits; the
    kept sets become the dense keep mask of one block of rows (forward) or of weight rows
    (backward) at a time, never of the whole shard. Arguments as linear_selected_logprobs
    and replay_logprobs."""
    weight, prepared = unwrap(weight)
    group = distributed.resolve(tp_group)

    def build() -> Call:
        call = linear_call(
            hidden=hidden, weight=weight, bias=bias, logit_scale=logit_scale, target=target,
            group=group, vocab_start=vocab_start, vocab_size=vocab_size,
            temperature=temperature, ignore_index=ignore_index, with_entropy=with_entropy,
            validate=validate, backend=backend, kind=agreement.KIND_LINEAR_REPLAY,
        )  # fmt: skip
        return with_kept(call, kept_ids, kept_offsets, target, hidden.device)

    with distributed.serialized(group):
        call = agreement.checked(group, validate, device_of(hidden, group), build)
        dropped, t_used = targets(call, target)
        outputs = LinearSelectedLogprobsFunction.apply(
            hidden.reshape(-1, hidden.shape[-1]), weight, bias, t_used, call, prepared,
            torch.is_grad_enabled(),
        )  # fmt: skip
    return kept_result(call, dropped, *outputs)
