"""The reference backend: contract.py applied block by block of rows.

It defines the bits and runs on any device torch runs on. Rows are processed in blocks
of about CHUNK_ELEMENTS logits, so its extra memory is a few hundred MiB at most
whatever N is (each block holds a handful of fp64 / int64 temporaries).
"""

from __future__ import annotations

import torch

from .. import contract, linear_contract
from ..contract import GradStats
from .base import Backend, ShardPlan, num_rows, take_rows

CHUNK_ELEMENTS = 1 << 18


def _row_blocks(num_rows: int, num_cols: int):
    step = max(1, CHUNK_ELEMENTS // max(num_cols, 1))
    for start in range(0, num_rows, step):
        yield slice(start, min(start + step, num_rows))


def _block_inputs(logits, temperature, keep_mask, plan: ShardPlan, rows: slice):
    tau = temperature.take(rows).column()
    y = contract.scaled_logits(take_rows(logits, rows), tau)
    mask = None if keep_mask is None else take_rows(keep_mask, rows)
    valid = contract.valid_columns(
        logits.shape[-1], plan.vocab_start, plan.vocab_size, mask, logits.device
    )
    return y, valid, mask, tau


class ReferenceBackend(Backend):
    name = "reference"

    def __init__(self):
        self._freeze()

    def supports(self, device: torch.device) -> bool:
        return True

    def row_max(self, logits, temperature, keep_mask, plan):
        n = num_rows(logits)
        out = torch.empty(n, dtype=torch.float32, device=logits.device)
        for rows in _row_blocks(n, logits.shape[-1]):
            y, valid, _, _ = _block_inputs(logits, temperature, keep_mask, plan, rows)
            out[rows] = contract.masked_row_max(y, valid)
        return out

    def partials(self, logits, target, temperature, keep_mask, row_max, plan):
        n = num_rows(logits)
        out = torch.empty(n, contract.NUM_COLS, dtype=torch.int64, device=logits.device)
        for rows in _row_blocks(n, logits.shape[-1]):
            y, valid, mask, _ = _block_inputs(logits, temperature, keep_mask, plan, rows)
            out[rows] = contract.partials(
                y, valid, row_max[rows], target[rows], mask,
                plan.vocab_start, plan.vocab_size, plan.ignore_index, plan.with_entropy,
            )  # fmt: skip
        return out

    def grad(self, logits, target, temperature, keep_mask, stats: GradStats, plan):
        n = num_rows(logits)
        out = torch.empty(n, logits.shape[-1], dtype=logits.dtype, device=logits.device)
        target_local = plan.target_columns(target, logits.shape[-1])
        for rows in _row_blocks(n, logits.shape[-1]):
            y, valid, _, tau = _block_inputs(logits, temperature, keep_mask, plan, rows)
            out[rows] = contract.grad_block(
                y, valid, stats.rows(rows), target_local[rows], tau, plan.with_entropy, logits.dtype
            )
        return out.view(logits.shape)

    def exact_dot(self, a, c):
        """The definition itself: int64 products and sums."""
        return linear_contract.exact_dot(a, c)
