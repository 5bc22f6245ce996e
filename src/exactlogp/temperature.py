"""The temperature of a call as one value: a scalar or one fp32 value per row.

y = fp32(x) / tau with tau rounded to fp32 (contract.scaled_logits). The public API takes
a float or a tensor; it becomes a `Temperature` once, at the API's boundary
(validation.check_temperature), and every layer below -- the call object, autograd, the
agreement, the backends, the exact cut -- asks it for what it needs instead of testing
which form it has. `contract.py` keeps its `float | Tensor` signatures: `Temperature.value`
is that form. The exact cut reads a temperature of exactly 0 as a greedy row (argmax, no
cut, y at temperature 1): its tau is 1 here and `greedy` marks the row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .contract import fp32_bits, fp32_temperature, grad_temperature


@dataclass(frozen=True, eq=False)
class Temperature:
    """`scalar`: tau rounded to fp32, for every row (1.0 where `rows` is given);
    `rows`: None, or (N,) fp32 contiguous, one tau per row (not checked here: a bad
    per-row value flags its row, contract.BAD_TEMPERATURE); `greedy`: None, or (N,) bool,
    the exact cut's temperature-0 rows (their tau is 1 in `scalar` / `rows`)."""

    scalar: float = 1.0
    rows: torch.Tensor | None = None
    greedy: torch.Tensor | None = None

    @classmethod
    def of(cls, value: float | torch.Tensor | Temperature) -> Temperature:
        """A float (rounded to fp32), an fp32-convertible tensor (flattened, one per row),
        or a Temperature as it is. No range checks: validation.check_temperature makes
        them for user input."""
        if isinstance(value, Temperature):
            return value
        if isinstance(value, torch.Tensor):
            return cls(1.0, value.to(torch.float32).reshape(-1).contiguous())
        return cls(fp32_temperature(value))

    @property
    def per_row(self) -> bool:
        return self.rows is not None

    @property
    def value(self) -> float | torch.Tensor:
        """The contract's form: the float, or the (N,) fp32 tensor."""
        return self.scalar if self.rows is None else self.rows

    @property
    def is_one(self) -> bool:
        """A scalar 1.0: the division is the identity and may be skipped."""
        return self.rows is None and self.scalar == 1.0

    def take(self, rows: slice) -> Temperature:
        """The temperature of rows [start, stop)."""
        if self.rows is None and self.greedy is None:
            return self
        greedy = None if self.greedy is None else self.greedy[rows]
        return Temperature(self.scalar, None if self.rows is None else self.rows[rows], greedy)

    def of_rows(self, index: torch.Tensor) -> torch.Tensor:
        """(len(index),) fp32: the tau of each row of `index` (int64 rows of the call)."""
        if self.rows is not None:
            return self.rows[index]
        return torch.full(index.shape, self.scalar, dtype=torch.float32, device=index.device)

    def column(self) -> float | torch.Tensor:
        """What divides a block of rows (n, V): the float, or (n, 1) fp32."""
        return self.scalar if self.rows is None else self.rows.unsqueeze(-1)

    def field(self) -> int:
        """The agreement's call field: the scalar's fp32 bits (0 for a scalar 0, greedy),
        -1 for one per row."""
        if self.rows is not None:
            return -1
        return 0 if self.greedy is not None else fp32_bits(self.scalar)

    def row_bits(self, num_rows: int, device: torch.device) -> torch.Tensor:
        """(N,) int32: every row's fp32 bits, for the per-row agreement."""
        if self.rows is None:
            return torch.full((num_rows,), fp32_bits(self.scalar), dtype=torch.int32, device=device)
        return self.rows.view(torch.int32)

    def bad(self) -> torch.Tensor | None:
        """(N,) bool: the per-row values finalize flags BAD_TEMPERATURE (not finite, or not
        > 0); None for a scalar, which the argument checks already passed."""
        if self.rows is None:
            return None
        return ~(torch.isfinite(self.rows) & (self.rows > 0))

    def at(self, row: int) -> float:
        """Row `row`'s tau, for messages (a host sync for one per row)."""
        return self.scalar if self.rows is None else float(self.rows[row])

    def gradient_divisor(self, stats) -> Temperature:
        """What backward divides by: a row without a gradient (`silent`) never uses its
        own tau (it is taken as 1, contract.grad_temperature), so a per-row tau <= 0 or NaN
        there gives +0, not NaN. `stats`: contract.GradStats."""
        if self.rows is None:
            return self
        return Temperature(1.0, grad_temperature(stats, self.rows).contiguous())

    def to(self, device: torch.device) -> Temperature:
        if self.rows is None and self.greedy is None:
            return self
        rows = None if self.rows is None else self.rows.to(device)
        greedy = None if self.greedy is None else self.greedy.to(device)
        return Temperature(self.scalar, rows, greedy)


ONE = Temperature()
