"""What every backend implements: the three local passes of the contract.

A backend never calls a collective; it turns one shard of logits into the per-row max,
the int64 row record and, in backward, the gradient shard, and may fuse stage 7 (finalize
of the combined record), or all of stages 2-7 when the shard is the whole vocabulary. All of them must give the bits of `exactlogp.contract` for every
input.
"""

from __future__ import annotations

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

    def real_columns(self, num_cols: int) -> int:
        """How many of this shard's num_cols columns are real (not padding)."""
        if self.vocab_size is None:
            return num_cols
        return max(0, min(num_cols, self.vocab_size - self.vocab_start))

    def target_columns(self, target: torch.Tensor, num_cols: int) -> torch.Tensor:
        """(N,) int64, contiguous: contract.owned_target_columns of this shard."""
        return contract.owned_target_columns(
            target.to(torch.int64), self.vocab_start, num_cols, self.vocab_size, self.ignore_index
        ).contiguous()


def row_view(t: torch.Tensor) -> torch.Tensor:
    """(..., V) as rows without a copy: (N, V) where the leading dims merge into one, else
    (B, T, V) where they merge into two (logits[:, :-1, :] of (B, T + 1, V) logits: its
    rows are not evenly spaced), else a copy as (N, V). Backends read all three."""
    if t.dim() == 2:  # already rows
        return t
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


# value_tables: a speed option of the cpu and triton backends; every mode gives the same bits
VALUE_TABLE_MODES = ("auto", "always", "never")
# exact_gemm: the triton backend's route for the exact LM head's integer GEMM (triton/launch.py)
EXACT_GEMM_MODES = ("auto", "fp64", "int8", "int8_mm", "int8_fused")
EXACT_GEMM_ROUTES = EXACT_GEMM_MODES[1:]  # the modes that name one route


def check_mode(option: str, value, modes: tuple[str, ...]) -> str:
    """`value` if it is one of `modes`, else a ValueError naming `option`."""
    if not isinstance(value, str) or value not in modes:
        raise ValueError(f"{option} must be one of {modes}, got {value!r}")
    return value


def check_chunk(chunk) -> int:
    """chunk_max's `chunk` if it is an int >= 1, else a ValueError naming it."""
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk must be an int >= 1, got {chunk!r}")
    return chunk


