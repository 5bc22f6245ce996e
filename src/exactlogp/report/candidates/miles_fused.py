"""miles_fused: miles' default logprob path on the hidden-state workload -- the real
megatron-core `fused_vocab_parallel_cross_entropy` on a clone of the logits that a plain
torch LM head materialises.

miles trains on Megatron. Its actor's output layer (Megatron's ColumnParallelLinear)
computes this rank's logits in the model dtype, Megatron's Float16Module hands them on in
fp32, `get_responses` divides them by the rollout temperature, and
`calculate_log_probs_and_entropy` (miles/utils/ppo_utils.py, true-on-policy mode off,
the default) calls

    compute_log_probs(logits.clone(), tokens, tp_group)
      = -fused_vocab_parallel_cross_entropy(logits.unsqueeze(1), tokens.unsqueeze(1), tp_group)

Where the real `miles` package imports, its compute_log_probs runs; otherwise those
three lines are re-implemented here around the real megatron-core function (the row
says so). The vocabulary is padded as Megatron pads it; the padding columns of the
materialised logits are -inf, as the logits workload has them, so they never change
the softmax.
"""

from __future__ import annotations

import torch

from ..workload import TEMPERATURE
from .base import (
    ShardContext,
    import_or_unavailable,
    package_version,
    real_or_reimplementation,
)
from .megatron import MegatronCandidate

REAL_MODULE = "miles.utils.ppo_utils"
REAL_FUNCTION = "compute_log_probs"
FUSED_MODULE = "megatron.core.fusions.fused_cross_entropy"


def compute_log_probs(logits: torch.Tensor, tokens: torch.Tensor, process_group):
    """miles' compute_log_probs with true_on_policy_mode off: (N, 1) logprobs."""
    from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy

    return -fused_vocab_parallel_cross_entropy(
        logits.unsqueeze(1), tokens.unsqueeze(1), process_group
    )


def lm_head_logits(hidden: torch.Tensor, weight: torch.Tensor, real_cols: int) -> torch.Tensor:
    """(N, V_local) fp32: Megatron's output layer in the inputs' dtype, then fp32; the
    padding columns (from `real_cols` on) -inf."""
    logits = (hidden @ weight.T).float()
    logits[:, real_cols:] = float("-inf")
    return logits


class MilesFused(MegatronCandidate):
    name = "miles_fused"
    kind = "hidden_states"
    package = "miles"

    def __init__(self):
        self._real = real_or_reimplementation(
            self,
            REAL_MODULE,
            REAL_FUNCTION,
            real=f"{REAL_MODULE}.{REAL_FUNCTION} (the real package) on fp32(hidden @ "
            "weight.T) / T, cloned",
            reimplementation="miles' compute_log_probs default path, its three lines "
            f"re-implemented around the real {FUSED_MODULE}.fused_vocab_parallel_cross_"
            "entropy: logits = hidden @ weight.T in the inputs' dtype, fp32, / T, cloned; "
            "float all_reduce MAX, then one float all_reduce(SUM) of [target logit, sum-exp]",
        )

    def check_available(self, device: torch.device) -> None:
        import_or_unavailable(FUSED_MODULE)

    def third_party(self) -> list[dict]:
        found = [{"name": "megatron-core", "version": package_version("megatron-core")}]
        if self._real is not None:
            found.append({"name": self.package, "version": package_version(self.package)})
        return found

    def build(self, ctx: ShardContext):
        self.attach_megatron(ctx)
        from megatron.core import parallel_state

        group = parallel_state.get_tensor_model_parallel_group()
        compute = self._real or compute_log_probs
        weight = ctx.weight
        real_cols = max(0, min(ctx.shard_width, ctx.vocab_size - ctx.vocab_start))

        def run(hidden: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            logits = lm_head_logits(hidden, weight, real_cols).div(TEMPERATURE)
            return compute(logits.clone(), target, group).reshape(-1)

        return run
