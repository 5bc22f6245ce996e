"""The fused CPU backend: each pass is one multi-threaded, vectorised C kernel.

row_max, chunk_max (the exact cut's per-chunk maxima), partials, finalize and grad are C
kernels that read the logits row by row and keep nothing of size [N, V] besides grad's
output: the extra memory of forward is O(N) (logits whose columns are not adjacent in
memory are copied once first). Without a TP group one kernel call runs the whole forward
(`forward_unsharded`): each row is read once, its max taken from its distinct values where
the value tables apply. The kernels (csrc/exactlogp_cpu.c, built by cpu_build) apply
contract.py's IEEE operations in the same order, so every output is bitwise that of the
reference backend. Long rows of 16-bit logits (and fp32 rows whose values are all exactly
bf16) take the value-table path: the contract is evaluated once per distinct value of the
row (a few thousand for an LLM's bf16 logits) instead of once per column, and the integer
sums are the same (see the C source and docs/performance.md).
"""

from __future__ import annotations

import ctypes
import threading

import torch

from .. import contract
from ..contract import GradStats
from . import cpu_build, in_forked_child
from .base import VALUE_TABLE_MODES, Backend, ShardPlan, check_chunk, check_mode, num_rows

# the kernels' dtype codes (elp_shard.dtype in the C source)
_KERNEL_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
# Below this many logits per thread, waking a thread costs more than it saves.
MIN_ELEMENTS_PER_THREAD = 1 << 16
# value_tables="auto": rows with at least this many real columns use value tables, per
# pass and logits dtype (fp32: rows whose values are all exactly bf16, read as bf16), where
# they won on this project's benchmark machines. "forward" is the whole forward without a
# TP group, where the tables also give the max; fp16 rows hold several times more distinct
# values than bf16 rows, so their tables pay only on longer rows.
TABLE_MIN_COLS_BY_PASS = {
    "forward": {torch.bfloat16: 8192, torch.float16: 32768, torch.float32: 8192},
    "partials": {torch.bfloat16: 16384, torch.float16: 65536, torch.float32: 16384},
    "grad": {torch.bfloat16: 32768},
}
_ISA_NAMES = ("baseline", "avx2", "avx512")
# elp_chunk_max takes chunks of a multiple of its step (64 columns with AVX-512, 32 in the
# other builds): a multiple of 64 suits every build; other chunks take the torch default.
CHUNK_MAX_STEP = 64


class _Shard(ctypes.Structure):  # elp_shard in the C source
    _fields_ = [
        ("x", ctypes.c_void_p),
        ("row_stride", ctypes.c_int64),
        ("n_rows", ctypes.c_int64),
        ("n_cols", ctypes.c_int64),
        ("n_real", ctypes.c_int64),
        ("keep", ctypes.c_void_p),
        ("keep_stride", ctypes.c_int64),
        ("tau_rows", ctypes.c_void_p),
        ("tau", ctypes.c_double),
        ("dtype", ctypes.c_int32),
        ("num_threads", ctypes.c_int32),
        ("table_min_cols", ctypes.c_int64),
        ("target", ctypes.c_void_p),
        ("vocab_start", ctypes.c_int64),
        ("vocab_size", ctypes.c_int64),
        ("ignore_index", ctypes.c_int64),
        ("rows_inner", ctypes.c_int64),
        ("outer_stride", ctypes.c_int64),
        ("keep_outer_stride", ctypes.c_int64),
    ]


_GRAD_FIELDS = (
    "row_max", "s_hi", "s_lo", "log_s", "entropy64", "coef_a", "coef_b", "coef_t", "coef_l",
)  # fmt: skip


class _GradStats(ctypes.Structure):  # elp_grad_stats in the C source
    _fields_ = [(name, ctypes.c_void_p) for name in (*_GRAD_FIELDS, "row_nan")]


_ROW_FIELDS = ("row_max", "record", *contract.Finalized._fields)


