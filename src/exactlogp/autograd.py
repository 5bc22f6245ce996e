"""One autograd.Function for every backend: the forward pipeline and its backward.

logits shard --backend.row_max--> (N,) fp32 --all_reduce(MAX) with the agreement fields--> M
  (or `local_max`, that row max as the logits' producer found it: the fused LM head's kernel)
logits shard --backend.partials(M)--> (N, 8) int64 --all_reduce(SUM)--> record
record --backend.finalize (= contract.finalize)--> logprobs, entropy, lse + row stats
without a TP group: backend.forward_unsharded does all of the above (a backend may fuse it)
backward: backend.grad(logits, stats) -- elementwise, no collective

The collective stages (global_max, combine, finish) are defined here once; the fused LM
head runs forward_pipeline per block of rows, the exact cut (cut/) its own local passes
between them.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from . import agreement, contract, distributed, validation
from .call import Call
from .temperature import Temperature


class Forward(NamedTuple):
    row_max: torch.Tensor  # (N,) fp32, global
    fin: contract.Finalized
    record: torch.Tensor  # (N, NUM_COLS) int64, combined
    ranks: agreement.RankCheck | None  # what the ranks agreed on, with a TP group


def forward_pipeline(
    logits: torch.Tensor,  # (N, V_local), or (B, T, V_local) rows (backends.base.row_view)
    target: torch.Tensor,  # (N,) int64
    temperature: Temperature,  # of these rows: call.temperature, or a block's (take)
    keep_mask: torch.Tensor | None,  # (N, V_local) bool
    call: Call,
    row_hash: torch.Tensor | None = None,  # (2, N) more per-row values the ranks share
    local_max: torch.Tensor | None = None,  # (N,) fp32 backend.row_max of logits, if known
    keep_stats: bool = True,  # False: no gradient will read fin's statistics
) -> Forward:
    plan, backend = call.plan, call.backend
    if not call.group.distributed:  # the whole vocabulary is here: nothing crosses ranks
        if local_max is None:
            row_max, record, fin = backend.forward_unsharded(
                logits, target, temperature, keep_mask, plan, keep_stats
            )
        else:  # no max pass: only the record
            record = backend.partials(logits, target, temperature, keep_mask, local_max, plan)
            row_max, record, fin = backend.finish_unsharded(local_max, record, target,
                                                            temperature, plan)  # fmt: skip
        return Forward(row_max, fin, record, None)
    if local_max is None:
        local_max = backend.row_max(logits, temperature, keep_mask, plan)
    row_max, ranks = global_max(local_max, target, temperature, call, row_hash)
    record = backend.partials(logits, target, temperature, keep_mask, row_max, plan)
    return finish(row_max, combine(record, call), target, temperature, call, ranks)


# --- the stages every function shares: the core op, the fused head, the exact cut ---


def global_max(local_max, target, temperature: Temperature, call: Call, row_hash=None):
    """Stages 1-2 across the ranks: (the exact global row max (N,) fp32, RankCheck) from
    this rank's maxima, with the agreement values riding the one all_reduce(MAX) (the
    rows' targets and temperatures, `row_hash` (2, N): the function's own per-row values,
    the call's key and kind, the shards); (local_max, None) without a TP group."""
    group = call.group
    if not group.distributed:
        return local_max, None
    payload = agreement.max_payload(
        local_max, target, temperature, call.call_key, call.fields.kind, group, call.layout,
        row_hash,
    )  # fmt: skip
    distributed.all_reduce_max_(payload, group)
    return agreement.read_max(payload, target.shape[0], group, call.plan.vocab_size)


def combine(record: torch.Tensor, call: Call) -> torch.Tensor:
    """Stage 6: the (N, NUM_COLS) int64 record summed over the ranks, in place."""
    if call.group.distributed and record.shape[0]:
        distributed.all_reduce_sum_(record, call.group)
    return record


def finish(row_max, record, target, temperature: Temperature, call: Call, ranks) -> Forward:
    """Stage 7: the combined record finalized (rows poisoned where the ranks disagree)."""
    fin = call.backend.finalize(
        row_max, record, target, call.plan.vocab_size, call.plan.ignore_index,
        temperature.bad(), None if ranks is None else ranks.poison,
    )  # fmt: skip
    return Forward(row_max, fin, record, ranks)


def stop_disagreeing(call: Call, ranks: agreement.RankCheck, num_rows: int) -> None:
    """For a function that reads the MAX back on the host (the exact cut) and found the
    ranks disagree, so that no rank waits: with validate=True every rank raises (the
    caller's message); with validate=False, where some rank runs a function that does not
    read it back (NO_SYNC_KINDS: it goes on to its record's all_reduce(SUM) and returns
    NaN), this rank makes that SUM too, of zeros, and then returns NaN itself."""
    others = ranks.kinds.nonzero().flatten().tolist()  # a host sync, as the caller's
    if num_rows and any(kind in agreement.NO_SYNC_KINDS for kind in others):
        zeros = torch.zeros(num_rows, contract.NUM_COLS, dtype=torch.int64,
                            device=ranks.poison.device)  # fmt: skip
        distributed.all_reduce_sum_(zeros, call.group)


