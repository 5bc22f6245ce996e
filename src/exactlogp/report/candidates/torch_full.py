"""torch_full: fp32 log_softmax of the full, unsharded logits on one device (TP1 only).

The simplest baseline: what a single-device trainer computes, in eager PyTorch. The
report runs it in blocks of ROW_BLOCK rows (bounding the fp32 (rows, V) copy); the
bench's eager baseline, "torch_full[row_block=all]", runs the whole batch at once, as a
trainer would.
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
    supports_backward = True

    def __init__(self, row_block: int | None = ROW_BLOCK):
        self.row_block = row_block
        if row_block != ROW_BLOCK:
            self.name = f"torch_full[row_block={row_block or 'all'}]"

    @classmethod
    def from_params(cls, params: tuple[str, ...]) -> TorchFull:
        if not params:
            return cls()
        if len(params) != 1 or not params[0].startswith("row_block="):
            raise ValueError(f"torch_full takes [row_block=ROWS or all], got {list(params)}")
        value = params[0].removeprefix("row_block=")
        if value != "all" and not (value.isdigit() and int(value) > 0):
            raise ValueError(f"row_block must be a positive int or 'all', got {value!r}")
        return cls(None if value == "all" else int(value))

    def describe(self) -> dict:
        return {**super().describe(), "details": {"row_block": self.row_block or "all"}}

    def build(self, ctx: ShardContext):
        if ctx.tp != 1:
            raise ValueError(f"torch_full runs at tp=1 only, got tp={ctx.tp}")
        vocab = ctx.vocab_size

        def run(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            lp = torch.log_softmax(logits[:, :vocab].to(torch.float32), dim=-1)
            return lp.gather(-1, target.unsqueeze(-1)).squeeze(-1)

        return run if self.row_block is None else in_row_blocks(run, self.row_block)
