"""miles_fused: miles' logprob computation, where the real `miles` package imports.

There is no re-implementation: without the package the report says so, with the exact
import error.
"""

from __future__ import annotations

import torch

from .base import Candidate, ShardContext, import_or_unavailable, package_version
from .megatron_ce import MegatronCE, setup_megatron, teardown_megatron

REAL_MODULE = "miles.utils.ppo_utils"


class MilesFused(Candidate):
    name = "miles_fused"
    summary = f"{REAL_MODULE}.calculate_log_probs_and_entropy (the real package)"
    implementation = "real"

    def check_available(self, device: torch.device) -> None:
        import_or_unavailable("miles")
        module = import_or_unavailable(REAL_MODULE)
        if not hasattr(module, "calculate_log_probs_and_entropy"):
            from .base import Unavailable

            raise Unavailable(f"{REAL_MODULE} has no calculate_log_probs_and_entropy")

    def padded_vocab(self, vocab_size: int, tp: int) -> int:
        return MegatronCE().padded_vocab(vocab_size, tp)

    def third_party(self) -> list[dict]:
        return [{"name": "miles", "version": package_version("miles")}]

    def build(self, ctx: ShardContext):
        setup_megatron(ctx)
        fn = import_or_unavailable(REAL_MODULE).calculate_log_probs_and_entropy

        def run(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            log_prob, _ = fn(logits.clone(), target, ctx.group)
            return log_prob.reshape(-1).float()

        return run

    def teardown(self) -> None:
        teardown_megatron()
