"""The harness's one Megatron set-up: megatron-core's parallel state over the current
world, Megatron's vocabulary padding, and the base of every candidate that runs on them.

The parallel state is counted: candidates built side by side in one world (the report's
timing world, the bench) share one, and the last to be torn down destroys it.
"""

from __future__ import annotations

import warnings

from .base import Candidate, ShardContext, package_version, round_up

MEGATRON_PAD_MULTIPLE = 128  # Megatron's default make-vocab-size-divisible-by

_users = 0  # holders of the parallel state in this process


def setup_megatron(tp: int) -> None:
    """Megatron's parallel state with TP = `tp` over the current world (or join it)."""
    global _users
    with warnings.catch_warnings():
        # megatron-core warns at import when Transformer Engine / Apex are absent
        warnings.simplefilter("ignore")
        from megatron.core import parallel_state

        if _users == 0:
            parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
        elif parallel_state.get_tensor_model_parallel_world_size() != tp:
            raise ValueError(
                f"Megatron's parallel state has TP "
                f"{parallel_state.get_tensor_model_parallel_world_size()}, asked for tp={tp}"
            )
    _users += 1


def teardown_megatron() -> None:
    global _users
    _users -= 1
    if _users == 0:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()


class MegatronCandidate(Candidate):
    """A candidate on Megatron's terms: its padding, and its parallel state once attached."""

    package = "megatron-core"  # the real third-party package it calls
    _attached = False

    def padded_vocab(self, vocab_size: int, tp: int) -> int:
        return round_up(vocab_size, MEGATRON_PAD_MULTIPLE * tp)

    def third_party(self) -> list[dict]:
        return [{"name": self.package, "version": package_version(self.package)}]

    def attach_megatron(self, ctx: ShardContext) -> None:
        """Set up (or share) the parallel state; `teardown` releases it."""
        setup_megatron(ctx.tp)
        self._attached = True

    def teardown(self) -> None:
        if self._attached:
            self._attached = False
            teardown_megatron()
