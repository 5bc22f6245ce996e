"""exactlogp_linear: `exactlogp.linear_selected_logprobs`, the exact fused LM head, on this
rank's LM-head rows (hidden-state workload), one row per backend.

The logits are exact integer dot products rounded once (contract exactlogp-linear-v2),
then the softmax contract: no float is summed across ranks and no (N, V) logits tensor
is kept. The row called "exactlogp_linear" uses backend="auto"; "exactlogp_linear[NAME]"
rows pin one other available backend, so the report also shows that backends agree bit
for bit. The vocabulary is padded as Megatron pads it (a multiple of 128 * TP; the
padding rows lie beyond vocab_size, so they never enter the softmax).
"""

from __future__ import annotations

import torch

from ...backends import get_backend
from ...linear import linear_selected_logprobs
from .base import Candidate, ShardContext, Unavailable, round_up
from .exactlogp import PINNED_TIMED_RUNS
from .megatron import MEGATRON_PAD_MULTIPLE


class ExactlogpLinear(Candidate):
    implementation = "ours"
    kind = "hidden_states"

    def __init__(self, backend: str = "auto"):
        self.backend = backend
        self.name = "exactlogp_linear" if backend == "auto" else f"exactlogp_linear[{backend}]"
        self.max_timed_runs = None if backend == "auto" else PINNED_TIMED_RUNS
        self.summary = (
            f"exactlogp.linear_selected_logprobs(backend={backend!r}): exact integer "
            "logits rounded once, then exact int64 accumulation; one all_reduce(MAX) and "
            "one int64 all_reduce(SUM), no (N, V) logits"
        )

    @classmethod
    def from_params(cls, params: tuple[str, ...]) -> ExactlogpLinear:
        if len(params) > 1 or any("=" in p for p in params):
            raise ValueError(f"exactlogp_linear takes [BACKEND], got {list(params)}")
        return cls(*params)

    def check_available(self, device: torch.device) -> None:
        try:
            get_backend(self.backend, device)
        except (ValueError, RuntimeError) as exc:
            raise Unavailable(f"{type(exc).__name__}: {exc}") from exc

    def padded_vocab(self, vocab_size: int, tp: int) -> int:
        return round_up(vocab_size, MEGATRON_PAD_MULTIPLE * tp)

    def describe(self) -> dict:
        return {**super().describe(), "backend": self.backend}

    def resolved_backend(self, device: torch.device) -> str:
        return get_backend(self.backend, device).name

    def build(self, ctx: ShardContext):
        weight, backend = ctx.weight, self.backend

        def run(hidden: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            return linear_selected_logprobs(
                hidden,
                weight,
                target,
                tp_group=ctx.group,
                vocab_start=ctx.vocab_start,
                vocab_size=ctx.vocab_size,
                backend=backend,
            ).logprobs

        return run
