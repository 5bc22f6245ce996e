"""torch_full: fp32 log_softmax of the full, unsharded logits on one device (TP1 only).

The simplest baseline: what a single-device trainer computes.
"""

from __future__ import annotations

import torch

from .base import Candidate, ShardContext, in_row_blocks

ROW_BLOCK = 256  # bounds the fp32 (rows, V) copy


class TorchFull(Candidate):
    name = "torch_full"
    summary = "torch.log_softmax(fp32(logits), -1).gather(target) on the whole row, one device"
    implementation = "real"
    tp1_only = True

    def describe(self) -> dict:
        return {**super().describe(), "details": {"row_block": ROW_BLOCK}}

    def build(self, ctx: ShardContext):
        if ctx.tp != 1:
            raise ValueError(f"torch_full runs at tp=1 only, got tp={ctx.tp}")
        vocab = ctx.vocab_size

        def run(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            lp = torch.log_softmax(logits[:, :vocab].to(torch.float32), dim=-1)
            return lp.gather(-1, target.unsqueeze(-1)).squeeze(-1)

        return in_row_blocks(run, ROW_BLOCK)
