"""vime_default: the default (not true-on-policy) math of vime's
`calculate_log_probs_and_entropy` on vocab-parallel logits.

Re-implemented here from its published description, unless the real `vime` package
imports (then its function runs):

  x = fp32(logits); m = all_reduce(MAX, rowmax(x)); e = exp(x - m)
  s = all_reduce(SUM, rowsum(e))                      # float sum over ranks
  t = all_reduce(SUM, x_target - m on the owner, 0 elsewhere)
  logprob = t - log(s)

The vocabulary is padded as Megatron pads it, since vime trains on Megatron.
"""

from __future__ import annotations

import torch

from .base import ShardContext, owned_target, real_or_reimplementation
from .megatron import MegatronCandidate

REAL_MODULE = "vime.utils.ppo_utils"
REAL_FUNCTION = "calculate_log_probs_and_entropy"


class VimeDefault(MegatronCandidate):
    name = "vime_default"
    package = "vime"

    def __init__(self):
        self._real = real_or_reimplementation(
            self,
            REAL_MODULE,
            REAL_FUNCTION,
            real=f"{REAL_MODULE}.{REAL_FUNCTION} (the real package)",
            reimplementation="re-implementation of vime's default calculate_log_probs_and_"
            "entropy: all_reduce MAX, then float all_reduce SUM of sum-exp and of target logit",
        )

    def third_party(self) -> list[dict]:
        return super().third_party() if self._real is not None else []

    def build(self, ctx: ShardContext):
        if self._real is None:
            return lambda logits, target: vime_default_logprobs(logits, target, ctx)
        self.attach_megatron(ctx)
        return on_megatron_ranks(self._real, ctx)


def on_megatron_ranks(real, ctx: ShardContext):
    """A `calculate_log_probs_and_entropy(logits, target, tp_group)` of the slime family
    (vime, miles) as a candidate's function: it may work in place, so it gets a copy."""

    def run(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        log_prob, _ = real(logits.clone(), target, ctx.group)
        return log_prob.reshape(-1).float()

    return run


def vime_default_logprobs(logits: torch.Tensor, target: torch.Tensor, ctx: ShardContext):
    import torch.distributed as dist

    x = logits.float()  # (N, V_local)
    row_max = x.amax(dim=-1)
    dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=ctx.group)
    x = x - row_max.unsqueeze(-1)
    sum_exp = x.exp().sum(dim=-1)
    owned, local = owned_target(target, ctx)
    target_logit = torch.where(owned, x.gather(-1, local.unsqueeze(-1)).squeeze(-1), 0.0)
    dist.all_reduce(sum_exp, op=dist.ReduceOp.SUM, group=ctx.group)
    dist.all_reduce(target_logit, op=dist.ReduceOp.SUM, group=ctx.group)
    return target_logit - sum_exp.log()