class Backend:
    """Interface; `logits` is a row_view of the shard, (N, V_local) or (B, T, V_local) with
    B * T = N rows, `target` (N,) int64 with global ids, `temperature` a
    exactlogp.temperature.Temperature (a scalar, or one per row), `keep_mask` None or bool
    shaped like `logits`.

    A backend object is immutable once built: its options are fixed at construction (pass
    another object for other options), so one object may serve many threads and calls.
    """

    name = "base"

    def __setattr__(self, name, value):
        if getattr(self, "_frozen", False):
            raise AttributeError(
                f"exactlogp backends are immutable: build another {type(self).__name__} "
                f"for other options instead of setting {name!r}"
            )
        object.__setattr__(self, name, value)

    def _freeze(self, **options) -> None:
        """The end of a constructor: `options` are its keyword arguments as given (what
        with_options starts from); no attribute changes after it."""
        object.__setattr__(self, "_options", options)
        object.__setattr__(self, "_frozen", True)

    @property
    def options(self) -> dict:
        """The constructor's keyword arguments this backend was built with."""
        return dict(self._options)

    def with_options(self, **changes) -> Backend:
        """Another backend of this class, with `changes` to its options (this one stays as
        it is): e.g. get_backend("cpu", device).with_options(value_tables="never")."""
        return type(self)(**{**self._options, **changes})

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self._options.items())
        return f"{type(self).__name__}({args})"

    def supports(self, device: torch.device) -> bool:
        raise NotImplementedError

    def row_max(self, logits, temperature, keep_mask, plan: ShardPlan) -> torch.Tensor:
        """(N,) fp32: max of valid finite-or--inf y over this shard; -inf if none."""
        raise NotImplementedError

    def class_max(self, z: torch.Tensor, cls: torch.Tensor, skip: torch.Tensor, classes: int):
        """(R, classes) fp32: for each row of z (R, P) fp32 and each class k < classes, the
        max of z over the columns v with cls[v] == k (cls (P,) int32; a column of class
        `classes` or more belongs to none), the column skip[r] (R,) int64 of row r left out
        (-1: none); -inf where a class has no column. Rows holding a NaN may give anything
        (the fused head's backward never uses their maxima: exactlogp.linear._GridBound).
        This default: one scatter_reduce; z is modified and put back bit for bit."""
        r, p = z.shape
        out = torch.full((r, classes + 1), float("-inf"), dtype=torch.float32, device=z.device)
        if r == 0 or p == 0:
            return out[:, :classes]
        at = skip.clamp(min=0).unsqueeze(1)
        kept = z.gather(1, at)
        z.scatter_(1, at, torch.where(skip.unsqueeze(1) >= 0, float("-inf"), kept))
        which = cls.clamp(max=classes).to(torch.int64).expand(r, p)
        out.scatter_reduce_(1, which, z, "amax")
        z.scatter_(1, at, kept)
        return out[:, :classes]

    def partials(self, logits, target, temperature, keep_mask, row_max, plan) -> torch.Tensor:
        """(N, contract.NUM_COLS) int64: this shard's exact row record."""
        raise NotImplementedError

    def chunk_max(self, logits, temperature, plan: ShardPlan, chunk: int) -> torch.Tensor:
        """(N, ceil(R / chunk)) fp32, R = plan.real_columns(V_local): the max of y over the
        real columns [c * chunk, min((c + 1) * chunk, R)) of each row, NaN where one of them
        is NaN, else +inf where one is +inf, and a zero max as +0. No keep mask. The exact
        cut's top-k shortcut reads it (exactlogp.cut). This default is torch code:
        y = fp32(x) / tau is monotonic in x, so the max of y is y of the max of x."""
        check_chunk(chunk)
        n, real = num_rows(logits), plan.real_columns(logits.shape[-1])
        whole = real // chunk
        parts = []  # views of the rows, (N, V) or (B, T, V): no copy of the logits
        if whole:
            parts.append(logits[..., : whole * chunk].unflatten(-1, (whole, chunk)).amax(-1))
        if real % chunk:  # the last, short chunk
            parts.append(logits[..., whole * chunk : real].amax(-1, keepdim=True))
        chunks = whole + (real % chunk > 0)
        if not parts:
            return torch.zeros(n, 0, dtype=torch.float32, device=logits.device)
        top = torch.cat(parts, dim=-1).reshape(n, chunks)  # NaN propagates through amax
        return contract.scaled_logits(top, temperature.column()) + 0.0  # -0 -> +0

    def forward_unsharded(
        self, logits, target, temperature, keep_mask, plan: ShardPlan, keep_stats: bool = True
    ):
        """Stages 2-7 when this shard is the whole vocabulary (no TP group): (row max,
        record, Finalized). No collective lies between the passes, so a backend may fuse
        them (one read of each row); this one runs them one after another. keep_stats=
        False: the caller drops the Finalized's gradient statistics (s_hi, s_lo, log_s,
        entropy64, ignored: no gradient will be taken), so a backend may write them to
        scratch that its next such call on this thread overwrites."""
        row_max = self.row_max(logits, temperature, keep_mask, plan)
        record = self.partials(logits, target, temperature, keep_mask, row_max, plan)
        return self.finish_unsharded(row_max, record, target, temperature, plan)

    def finish_unsharded(self, row_max, record, target, temperature, plan: ShardPlan):
        """forward_unsharded's last stage: (row max, record, Finalized of the record)."""
        fin = self.finalize(
            row_max, record, target, plan.vocab_size, plan.ignore_index, temperature.bad()
        )
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

    def fused_head(self, device: torch.device) -> bool:
        """Whether this backend computes a block of LM-head logits in one piece on `device`
        (head_slices + head_logits) instead of through exact_dot."""
        return False
