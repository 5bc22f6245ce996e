"""The processed logprobs: the contract's log-softmax over the kept set of a cut.

The record of a cut row sums its kept columns' terms (exact integers, so the order and
the columns left out, whose terms are not in the sum, change nothing): the same record as
the partials pass over the keep mask, whose other columns add nothing. Rows without a cut
take that pass; a block that kept its mask (a wide kept set) sends the whole call through
the pass over the keep mask. Then the shared stages: autograd.combine, autograd.finish.
Backward is selected_logprobs' gradient over the keep mask, from the same row statistics.
"""

from __future__ import annotations

import torch

from .. import autograd, contract
from .blocks import keep_mask, kept_at
from .candidates import at
from .driver import Cut

_SUM_COLS = (contract.COL_E_HI, contract.COL_E_LO, contract.COL_W_HI, contract.COL_W_LO)


def forward(cut: Cut, target: torch.Tensor, call) -> autograd.Forward:
    """Stages 3-7 of the processed forward on this cut (`call`: the cut's, with the
    caller's with_entropy), then (validate=True) the bad-row check. A poisoned cut gives
    NaN in every row without a collective (its ranks stopped together)."""
    n = target.shape[0]
    if cut.poisoned:
        record = torch.zeros(n, contract.NUM_COLS, dtype=torch.int64, device=target.device)
        poison = torch.ones(n, dtype=torch.bool, device=target.device)
        fin = call.backend.finalize(
            cut.row_max, record, target, call.plan.vocab_size, call.plan.ignore_index,
            call.temperature.bad(), poison,
        )  # fmt: skip
        return autograd.Forward(cut.row_max, fin, record, None)
    forward = autograd.finish(
        cut.row_max, autograd.combine(_record(cut, target, call), call), target,
        call.temperature, call, None,
    )  # fmt: skip
    if call.validate:
        autograd.validate_rows(forward, target, call)
    return forward


def _record(cut: Cut, target: torch.Tensor, call) -> torch.Tensor:
    """(N, NUM_COLS) int64: this shard's record of the log-softmax over the kept set."""
    shard, plan = cut.shard, call.plan
    x, n, v_local = shard.x, target.shape[0], shard.x.shape[-1]
    tau = call.temperature
    if any(b.keep is not None for b in cut.blocks):  # wide kept sets: the mask's pass
        keep = keep_mask(cut.blocks, n, shard).view(x.shape)
        return call.backend.partials(x, target, tau, keep, cut.row_max, plan)
    owned = plan.target_columns(target, v_local)
    if all(bool(b.cut.all()) for b in cut.blocks):  # every row cut: no pass at all
        record = torch.zeros(n, contract.NUM_COLS, dtype=torch.int64, device=x.device)
        g = torch.nonzero(owned >= 0).flatten()
        y_t = contract.scaled_logits(at(x, g, owned[g]), tau.of_rows(g))
        record[g, contract.COL_TARGET_BITS] = y_t.view(torch.int32).to(torch.int64)
        record[:, contract.COL_OWNERS] = (owned >= 0).to(torch.int64)
    else:
        record = call.backend.partials(x, target, tau, None, cut.row_max, plan)
    record[:, contract.COL_TARGET_MASKED] = ((owned >= 0) & ~kept_at(cut.blocks, owned)).to(
        torch.int64
    )
    cols = _SUM_COLS[: 4 if plan.with_entropy else 2]
    m64 = cut.row_max.to(torch.float64)
    for b in cut.blocks:
        if bool(b.cut.any()):
            _sum_kept(record[b.rows], b, m64, cols, plan.with_entropy)
    return record


def _sum_kept(part: torch.Tensor, b, m64: torch.Tensor, cols, with_entropy: bool) -> None:
    """The cut rows of one block's record (`part`, a view) from its kept columns' terms."""
    nb = b.rows.stop - b.rows.start
    limbs = contract.term_limbs(b.y.to(torch.float64) - m64[b.r + b.rows.start], with_entropy)
    sums = torch.zeros(nb, len(cols), dtype=torch.int64, device=part.device)
    sums.index_add_(0, b.r, torch.stack(limbs, 1))
    for i, col in enumerate(cols):
        part[:, col] = torch.where(b.cut, sums[:, i], part[:, col])
    nonfinite = b.bad.sum(1) if b.bad is not None else torch.zeros_like(sums[:, 0])
    part[:, contract.COL_NONFINITE] = torch.where(b.cut, nonfinite, part[:, contract.COL_NONFINITE])


class ProcessedFunction(torch.autograd.Function):
    """forward(), and in backward the gradient of selected_logprobs over the keep mask
    (backend.grad from the same row statistics: the same bits), the mask built then."""

    @staticmethod
    def forward(ctx, logits, cut, target, call):
        ctx.call, ctx.cut = call, cut
        return autograd.save_forward(ctx, (logits, target), forward(cut, target, call))

    @staticmethod
    @autograd.once_differentiable
    def backward(ctx, g_logprobs, g_entropy, g_lse):
        grads = (g_logprobs, g_entropy, g_lse)
        inputs, stats, temperature = autograd.saved_grad_stats(ctx, grads)
        logits, target = inputs
        call, cut = ctx.call, ctx.cut
        n = target.shape[0]
        if cut.poisoned:  # nothing kept: NaN where a gradient flows, else +0
            keep = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device)
        else:
            keep = keep_mask(cut.blocks, n, cut.shard).view(logits.shape)
        grad = call.backend.grad(logits, target, temperature, keep, stats, call.plan)
        return grad.view(logits.shape), None, None, None
