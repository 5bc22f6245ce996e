"""miles_fused: miles' logprob computation, where the real `miles` package imports.

There is no re-implementation: without the package the report says so, with the exact
import error.
"""

from __future__ import annotations

import torch

from .base import ShardContext, import_or_unavailable, real_attribute
from .megatron import MegatronCandidate
from .vime_default import REAL_FUNCTION, on_megatron_ranks

REAL_MODULE = "miles.utils.ppo_utils"


class MilesFused(MegatronCandidate):
    name = "miles_fused"
    summary = f"{REAL_MODULE}.{REAL_FUNCTION} (the real package)"
    implementation = "real"
    package = "miles"

    def check_available(self, device: torch.device) -> None:
        import_or_unavailable("miles")
        real_attribute(REAL_MODULE, REAL_FUNCTION)

    def build(self, ctx: ShardContext):
        self.attach_megatron(ctx)
        return on_megatron_ranks(real_attribute(REAL_MODULE, REAL_FUNCTION), ctx)
