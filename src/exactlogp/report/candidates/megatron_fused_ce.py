"""megatron_fused_ce: the real megatron-core `fused_vocab_parallel_cross_entropy`, negated.

Same math as megatron_ce with the two SUMs batched into one float all_reduce; its
elementwise stages go through megatron-core's jit fuser (torch.compile in this version),
so the first call of every new shape compiles. Runs where it imports and compiles.
"""

from __future__ import annotations

import torch

from .base import Candidate, ShardContext, import_or_unavailable, package_version
from .megatron_ce import MegatronCE, setup_megatron, teardown_megatron


class MegatronFusedCE(Candidate):
    name = "megatron_fused_ce"
    summary = (
        "-megatron.core.fusions.fused_cross_entropy.fused_vocab_parallel_cross_entropy: "
        "megatron_ce's math, jit-fused, one float all_reduce(SUM) of [target logit, sum-exp]"
    )
    implementation = "real"

    def check_available(self, device: torch.device) -> None:
        import_or_unavailable("megatron.core.fusions.fused_cross_entropy")

    def padded_vocab(self, vocab_size: int, tp: int) -> int:
        return MegatronCE().padded_vocab(vocab_size, tp)

    def third_party(self) -> list[dict]:
        return [{"name": "megatron-core", "version": package_version("megatron-core")}]

    def build(self, ctx: ShardContext):
        setup_megatron(ctx)
        from megatron.core import parallel_state
        from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy

        group = parallel_state.get_tensor_model_parallel_group()

        def run(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            x = logits.clone() if logits.dtype == torch.float32 else logits
            return -fused_vocab_parallel_cross_entropy(x, target, group)

        return run

    def teardown(self) -> None:
        teardown_megatron()
