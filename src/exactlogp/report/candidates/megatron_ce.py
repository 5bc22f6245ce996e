"""megatron_ce: the real megatron-core `vocab_parallel_cross_entropy`, negated.

Megatron's parallel state is initialised over the harness's ranks, so its TP group holds
exactly the ranks of the world; the vocabulary is padded as Megatron pads it (a multiple
of 128 * TP). Three float collectives per call: MAX of the row max, SUM of the target
logit, SUM of the sum of exponentials.
"""

from __future__ import annotations

import warnings

import torch

from .base import (
    Candidate,
    ShardContext,
    import_or_unavailable,
    package_version,
    round_up,
)

MEGATRON_PAD_MULTIPLE = 128  # Megatron's default make-vocab-size-divisible-by


class MegatronCE(Candidate):
    name = "megatron_ce"
    summary = (
        "-megatron.core.tensor_parallel.vocab_parallel_cross_entropy(logits, target): "
        "fp32 max, exp, local sum, float all_reduce(SUM) of sum-exp and target logit"
    )
    implementation = "real"

    def check_available(self, device: torch.device) -> None:
        import_or_unavailable("megatron.core.tensor_parallel")

    def padded_vocab(self, vocab_size: int, tp: int) -> int:
        return round_up(vocab_size, MEGATRON_PAD_MULTIPLE * tp)

    def third_party(self) -> list[dict]:
        return [{"name": "megatron-core", "version": package_version("megatron-core")}]

    def build(self, ctx: ShardContext):
        setup_megatron(ctx)
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

        def run(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            # Megatron upcasts with .float() and then works in place: a bf16 input is
            # left alone, an fp32 one would be overwritten, so fp32 gets a copy.
            x = logits.clone() if logits.dtype == torch.float32 else logits
            return -vocab_parallel_cross_entropy(x, target)

        return run

    def teardown(self) -> None:
        teardown_megatron()


def setup_megatron(ctx: ShardContext) -> None:
    """Megatron's parallel state with TP = ctx.tp over the current world."""
    with warnings.catch_warnings():
        # megatron-core warns at import when Transformer Engine / Apex are absent
        warnings.simplefilter("ignore")
        from megatron.core import parallel_state

        parallel_state.initialize_model_parallel(tensor_model_parallel_size=ctx.tp)


def teardown_megatron() -> None:
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
