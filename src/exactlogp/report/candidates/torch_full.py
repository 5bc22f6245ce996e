"""torch_full: fp32 log_softmax of the full, unsharded logits on one device (TP1 only).

The simplest baseline: what a single-device trainer computes, in eager PyTorch. The
report runs it in blocks of ROW_BLOCK rows (bounding the fp32 (rows, V) copy); the
bench's eager baseline, "torch_full[row_block=all]", runs the whole batch at once, as a
trainer would. "temperature=T" divides the fp32 logits by T first.
"""

from __future__ import annotations

import torch

from .base import Candidate, ShardContext, in_row_blocks, scaled_fp32, temperature_param

ROW_BLOCK = 256  # bounds the fp32 (rows, V) copy


class TorchFull(Candidate):
    name = "torch_full"
    summary = "torch.log_softmax(fp32(logits), -1).gather(target) on the whole row, one device"
    implementation = "real"
    tp1_only = True
    supports_backward = True

    def __init__(self, row_block: int | None = ROW_BLOCK, temperature: float = 1.0):
        self.row_block, self.temperature = row_block, temperature
        params = [] if row_block == ROW_BLOCK else [f"row_block={row_block or 'all'}"]
        params += [] if temperature == 1.0 else [f"temperature={temperature:g}"]
        if params:
            self.name = f"torch_full[{','.join(params)}]"

    @classmethod
    def from_params(cls, params: tuple[str, ...]) -> TorchFull:
        row_block, temperature = ROW_BLOCK, 1.0
        for p in params:
            tau = temperature_param(p)
            if tau is not None:
                temperature = tau
                continue
            if not p.startswith("row_block="):
                raise ValueError(
                    f"torch_full takes [row_block=ROWS or all, temperature=T], got {list(params)}"
                )
            value = p.removeprefix("row_block=")
            if value != "all" and not (value.isdigit() and int(value) > 0):
                raise ValueError(f"row_block must be a positive int or 'all', got {value!r}")
            row_block = None if value == "all" else int(value)
        return cls(row_block, temperature)

    def describe(self) -> dict:
        details = {"row_block": self.row_block or "all", "temperature": self.temperature}
        return {**super().describe(), "details": details}

    def build(self, ctx: ShardContext):
        if ctx.tp != 1:
            raise ValueError(f"torch_full runs at tp=1 only, got tp={ctx.tp}")
        vocab, temperature = ctx.vocab_size, self.temperature

        def run(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            lp = torch.log_softmax(scaled_fp32(logits[:, :vocab], temperature), dim=-1)
            return lp.gather(-1, target.unsqueeze(-1)).squeeze(-1)

        return run if self.row_block is None else in_row_blocks(run, self.row_block)
