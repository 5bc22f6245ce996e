"""What every backend implements: the three local passes of the contract.

A backend never calls a collective; it turns one shard of logits into the per-row max,
the int64 row record and, in backward, the gradient shard, and may fuse stage 7 (finalize
of the combined record), or all of stages 2-7 when the shard is the whole vocabulary. All of them must give the bits of `exactlogp.contract` for every
input.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch

from .. import contract, linear_contract
from ..contract import GradStats


@dataclass(frozen=True)
class ShardPlan:
    vocab_start: int  # global id of local column 0
    vocab_size: int | None  # columns >= vocab_size are padding; None: no padding
    ignore_index: int
    with_entropy: bool

    def target_columns(self, target: torch.Tensor, num_cols: int) -> torch.Tensor:
        """(N,) int64, contiguous: contract.owned_target_columns of this shard."""
        return contract.owned_target_columns(
            target.to(torch.int64), self.vocab_start, num_cols, self.vocab_size, self.ignore_index
        ).contiguous()


def row_view(t: torch.Tensor) -> torch.Tensor:
    """(..., V) as rows without a copy: (N, V) where the leading dims merge into one, else
    (B, T, V) where they merge into two (logits[:, :-1, :] of (B, T + 1, V) logits: its
    rows are not evenly spaced), else a copy as (N, V). Backends read all three."""
    v = t.shape[-1]
    n = math.prod(t.shape[:-1])
    try:
        return t.view(n, v)
    except RuntimeError:
        pass
    if t.dim() >= 3:
        try:
            return t.view(n // t.shape[-2], t.shape[-2], v)
        except RuntimeError:
            pass
    return t.reshape(n, v)


def num_rows(rows: torch.Tensor) -> int:
    """The rows of a row_view: N of (N, V), B * T of (B, T, V)."""
    return math.prod(rows.shape[:-1])


def take_rows(rows: torch.Tensor, block: slice) -> torch.Tensor:
    """Rows [start, stop) of a row_view as (n, V): a view of (N, V) rows; of (B, T, V)
    rows, a copy of these rows alone."""
    if rows.dim() == 2:
        return rows[block]
    index = torch.arange(block.start, block.stop, device=rows.device)
    return rows[index // rows.shape[1], index % rows.shape[1]]


def bad_temperature(temperature) -> torch.Tensor | None:
    """(N,) bool: the per-row temperatures that finalize flags BAD_TEMPERATURE (not finite,
    or not > 0); None for a scalar, which the argument checks already passed."""
    if isinstance(temperature, torch.Tensor):
        return ~(torch.isfinite(temperature) & (temperature > 0))
    return None


@contextlib.contextmanager
def backend_option(impl, option: str, mode: str):
    """Backend `impl` with its speed option `option` set to `mode` for the block, put back
    after: "value_tables" (cpu, triton) or "exact_gemm" (triton). The bits are the same."""
    before = getattr(impl, option)
    setattr(impl, option, mode)
    try:
        yield impl
    finally:
        setattr(impl, option, before)


def value_tables_mode(impl, mode: str):
    """Backend `impl` (one with value tables: cpu, triton) in value-table mode `mode` for the
    block, its mode put back after: a speed choice only, the bits are the same."""
    return backend_option(impl, "value_tables", mode)


class Backend:
    """Interface; `logits` is a row_view of the shard, (N, V_local) or (B, T, V_local) with
    B * T = N rows, `target` (N,) int64 with global ids, `temperature` a float or an fp32
    (N,) tensor, `keep_mask` None or bool shaped like `logits`."""

    name = "base"

    def supports(self, device: torch.device) -> bool:
        raise NotImplementedError

    def row_max(self, logits, temperature, keep_mask, plan: ShardPlan) -> torch.Tensor:
        """(N,) fp32: max of valid finite-or--inf y over this shard; -inf if none."""
        raise NotImplementedError

    def partials(self, logits, target, temperature, keep_mask, row_max, plan) -> torch.Tensor:
        """(N, contract.NUM_COLS) int64: this shard's exact row record."""
        raise NotImplementedError

    def forward_unsharded(self, logits, target, temperature, keep_mask, plan: ShardPlan):
        """Stages 2-7 when this shard is the whole vocabulary (no TP group): (row max,
        record, Finalized). No collective lies between the passes, so a backend may fuse
        them (one read of each row); this one runs them one after another."""
        row_max = self.row_max(logits, temperature, keep_mask, plan)
        record = self.partials(logits, target, temperature, keep_mask, row_max, plan)
        return self.finish_unsharded(row_max, record, target, temperature, plan)

    def finish_unsharded(self, row_max, record, target, temperature, plan: ShardPlan):
        """forward_unsharded's last stage: (row max, record, Finalized of the record)."""
        fin = self.finalize(
            row_max, record, target, plan.vocab_size, plan.ignore_index,
            bad_temperature(temperature),
        )  # fmt: skip
        return row_max, record, fin

    def finalize(
        self, row_max, record, target, vocab_size, ignore_index, bad_temperature,
        ranks_disagree=None,
    ):  # fmt: skip
        """Stage 7 on the combined record; a backend may fuse it, with the same bits."""
        return contract.finalize(
            row_max, record, target, vocab_size, ignore_index, bad_temperature, ranks_disagree
        )

    def grad(self, logits, target, temperature, keep_mask, stats: GradStats, plan) -> torch.Tensor:
        """Shaped like `logits`, contiguous, in logits.dtype: the gradient shard."""
        raise NotImplementedError

    def exact_dot(self, a: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        """(M, P) int64: linear_contract.exact_dot, the exact integer a @ c^T of quantized
        operands (M, K) and (P, K). By default fp64 GEMMs over K-chunks, which are exact
        (linear_contract.float_exact_dot) on any device torch runs a GEMM on."""
        return linear_contract.float_exact_dot(a, c)
