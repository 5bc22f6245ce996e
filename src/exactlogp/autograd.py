"""One autograd.Function for every backend: the forward pipeline and its backward.

logits shard --backend.row_max--> (N,) fp32 --all_reduce(MAX) with the agreement fields--> M
  (or `local_max`, that row max as the logits' producer found it: the fused LM head's kernel)
logits shard --backend.partials(M)--> (N, 8) int64 --all_reduce(SUM)--> record
record --backend.finalize (= contract.finalize)--> logprobs, entropy, lse + row stats
without a TP group: backend.forward_unsharded does all of the above (a backend may fuse it)
backward: backend.grad(logits, stats) -- elementwise, no collective
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
    row_fields: torch.Tensor | None = None,  # (k, N) more per-row values the ranks share
    local_max: torch.Tensor | None = None,  # (N,) fp32 backend.row_max of logits, if known
) -> Forward:
    plan, backend, group = call.plan, call.backend, call.group
    n = target.shape[0]
    ranks = None
    if not group.distributed and local_max is not None:  # no max pass: only the record
        record = backend.partials(logits, target, temperature, keep_mask, local_max, plan)
        row_max, record, fin = backend.finish_unsharded(local_max, record, target, temperature,
                                                        plan)  # fmt: skip
    elif not group.distributed:  # the whole vocabulary is here: nothing crosses ranks
        row_max, record, fin = backend.forward_unsharded(
            logits, target, temperature, keep_mask, plan
        )
    else:
        # --- 1-2. exact global max; the agreement fields ride along ---
        if local_max is None:
            local_max = backend.row_max(logits, temperature, keep_mask, plan)
        row_max = local_max
        payload = agreement.max_payload(
            row_max, target, temperature, call.call_key, group, call.layout, row_fields
        )
        distributed.all_reduce_max_(payload, group)
        row_max, ranks = agreement.read_max(payload, n, group, plan.vocab_size, row_fields)
        # --- 3-5. exact local record ---
        record = backend.partials(logits, target, temperature, keep_mask, row_max, plan)
        # --- 6. combine across ranks ---
        if n:
            distributed.all_reduce_sum_(record, group)
        # --- 7. finish ---
        fin = backend.finalize(
            row_max, record, target, plan.vocab_size, plan.ignore_index,
            temperature.bad(), ranks.poison,
        )  # fmt: skip
    return Forward(row_max, fin, record, ranks)


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


def checked_forward(logits, target, keep_mask, call: Call) -> Forward:
    """forward_pipeline on the whole call, then (validate=True) the bad-row check."""
    forward = forward_pipeline(logits, target, call.temperature, keep_mask, call)
    if call.validate:
        validate_rows(forward, target, call)
    return forward


def selected_logprobs_rows(logits, target, keep_mask, call: Call):
    """SelectedLogprobsFunction.apply; where no gradient can flow (grad mode off, or logits
    that do not require grad) its forward alone: the same outputs, without the autograd
    bookkeeping that a small call would notice."""
    if torch.is_grad_enabled() and logits.requires_grad:
        return SelectedLogprobsFunction.apply(logits, target, keep_mask, call)
    fin = checked_forward(logits, target, keep_mask, call).fin
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
