"""megatron_fused_ce: the real megatron-core `fused_vocab_parallel_cross_entropy`, negated.

Same math as megatron_ce with the two SUMs batched into one float all_reduce; its
elementwise stages go through megatron-core's jit fuser (torch.compile in this version),
so the first call of every new shape compiles. Runs where it imports and compiles.
"""

from __future__ import annotations

import torch

from .base import ShardContext, import_or_unavailable
from .megatron import MegatronCandidate
from .megatron_ce import own_copy


class MegatronFusedCE(MegatronCandidate):
    name = "megatron_fused_ce"
    summary = (
        "-megatron.core.fusions.fused_cross_entropy.fused_vocab_parallel_cross_entropy: "
        "megatron_ce's math, jit-fused, one float all_reduce(SUM) of [target logit, sum-exp]"
    )
    implementation = "real"

    def check_available(self, device: torch.device) -> None:
        import_or_unavailable("megatron.core.fusions.fused_cross_entropy")

    def build(self, ctx: ShardContext):
        self.attach_megatron(ctx)
        from megatron.core import parallel_state
        from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy

        group = parallel_state.get_tensor_model_parallel_group()

        def run(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            return -fused_vocab_parallel_cross_entropy(own_copy(logits), target, group)

        return run
