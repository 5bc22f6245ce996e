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

from .base import Candidate, ShardContext, Unavailable, import_or_unavailable, owned_target
from .megatron_ce import MegatronCE, setup_megatron, teardown_megatron

REAL_MODULE = "vime.utils.ppo_utils"


class VimeDefault(Candidate):
    name = "vime_default"

    def __init__(self):
        try:
            self._real = import_or_unavailable(REAL_MODULE).calculate_log_probs_and_entropy
            self.implementation = "real"
            self.summary = f"{REAL_MODULE}.calculate_log_probs_and_entropy (the real package)"
            self.note = None
        except (Unavailable, AttributeError) as exc:
            self._real = None
            self.implementation = "re-implementation"
            self.summary = (
                "re-implementation of vime's default calculate_log_probs_and_entropy: "
                "all_reduce MAX, then float all_reduce SUM of sum-exp and of target logit"
            )
            self.note = f"real package not importable: {exc}"

    def padded_vocab(self, vocab_size: int, tp: int) -> int:
        return MegatronCE().padded_vocab(vocab_size, tp)

    def describe(self) -> dict:
        info = super().describe()
        if self.note:
            info["note"] = self.note
        return info

    def third_party(self) -> list[dict]:
        if self._real is None:
            return []
        from .base import package_version

        return [{"name": "vime", "version": package_version("vime")}]

    def build(self, ctx: ShardContext):
        if self._real is not None:
            setup_megatron(ctx)
            real = self._real

            def run_real(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
                log_prob, _ = real(logits.clone(), target, ctx.group)
                return log_prob.reshape(-1).float()

            return run_real
        return lambda logits, target: vime_default_logprobs(logits, target, ctx)

    def teardown(self) -> None:
        if self._real is not None:
            teardown_megatron()


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
