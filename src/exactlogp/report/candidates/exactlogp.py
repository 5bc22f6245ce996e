"""exactlogp itself: `exactlogp.selected_logprobs` on the shard, one row per backend.

The row called "exactlogp" uses backend="auto" (what users get); "exactlogp[NAME]" rows
pin one other available backend, so the report also shows that backends agree bit for bit.
The vocabulary is padded as Megatron pads it (to a multiple of 128 * TP), so TP4 == TP1
here also covers different padding.
"""

from __future__ import annotations

import torch

from ...api import selected_logprobs
from ...backends import get_backend
from .base import Candidate, ShardContext, Unavailable, round_up

MEGATRON_PAD_MULTIPLE = 128


# A pinned backend's row is there to show its bits equal the auto backend's on every row;
# a few timed runs say how fast it is. (The pure-torch reference backend takes tens of
# seconds per run of the default workload on a small CPU; ten of them add minutes.)
PINNED_TIMED_RUNS = 3


class ExactlogpCandidate(Candidate):
    implementation = "ours"

    def __init__(self, backend: str = "auto"):
        self.backend = backend
        self.name = "exactlogp" if backend == "auto" else f"exactlogp[{backend}]"
        self.max_timed_runs = None if backend == "auto" else PINNED_TIMED_RUNS
        self.summary = (
            f"exactlogp.selected_logprobs(backend={backend!r}): exact int64 accumulation, "
            "one all_reduce(MAX) and one int64 all_reduce(SUM)"
        )

    def check_available(self, device: torch.device) -> None:
        try:
            get_backend(self.backend, device)
        except (ValueError, RuntimeError) as exc:
            raise Unavailable(f"{type(exc).__name__}: {exc}") from exc

    def padded_vocab(self, vocab_size: int, tp: int) -> int:
        return round_up(vocab_size, MEGATRON_PAD_MULTIPLE * tp)

    def describe(self) -> dict:
        info = super().describe()
        info["backend"] = self.backend
        return info

    def resolved_backend(self, device: torch.device) -> str:
        return get_backend(self.backend, device).name

    def build(self, ctx: ShardContext):
        backend = self.backend

        def run(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            return selected_logprobs(
                logits,
                target,
                tp_group=ctx.group,
                vocab_start=ctx.vocab_start,
                vocab_size=ctx.vocab_size,
                backend=backend,
            ).logprobs

        return run
