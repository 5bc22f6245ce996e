"""One autograd.Function for every backend: the forward pipeline and its backward.

logits shard --backend.row_max--> (N,) fp32 --all_reduce(MAX)--> M
logits shard --backend.partials(M)--> (N, 8) int64 --all_reduce(SUM)--> record
record --backend.finalize (= contract.finalize)--> logprobs, entropy, lse + row stats
backward: backend.grad(logits, stats) -- elementwise, no collective
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import contract, distributed, validation
from .backends import Backend, ShardPlan
from .contract import GradStats


@dataclass(frozen=True)
class Options:
    plan: ShardPlan
    tp_group: object  # ProcessGroup or None
    world_size: int
    validate: bool
    backend: Backend
    target_shape: tuple[int, ...]


def forward_pipeline(
    logits: torch.Tensor,  # (N, V_local)
    target: torch.Tensor,  # (N,) int64
    temperature: float | torch.Tensor,  # float or (N,) fp32
    keep_mask: torch.Tensor | None,  # (N, V_local) bool
    opts: Options,
) -> tuple[torch.Tensor, contract.Finalized]:
    plan, backend, group = opts.plan, opts.backend, opts.tp_group
    # --- 1-2. exact global max ---
    row_max = backend.row_max(logits, temperature, keep_mask, plan)
    if logits.shape[0]:
        distributed.all_reduce_max_(row_max, group)
    # --- 3-5. exact local record ---
    record = backend.partials(logits, target, temperature, keep_mask, row_max, plan)
    # --- 6. combine across ranks ---
    if logits.shape[0]:
        distributed.all_reduce_sum_(record, group)
    # --- 7. finish ---
    bad_tau = None
    if isinstance(temperature, torch.Tensor):
        bad_tau = ~(torch.isfinite(temperature) & (temperature > 0))
    fin = backend.finalize(row_max, record, target, plan.vocab_size, plan.ignore_index, bad_tau)
    if opts.validate:
        validation.raise_for_bad_rows(
            fin.bad, record, target, opts.target_shape, temperature,
            plan.vocab_size, plan.ignore_index, opts.world_size,
        )  # fmt: skip
    return row_max, fin


class SelectedLogprobsFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, temperature_tensor, keep_mask, scalar_temperature, opts):
        temperature = scalar_temperature if temperature_tensor is None else temperature_tensor
        row_max, fin = forward_pipeline(logits, target, temperature, keep_mask, opts)
        ctx.opts = opts
        ctx.scalar_temperature = scalar_temperature
        ctx.save_for_backward(
            logits, target, temperature_tensor, keep_mask,
            row_max, fin.s_hi, fin.log_s, fin.entropy64, fin.bad, fin.ignored,
        )  # fmt: skip
        entropy = fin.entropy if opts.plan.with_entropy else fin.entropy.new_empty(0)
        if not opts.plan.with_entropy:
            ctx.mark_non_differentiable(entropy)
        return fin.logprobs, entropy, fin.lse

    @staticmethod
    def backward(ctx, g_logprobs, g_entropy, g_lse):
        (logits, target, temperature_tensor, keep_mask,
         row_max, s_hi, log_s, entropy64, bad, ignored) = ctx.saved_tensors  # fmt: skip
        opts = ctx.opts
        temperature = ctx.scalar_temperature
        if temperature_tensor is not None:
            # an ignored row's temperature is never used: its gradient is +0 even if tau <= 0
            temperature = torch.where(ignored, 1.0, temperature_tensor)

        def per_row(g):
            if g is None or g.numel() == 0:
                return torch.zeros_like(s_hi)
            return torch.where(ignored, 0.0, g.to(torch.float64))

        g_lp, g_lse = per_row(g_logprobs), per_row(g_lse)
        g_ent = per_row(g_entropy if opts.plan.with_entropy else None)
        stats = GradStats(
            row_max=row_max, s_hi=s_hi, log_s=log_s, entropy64=entropy64,
            coef_a=g_lse - g_lp, coef_b=g_ent, coef_t=g_lp, row_nan=bad != 0,
        )  # fmt: skip
        grad = opts.backend.grad(logits, target, temperature, keep_mask, stats, opts.plan)
        return grad, None, None, None, None, None
