"""megatron_ce: the real megatron-core `vocab_parallel_cross_entropy`, negated.

Megatron's parallel state is initialised over the harness's ranks, so its TP group holds
exactly the ranks of the world; the vocabulary is padded as Megatron pads it (a multiple
of 128 * TP). Three float collectives per call: MAX of the row max, SUM of the target
logit, SUM of the sum of exponentials.
"""

from __future__ import annotations

import torch

from .base import ShardContext, import_or_unavailable
from .megatron import MegatronCandidate


class MegatronCE(MegatronCandidate):
    name = "megatron_ce"
    summary = (
        "-megatron.core.tensor_parallel.vocab_parallel_cross_entropy(logits, target): "
        "fp32 max, exp, local sum, float all_reduce(SUM) of sum-exp and target logit"
    )
    implementation = "real"
    supports_backward = True

    def check_available(self, device: torch.device) -> None:
        import_or_unavailable("megatron.core.tensor_parallel")

    def build(self, ctx: ShardContext):
        self.attach_megatron(ctx)
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

        def run(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            return -vocab_parallel_cross_entropy(own_copy(logits), target)

        return run


def own_copy(logits: torch.Tensor) -> torch.Tensor:
    """Megatron upcasts with .float() and then works in place: a bf16 or fp16 input is left
    alone, an fp32 one would be overwritten, so fp32 gets a copy (part of the timed work)."""
    return logits.clone() if logits.dtype == torch.float32 else logits