def validate_rows(forward: Forward, target, call: Call) -> None:
    """validate=True: raise on every rank for the first bad row (one host sync, in
    validation.raise_for_bad_rows)."""
    validation.raise_for_bad_rows(forward.fin.bad, forward.record, target, call, forward.ranks)


_ROW_STATS = ("s_hi", "s_lo", "log_s", "entropy64", "bad", "ignored")  # contract.RowStats


def save_forward(ctx, inputs: tuple, forward: Forward) -> tuple:
    """The end of an autograd.Function's forward over forward_pipeline: save `inputs`, the
    row max and the row statistics for saved_grad_stats; return (logprobs, entropy, lse),
    the entropy empty and non-differentiable without with_entropy. Needs ctx.call."""
    fin = forward.fin
    ctx.save_for_backward(*inputs, forward.row_max, *(getattr(fin, f) for f in _ROW_STATS))
    if ctx.call.with_entropy:
        return fin.logprobs, fin.entropy, fin.lse
    entropy = fin.entropy.new_empty(0)
    ctx.mark_non_differentiable(entropy)
    return fin.logprobs, entropy, fin.lse


def saved_grad_stats(ctx, grads: tuple):
    """In backward, after save_forward: (the saved inputs, contract.GradStats of the upstream
    `grads` (logprobs, entropy, lse), the Temperature the gradient divides by)."""
    saved = ctx.saved_tensors
    *inputs, row_max = saved[: -len(_ROW_STATS)]
    rows = contract.RowStats(*saved[-len(_ROW_STATS) :])
    g_logprobs, g_entropy, g_lse = grads
    g_entropy = g_entropy if ctx.call.with_entropy else None
    stats = contract.grad_stats(row_max, rows, g_logprobs, g_entropy, g_lse)
    return inputs, stats, ctx.call.temperature.gradient_divisor(stats)


def once_differentiable(backward):
    """Backward runs without building a graph; under create_graph=True its gradients are
    marked so that differentiating them again raises a clear error (torch's own
    once_differentiable only does so when the upstream gradients require grad, and else
    hands back tensors whose misuse reads "does not require grad")."""

    @functools.wraps(backward)
    def wrapper(ctx, *grads):
        with torch.no_grad():
            outputs = backward(ctx, *grads)
        if not torch.is_grad_enabled():
            return outputs
        marked = [i for i, g in enumerate(outputs) if isinstance(g, torch.Tensor)]
        err = torch._C._functions.DelayedError(
            b"exactlogp computes first derivatives only: its gradient cannot be "
            b"differentiated again (double backward through exactlogp is not supported)",
            len(marked),
        )
        flagged = err(*[outputs[i].detach().requires_grad_(True) for i in marked])
        flagged = flagged if isinstance(flagged, tuple) else (flagged,)
        out = list(outputs)
        for i, g in zip(marked, flagged, strict=True):
            out[i] = g
        return tuple(out)

    return wrapper


def checked_forward(logits, target, keep_mask, call: Call, keep_stats: bool = True) -> Forward:
    """forward_pipeline on the whole call, then (validate=True) the bad-row check."""
    forward = forward_pipeline(
        logits, target, call.temperature, keep_mask, call, keep_stats=keep_stats
    )
    if call.validate:
        validate_rows(forward, target, call)
    return forward


def selected_logprobs_rows(logits, target, keep_mask, call: Call):
    """SelectedLogprobsFunction.apply; where no gradient can flow (grad mode off, or logits
    that do not require grad) its forward alone: the same outputs, without the autograd
    bookkeeping that a small call would notice."""
    if torch.is_grad_enabled() and logits.requires_grad:
        return SelectedLogprobsFunction.apply(logits, target, keep_mask, call)
    fin = checked_forward(logits, target, keep_mask, call, keep_stats=False).fin
    return fin.logprobs, fin.entropy, fin.lse


class SelectedLogprobsFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, keep_mask, call: Call):
        forward = checked_forward(logits, target, keep_mask, call)
        ctx.call = call
        return save_forward(ctx, (logits, target, keep_mask), forward)

    @staticmethod
    @once_differentiable
    def backward(ctx, g_logprobs, g_entropy, g_lse):
        inputs, stats, temperature = saved_grad_stats(ctx, (g_logprobs, g_entropy, g_lse))
        logits, target, keep_mask = inputs
        call = ctx.call
        grad = call.backend.grad(logits, target, temperature, keep_mask, stats, call.plan)
        return grad.view(logits.shape), None, None, None