class _Rows(ctypes.Structure):  # elp_rows in the C source
    _fields_ = [(name, ctypes.c_void_p) for name in _ROW_FIELDS]


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    shard, rows = ctypes.POINTER(_Shard), ctypes.POINTER(_Rows)
    signatures = {
        "elp_row_max": [shard, ptr],
        "elp_chunk_max": [shard, i64, ptr],
        "elp_partials": [shard, ptr, ctypes.c_int32, ptr],
        "elp_forward": [shard, ctypes.c_int32, rows],
        "elp_finalize": [i64, ptr, i64, i64, ptr, ptr, rows],
        "elp_grad": [shard, ctypes.POINTER(_GradStats), ctypes.c_int32, ptr],
    }
    for name, argtypes in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, ctypes.c_int
    lib.elp_isa.restype = ctypes.c_int
    return lib


def _unit_column_stride(t: torch.Tensor) -> torch.Tensor:
    """t itself when its columns are adjacent (any row stride), else a contiguous copy."""
    return t if t.shape[-1] <= 1 or t.stride(-1) == 1 else t.contiguous()


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t as a contiguous tensor of `dtype` (t itself when it already is: no torch call)."""
    return t if t.dtype == dtype and t.is_contiguous() else t.to(dtype).contiguous()


def _f32(t: torch.Tensor) -> torch.Tensor:
    return _as(t, torch.float32)


def _f64(t: torch.Tensor) -> torch.Tensor:
    return _as(t, torch.float64)


def _i64(t: torch.Tensor) -> torch.Tensor:
    return _as(t, torch.int64)


def _flags(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.to(torch.bool).contiguous().view(torch.uint8)


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


_scratch = threading.local()


def _stats(n: int, keep: bool):
    """((s_hi, s_lo, log_s, entropy64) (n,) fp64 each, ignored (n,) bool) for the fused
    forward to write: fresh where they are kept (saved for backward), else this thread's
    scratch for n rows, the same tensors on every such call (a call without a gradient
    drops them: on a small call, two allocations and a split are a tenth of its time)."""
    if not keep:
        found = getattr(_scratch, "stats", None)
        if found is not None and found[0] == n:
            return found[1]
    made = torch.empty(4, n, dtype=torch.float64).unbind(0), torch.empty(n, dtype=torch.bool)
    if not keep:
        _scratch.stats = (n, made)
    return made


class CpuBackend(Backend):
    """`num_threads`: threads per pass, None follows torch.get_num_threads();
    `isa`: "avx512", "avx2" or "baseline", None picks this CPU's best
    (cpu_build.default_isa); `value_tables`: "auto" (rows of at least
    TABLE_MIN_COLS_BY_PASS columns), "always" (16-bit rows and bf16-exact fp32 rows of any length) or "never" --
    a speed choice only: every mode gives the same bits."""

    name = "cpu"

    def __init__(
        self, num_threads: int | None = None, isa: str | None = None, value_tables: str = "auto"
    ):
        if num_threads is not None and (
            isinstance(num_threads, bool) or not isinstance(num_threads, int) or num_threads < 1
        ):
            raise ValueError(f"num_threads must be None or an int >= 1, got {num_threads!r}")
        self.num_threads = num_threads
        self.value_tables = check_mode("value_tables", value_tables, VALUE_TABLE_MODES)
        self._lib = _bind(cpu_build.load(isa))  # found in the cache, or built into it
        self._freeze(num_threads=num_threads, isa=isa, value_tables=value_tables)

    def supports(self, device: torch.device) -> bool:
        return torch.device(device).type == "cpu"

    @property
    def isa(self) -> str:
        """The instruction set the loaded kernels were compiled for."""
        return _ISA_NAMES[self._lib.elp_isa()]

    @property
    def uses_avx2(self) -> bool:
        return self.isa != "baseline"

    # --- the shard description every kernel reads ---

    def _table_min_cols(self, dtype: torch.dtype, pass_name: str) -> int:
        """The shard's table_min_cols for one pass: -1 keeps the direct loops."""
        if self.value_tables == "auto":
            return TABLE_MIN_COLS_BY_PASS[pass_name].get(dtype, -1)
        return 0 if self.value_tables == "always" else -1

    def _shard(self, logits, temperature, keep_mask, plan: ShardPlan, pass_name="", target=None):
        """(elp_shard, tensors that must outlive the call); pass_name "forward", "partials"
        or "grad" lets the pass use value tables."""
        if logits.dtype not in _KERNEL_DTYPE_CODES:
            raise TypeError(f"backend 'cpu' supports bf16/fp16/fp32 logits, got {logits.dtype}")
        x = _unit_column_stride(logits)  # (N, V) or (B, T, V) rows
        n_rows, n_cols = num_rows(x), x.shape[-1]
        n_real = n_cols
        if plan.vocab_size is not None:
            n_real = min(max(plan.vocab_size - plan.vocab_start, 0), n_cols)
        keep = None if keep_mask is None else _unit_column_stride(keep_mask).view(torch.uint8)
        tau_rows = temperature.rows
        if tau_rows is not None and tau_rows.numel() != n_rows:  # the kernel reads one per row
            raise ValueError(
                f"temperature must hold one value per row ({n_rows}), got shape "
                f"{tuple(tau_rows.shape)}"
            )
        target = None if target is None else _i64(target)
        threads = self.num_threads or torch.get_num_threads()
        threads = max(1, min(threads, n_rows * n_cols // MIN_ELEMENTS_PER_THREAD))
        if in_forked_child():  # no OpenMP region there (see backends.in_forked_child)
            threads = 1
        three = x.dim() == 3  # (B, T, V): row r is x[r // T, r % T]
        shard = _Shard(
            x.data_ptr(), x.stride(-2), n_rows, n_cols, n_real,
            _ptr(keep), 0 if keep is None else keep.stride(-2),
            _ptr(tau_rows), temperature.scalar,
            _KERNEL_DTYPE_CODES[logits.dtype], threads,
            self._table_min_cols(logits.dtype, pass_name) if pass_name else -1,
            _ptr(target), plan.vocab_start,
            -1 if plan.vocab_size is None else plan.vocab_size, plan.ignore_index,
            max(x.shape[1], 1) if three else max(n_rows, 1), x.stride(0) if three else 0,
            keep.stride(0) if three and keep is not None else 0,
        )  # fmt: skip
        return shard, (x, keep, tau_rows, target)

    @staticmethod
    def _check(status: int, what: str) -> None:
        if status != 0:
            raise RuntimeError(f"the CPU {what} kernel rejected its shard description")

    @staticmethod
    def _rows(n: int, row_max: torch.Tensor | None = None, record: torch.Tensor | None = None,
              keep_stats: bool = True):  # fmt: skip
        """(elp_rows, Finalized) over fresh per-row tensors; row_max and record are the
        given ones (finalize reads them) or fresh (the fused forward writes them); the
        gradient statistics in this thread's scratch where keep_stats is False."""
        empty, f32 = torch.empty, torch.float32
        # the statistics saved for backward (never returned) in one allocation; the outputs
        # each their own (a caller may write to one in place)
        (s_hi, s_lo, log_s, entropy64), ignored = _stats(n, keep_stats)
        fin = contract.Finalized(
            empty(n, dtype=f32), empty(n, dtype=f32), empty(n, dtype=f32), s_hi, s_lo, log_s,
            entropy64, empty(n, dtype=torch.int64), ignored,
        )  # fmt: skip
        row_max = empty(n, dtype=f32) if row_max is None else row_max
        if record is None:
            record = empty(n, contract.NUM_COLS, dtype=torch.int64)
        rows = _Rows(row_max.data_ptr(), record.data_ptr(), *[t.data_ptr() for t in fin])
        return rows, row_max, record, fin

    # --- the passes ---

    def row_max(self, logits, temperature, keep_mask, plan):
        out = torch.empty(num_rows(logits), dtype=torch.float32)
        shard, _alive = self._shard(logits, temperature, keep_mask, plan)
        self._check(self._lib.elp_row_max(ctypes.byref(shard), out.data_ptr()), "row max")
        return out

    def chunk_max(self, logits, temperature, plan, chunk):
        # the portable build's loop ran ~4.5x slower than torch's amax (256 against 58 ms
        # at 1024 x 151936 bf16): it takes the torch default, which gives the same bits
        if check_chunk(chunk) % CHUNK_MAX_STEP or self.isa == "baseline":
            return super().chunk_max(logits, temperature, plan, chunk)
        return self.kernel_chunk_max(logits, temperature, plan, chunk)

    def kernel_chunk_max(self, logits, temperature, plan, chunk):
        """chunk_max by the C kernel, on every build (what chunk_max runs on the AVX2 and
        AVX-512 builds); `chunk` a multiple of CHUNK_MAX_STEP."""
        real = plan.real_columns(logits.shape[-1])
        out = torch.empty(num_rows(logits), -(-real // chunk), dtype=torch.float32)
        shard, _alive = self._shard(logits, temperature, None, plan)
        row = CHUNK_MAX_STEP * (real // CHUNK_MAX_STEP + 1)  # past the row: one chunk of it
        status = self._lib.elp_chunk_max(ctypes.byref(shard), min(chunk, row), out.data_ptr())
        self._check(status, "chunk max")
        return out

    def partials(self, logits, target, temperature, keep_mask, row_max, plan):
        record = torch.empty(num_rows(logits), contract.NUM_COLS, dtype=torch.int64)
        shard, _alive = self._shard(logits, temperature, keep_mask, plan, "partials", target)
        m = _f32(row_max)
        status = self._lib.elp_partials(
            ctypes.byref(shard), m.data_ptr(), int(plan.with_entropy), record.data_ptr()
        )
        self._check(status, "partials")
        return record

    def forward_unsharded(self, logits, target, temperature, keep_mask, plan, keep_stats=True):
        shard, _alive = self._shard(logits, temperature, keep_mask, plan, "forward", target)
        rows, row_max, record, fin = self._rows(num_rows(logits), keep_stats=keep_stats)
        status = self._lib.elp_forward(ctypes.byref(shard), int(plan.with_entropy), rows)
        self._check(status, "forward")
        return row_max, record, fin

    def finalize(
        self, row_max, record, target, vocab_size, ignore_index, bad_temperature,
        ranks_disagree=None,
    ):  # fmt: skip
        target, bad_tau, disagree = _i64(target), _flags(bad_temperature), _flags(ranks_disagree)
        n = target.shape[0]
        rows, _, _, fin = self._rows(n, _f32(row_max), _i64(record))
        status = self._lib.elp_finalize(
            n, target.data_ptr(), -1 if vocab_size is None else vocab_size, ignore_index,
            _ptr(bad_tau), _ptr(disagree), rows,
        )  # fmt: skip
        self._check(status, "finalize")
        return fin

    def grad(self, logits, target, temperature, keep_mask, stats: GradStats, plan):
        out = torch.empty(logits.shape, dtype=logits.dtype)
        shard, _alive = self._shard(logits, temperature, keep_mask, plan, "grad", target)
        arrays = {"row_max": _f32(stats.row_max)}
        arrays.update({name: _f64(getattr(stats, name)) for name in _GRAD_FIELDS[1:]})
        arrays["row_nan"] = _flags(stats.row_nan)
        c_stats = _GradStats(**{name: t.data_ptr() for name, t in arrays.items()})
        status = self._lib.elp_grad(
            ctypes.byref(shard), ctypes.byref(c_stats), int(plan.with_entropy), out.data_ptr()
        )
        self._check(status, "grad")
        return out
