"""Value tables on the GPU: the contract once per distinct 16-bit value, for fp64-poor GPUs.

The direct kernels spend ~29 binary64 operations per logit (37 with entropy) in exp_c and
the quantisation; on GPUs whose fp64 rate is 1/32 or 1/64 of fp32 (L4, L40S, consumer
and newer fp64-poor parts) that, not memory, bounds them. A bf16 or fp16 row holds at
most 65536 values, and an LLM's row a few thousand: once the row's max is known, every
per-column quantity of the contract is a function of the column's value alone. So per row:

  1. count      histogram of the row's 16-bit values (real, kept columns): one integer
                atomic per logit into a 65536-bin int32 table (256 KiB per row in flight,
                L2-resident for a group of rows)
  2. list       scan the table: the distinct values and their counts, compacted with a
                prefix sum; the row max is the largest y of the listed values (fp32
                compares), the NaN / +inf columns are counted; the table is zeroed again
  3. sums       exp_c, quantisation and count x limb (int64) per distinct value: binary64
                work per distinct value instead of per logit
  backward      count and list again, the gradient bits of each distinct value into a
                65536-entry table, then a gather pass writes each column's bits (integer
                work per logit); the target column gets its own formula afterwards

The elementwise functions are kernels.py's (_exp_c, _quantize, _terms, _grad_columns,
_grad_bits), and the limb sums are integers: sum over values of count x limb is the sum
over columns, so every bit equals the direct kernels' (tests/test_backend_triton.py runs
both under the interpreter against the reference). Rows go through in groups of
GROUP_ROWS, so the scratch is GROUP_ROWS x (256 KiB table + 512 KiB list) whatever N is.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ... import contract
from ...contract import GradStats
from ..base import ShardPlan, num_rows
from . import kernels
from .kernels import (
    OUT_BF16,
    OUT_F16,
    _exp_c,
    _grad_bits,
    _grad_columns,
    _grad_row_stats,
    _owned_column,
    _quantize,
    _row_ptr,
    _scaled,
    _terms,
)
from .prepare import LaunchConfig, grad_temperature, prepare, programs_per_row

N_VALUES: tl.constexpr = tl.constexpr(1 << 16)
GROUP_ROWS = 128  # rows whose tables are in flight at once (32 MiB of counts, 64 of lists)
LIST_BLOCK = 4096  # table bins per loop step of the list pass (integer work)
VALUE_BLOCK = 1024  # distinct values per loop step of the fp64 passes (kernels' partials)
COUNT_BLOCK = 4096  # columns per loop step of the count and gather passes


# --- 1. count ---


@triton.jit
def count_kernel(
    x_ptr,  # [N, V_local] 16-bit logits read as int16 (rows as in kernels._row_ptr)
    keep_ptr,  # [N, V_local] uint8 keep mask (unused unless HAS_KEEP)
    hist_ptr,  # [G, 65536] int32 counts of the group's rows, zero on entry
    row0,  # the group's first row
    stride_x,
    stride_keep,
    rows_inner,
    stride_x_outer,
    stride_keep_outer,
    n_real,  # local columns below the padding
    cols_per_program,  # a multiple of BLOCK_V
    HAS_KEEP: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    slot = tl.program_id(0)
    row64 = (row0 + slot).to(tl.int64)
    x_row = _row_ptr(x_ptr, row64, rows_inner, stride_x_outer, stride_x)
    keep_row = _row_ptr(keep_ptr, row64, rows_inner, stride_keep_outer, stride_keep)
    hist = hist_ptr + slot.to(tl.int64) * N_VALUES
    start = tl.program_id(1) * cols_per_program
    stop = tl.minimum(start + cols_per_program, n_real)
    offs = tl.arange(0, BLOCK_V)
    for c0 in range(start, stop, BLOCK_V):
        cols = c0 + offs
        counted = cols < stop
        key = tl.load(x_row + cols, mask=counted, other=0).to(tl.uint16).to(tl.int32)
        if HAS_KEEP:
            counted = counted & (tl.load(keep_row + cols, mask=counted, other=0) != 0)
        tl.atomic_add(hist + key, 1, mask=counted, sem="relaxed")  # integer: any order


# --- 2. list ---


@triton.jit
def _value_y(value, tau, IS_BF16: tl.constexpr, HAS_TAU: tl.constexpr):
    """y of a 16-bit value (int32 in [0, 65536)): its fp32 widening, / tau (kernels._scaled)."""
    if IS_BF16:
        y = (value.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        y = value.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    if HAS_TAU:
        y = tl.math.div_rn(y, tau)
    return y


@triton.jit
def list_kernel(
    hist_ptr,  # [G, 65536] int32 counts; left zero
    list_ptr,  # [G, 65536] int64 the distinct values: count << 16 | value
    info_ptr,  # [G, 2] int64: how many distinct values, how many NaN / +inf columns
    max_ptr,  # [N] fp32: written with the largest y of the row when WRITE_MAX
    tau_ptr,
    row0,
    stride_tau,
    IS_BF16: tl.constexpr,
    HAS_TAU: tl.constexpr,
    WRITE_MAX: tl.constexpr,
    BLOCK: tl.constexpr,
):
    slot = tl.program_id(0)
    row64 = (row0 + slot).to(tl.int64)
    tau = tl.load(tau_ptr + row64 * stride_tau) if HAS_TAU else 1.0
    hist = hist_ptr + slot.to(tl.int64) * N_VALUES
    lst = list_ptr + slot.to(tl.int64) * N_VALUES
    offs = tl.arange(0, BLOCK)
    n = tl.zeros([], tl.int32)
    nonfinite = tl.zeros([], tl.int64)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    for b0 in range(0, N_VALUES, BLOCK):
        value = b0 + offs
        count = tl.load(hist + value)
        tl.store(hist + value, tl.zeros([BLOCK], tl.int32))
        seen = count > 0
        y = _value_y(value, tau, IS_BF16, HAS_TAU)
        finite_or_neg = (y == y) & (y != float("inf"))  # NaN and +inf are counted, not maxed
        best = tl.maximum(best, tl.where(seen & finite_or_neg, y, float("-inf")))
        nonfinite += tl.sum(tl.where(seen & ~finite_or_neg, count, 0).to(tl.int64), axis=0)
        at = n + tl.cumsum(seen.to(tl.int32), axis=0) - 1  # compaction by a prefix sum
        tl.store(lst + at, (count.to(tl.int64) << 16) | value.to(tl.int64), mask=seen)
        n += tl.sum(seen.to(tl.int32), axis=0)
    tl.store(info_ptr + slot * 2, n.to(tl.int64))
    tl.store(info_ptr + slot * 2 + 1, nonfinite)
    if WRITE_MAX:
        tl.store(max_ptr + row64, tl.max(best, axis=0))


@triton.jit
def _listed(list_ptr, slot, i0, n, BLOCK: tl.constexpr):
    """(value, count, live) of list entries [i0, i0 + BLOCK) of the slot's row."""
    idx = i0 + tl.arange(0, BLOCK)
    live = idx < n
    packed = tl.load(list_ptr + slot.to(tl.int64) * N_VALUES + idx, mask=live, other=0)
    return (packed & 0xFFFF).to(tl.int32), packed >> 16, live


# --- 3. sums ---


@triton.jit
def sums_kernel(
    x_ptr,  # [N, V_local] logits (bf16 as int16): the target's own value
    keep_ptr,
    tau_ptr,
    max_ptr,  # [N] fp32 global row max
    target_ptr,  # [N] int64 global target ids
    table_ptr,  # [32] fp64 contract.EXP2_TABLE
    list_ptr,  # [G, 65536] int64 from list_kernel
    info_ptr,  # [G, 2] int64 from list_kernel
    out_ptr,  # [N, NUM_COLS] int64 records
    row0,
    stride_x,
    stride_keep,
    stride_tau,
    rows_inner,
    stride_x_outer,
    stride_keep_outer,
    n_real,
    vocab_start,
    ignore_index,
    IS_BF16: tl.constexpr,
    HAS_TAU: tl.constexpr,
    HAS_KEEP: tl.constexpr,
    WITH_ENTROPY: tl.constexpr,
    BLOCK: tl.constexpr,
):
    slot = tl.program_id(0)
    row = row0 + slot
    row64 = row.to(tl.int64)
    tau = tl.load(tau_ptr + row64 * stride_tau) if HAS_TAU else 1.0
    m64 = tl.load(max_ptr + row64).to(tl.float64)
    n = tl.load(info_ptr + slot * 2).to(tl.int32)
    e_hi = tl.zeros([], tl.int64)
    e_lo = tl.zeros([], tl.int64)
    w_hi = tl.zeros([], tl.int64)
    w_lo = tl.zeros([], tl.int64)
    for i0 in range(0, n, BLOCK):
        value, count, live = _listed(list_ptr, slot, i0, n, BLOCK)
        dz, term = _terms(_value_y(value, tau, IS_BF16, HAS_TAU), live, m64)
        e = tl.where(term, _exp_c(dz, table_ptr), 0.0)
        hi, lo = _quantize(e)
        e_hi += tl.sum(hi * count, axis=0)  # count x limb: int64, wrapping as the sums do
        e_lo += tl.sum(lo * count, axis=0)
        if WITH_ENTROPY:
            hi, lo = _quantize(e * (-dz))
            w_hi += tl.sum(hi * count, axis=0)
            w_lo += tl.sum(lo * count, axis=0)

    rec = out_ptr + row64 * kernels.NUM_COLS
    tl.store(rec + kernels.COL_E_HI, e_hi)
    tl.store(rec + kernels.COL_E_LO, e_lo)
    tl.store(rec + kernels.COL_W_HI, w_hi)
    tl.store(rec + kernels.COL_W_LO, w_lo)
    tl.store(rec + kernels.COL_NONFINITE, tl.load(info_ptr + slot * 2 + 1))
    # the target: its fp32 bits, owner and masked counts (kernels.partials_kernel's)
    x_row = _row_ptr(x_ptr, row64, rows_inner, stride_x_outer, stride_x)
    keep_row = _row_ptr(keep_ptr, row64, rows_inner, stride_keep_outer, stride_keep)
    owner, t_col = _owned_column(target_ptr, row, vocab_start, n_real, ignore_index)
    y_t, kept = _scaled(x_row, keep_row, t_col, owner, tau, IS_BF16, HAS_TAU, HAS_KEEP)
    bits = y_t.to(tl.int32, bitcast=True).to(tl.int64)
    tl.store(rec + kernels.COL_TARGET_BITS, tl.where(owner, bits, 0))
    tl.store(rec + kernels.COL_OWNERS, owner.to(tl.int64))
    tl.store(rec + kernels.COL_TARGET_MASKED, (owner & ~kept).to(tl.int64))


# --- backward ---


@triton.jit
def grad_values_kernel(
    tau_ptr,
    tau64_ptr,  # [N] fp64 temperature the gradient is divided by
    table_ptr,
    max_ptr,
    s_hi_ptr,
    s_lo_ptr,
    log_s_ptr,
    ent_ptr,
    coef_a_ptr,
    coef_b_ptr,
    coef_t_ptr,
    coef_l_ptr,
    list_ptr,  # [G, 65536] int64 from list_kernel
    info_ptr,  # [G, 2] int64 from list_kernel
    gtab_ptr,  # [G, 65536] int16: the gradient bits of each listed value
    row0,
    stride_tau,
    IS_BF16: tl.constexpr,
    HAS_TAU: tl.constexpr,
    WITH_ENTROPY: tl.constexpr,
    OUT_KIND: tl.constexpr,
    BLOCK: tl.constexpr,
):
    slot = tl.program_id(0)
    row64 = (row0 + slot).to(tl.int64)
    tau = tl.load(tau_ptr + row64 * stride_tau) if HAS_TAU else 1.0
    m64, s_hi, s_lo, log_s, h, ca, cb, ct, cl = _grad_row_stats(
        row64, max_ptr, s_hi_ptr, s_lo_ptr, log_s_ptr, ent_ptr, coef_a_ptr, coef_b_ptr,
        coef_t_ptr, coef_l_ptr,
    )  # fmt: skip
    n = tl.load(info_ptr + slot * 2).to(tl.int32)
    for i0 in range(0, n, BLOCK):
        value, _, live = _listed(list_ptr, slot, i0, n, BLOCK)
        y = _value_y(value, tau, IS_BF16, HAS_TAU)
        g, _ = _grad_columns(y, live, m64, table_ptr, s_hi, s_lo, log_s, h, ca, cb, ct, cl,
                             WITH_ENTROPY)  # fmt: skip
        if HAS_TAU:
            g = g / tl.load(tau64_ptr + row64 * stride_tau)
        bits = _grad_bits(g, tl.zeros([BLOCK], tl.int1), OUT_KIND)
        tl.store(gtab_ptr + slot.to(tl.int64) * N_VALUES + value, bits.to(tl.int16), mask=live)


@triton.jit
def gather_kernel(
    x_ptr,  # [N, V_local] 16-bit logits read as int16
    keep_ptr,
    gtab_ptr,  # [G, 65536] int16 from grad_values_kernel
    row_nan_ptr,  # [N] uint8
    out_ptr,  # [N, V_local] int16, contiguous
    row0,
    stride_x,
    stride_keep,
    rows_inner,
    stride_x_outer,
    stride_keep_outer,
    n_cols,
    n_real,
    HAS_KEEP: tl.constexpr,
    NAN_BITS: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    slot = tl.program_id(0)
    row64 = (row0 + slot).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    valid = cols < n_real
    x_row = _row_ptr(x_ptr, row64, rows_inner, stride_x_outer, stride_x)
    key = tl.load(x_row + cols, mask=valid, other=0).to(tl.uint16).to(tl.int32)
    if HAS_KEEP:
        keep_row = _row_ptr(keep_ptr, row64, rows_inner, stride_keep_outer, stride_keep)
        valid = valid & (tl.load(keep_row + cols, mask=valid, other=0) != 0)
    # padding and masked columns: +0, the direct kernel's value of a column without a term
    bits = tl.load(gtab_ptr + slot.to(tl.int64) * N_VALUES + key, mask=valid, other=0)
    row_nan = tl.load(row_nan_ptr + row64) != 0
    bits = tl.where(row_nan, tl.full([BLOCK_V], NAN_BITS, tl.int32).to(tl.int16), bits)
    tl.store(out_ptr + row64 * n_cols + cols, bits, mask=cols < n_cols)


@triton.jit
def grad_target_kernel(
    x_ptr,
    keep_ptr,
    tau_ptr,
    tau64_ptr,
    target_ptr,
    table_ptr,
    max_ptr,
    s_hi_ptr,
    s_lo_ptr,
    log_s_ptr,
    ent_ptr,
    coef_a_ptr,
    coef_b_ptr,
    coef_t_ptr,
    coef_l_ptr,
    row_nan_ptr,
    out_ptr,  # [N, V_local] int16, contiguous
    row0,
    stride_x,
    stride_keep,
    stride_tau,
    rows_inner,
    stride_x_outer,
    stride_keep_outer,
    n_cols,
    n_real,
    vocab_start,
    ignore_index,
    IS_BF16: tl.constexpr,
    HAS_TAU: tl.constexpr,
    HAS_KEEP: tl.constexpr,
    WITH_ENTROPY: tl.constexpr,
    OUT_KIND: tl.constexpr,
):
    """The target column of each row, with its own formula (kernels.grad_kernel's)."""
    row = row0 + tl.program_id(0)
    row64 = row.to(tl.int64)
    owner, t_col = _owned_column(target_ptr, row, vocab_start, n_real, ignore_index)
    tau = tl.load(tau_ptr + row64 * stride_tau) if HAS_TAU else 1.0
    x_row = _row_ptr(x_ptr, row64, rows_inner, stride_x_outer, stride_x)
    keep_row = _row_ptr(keep_ptr, row64, rows_inner, stride_keep_outer, stride_keep)
    y, valid = _scaled(x_row, keep_row, t_col, owner, tau, IS_BF16, HAS_TAU, HAS_KEEP)
    m64, s_hi, s_lo, log_s, h, ca, cb, ct, cl = _grad_row_stats(
        row64, max_ptr, s_hi_ptr, s_lo_ptr, log_s_ptr, ent_ptr, coef_a_ptr, coef_b_ptr,
        coef_t_ptr, coef_l_ptr,
    )  # fmt: skip
    _, g_t = _grad_columns(y, valid, m64, table_ptr, s_hi, s_lo, log_s, h, ca, cb, ct, cl,
                           WITH_ENTROPY)  # fmt: skip
    if HAS_TAU:
        g_t = g_t / tl.load(tau64_ptr + row64 * stride_tau)
    bits = _grad_bits(g_t, tl.load(row_nan_ptr + row64) != 0, OUT_KIND)
    tl.store(out_ptr + row64 * n_cols + t_col, bits.to(tl.int16), mask=owner)


# --- launching ---

_OUT = {torch.bfloat16: (OUT_BF16.value, kernels.NAN_BF16.value - (1 << 16)),
        torch.float16: (OUT_F16.value, kernels.NAN_F16.value)}  # fmt: skip


def supports(dtype: torch.dtype) -> bool:
    return dtype in _OUT


def _scratch(rows: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(zeroed counts, list, info) for a group of up to `rows` rows."""
    g = max(1, min(rows, GROUP_ROWS))
    hist = torch.zeros(g, 1 << 16, dtype=torch.int32, device=device)
    lst = torch.empty(g, 1 << 16, dtype=torch.int64, device=device)
    info = torch.empty(g, 2, dtype=torch.int64, device=device)
    return hist, lst, info


def _count_and_list(prep, keep_mask, hist, lst, info, row_max, r0, g, write_max):
    """Steps 1 and 2 for rows [r0, r0 + g)."""
    device = prep.x.device
    cfg = LaunchConfig(COUNT_BLOCK, 8)
    parts, per_program = programs_per_row(g, prep.n_real, cfg, device)
    x16 = prep.x.view(torch.int16)
    stride_x, stride_keep, stride_tau, rows_inner, sx_outer, sk_outer = prep.row_args()
    count_kernel[(g, parts)](
        x16, prep.keep, hist, r0, stride_x, stride_keep, rows_inner, sx_outer, sk_outer,
        prep.n_real, per_program, HAS_KEEP=keep_mask is not None, BLOCK_V=COUNT_BLOCK,
        num_warps=8,
    )  # fmt: skip
    list_kernel[(g,)](
        hist, lst, info, row_max, prep.tau, r0, stride_tau,
        IS_BF16=prep.x.dtype != torch.float16, HAS_TAU=prep.has_tau, WRITE_MAX=write_max,
        BLOCK=LIST_BLOCK, num_warps=8,
    )  # fmt: skip


def sums(logits, target, temperature, keep_mask, row_max, plan: ShardPlan):
    """(row max, record): steps 1-3; `row_max` None finds the max from the values (the
    whole vocabulary is here), else it is the global max."""
    n = num_rows(logits)
    device = logits.device
    record = torch.empty(n, contract.NUM_COLS, dtype=torch.int64, device=device)
    write_max = row_max is None
    if write_max:
        row_max = torch.empty(n, dtype=torch.float32, device=device)
    if n == 0:
        return row_max, record.zero_()
    prep = prepare(logits, temperature, keep_mask, plan)
    row_max = row_max.to(torch.float32).contiguous()
    target = target.to(torch.int64).contiguous()
    hist, lst, info = _scratch(n, device)
    for r0 in range(0, n, hist.shape[0]):
        g = min(hist.shape[0], n - r0)
        _count_and_list(prep, keep_mask, hist, lst, info, row_max, r0, g, write_max)
        sums_kernel[(g,)](
            prep.x, prep.keep, prep.tau, row_max, target,
            contract.exp2_table(device), lst, info, record, r0, *prep.row_args(),
            prep.n_real, plan.vocab_start, plan.ignore_index,
            IS_BF16=logits.dtype == torch.bfloat16, HAS_TAU=prep.has_tau,
            HAS_KEEP=keep_mask is not None, WITH_ENTROPY=plan.with_entropy, BLOCK=VALUE_BLOCK,
            num_warps=4, enable_fp_fusion=False,
        )  # fmt: skip
    return row_max, record


def grad(logits, target, temperature, keep_mask, stats: GradStats, plan: ShardPlan):
    """Backend.grad through the value tables (16-bit logits)."""
    n, n_cols = num_rows(logits), logits.shape[-1]
    device = logits.device
    out = torch.empty(n, n_cols, dtype=logits.dtype, device=device)
    if n == 0 or n_cols == 0:
        return out.view(logits.shape)
    prep = prepare(logits, temperature, keep_mask, plan)
    tau64 = grad_temperature(temperature, prep)
    kind, nan_bits = _OUT[logits.dtype]
    f64 = lambda t: t.to(torch.float64).contiguous()  # noqa: E731
    row_stats = (
        stats.row_max.to(torch.float32).contiguous(), f64(stats.s_hi), f64(stats.s_lo),
        f64(stats.log_s), f64(stats.entropy64), f64(stats.coef_a), f64(stats.coef_b),
        f64(stats.coef_t), f64(stats.coef_l),
    )  # fmt: skip
    row_nan = stats.row_nan.to(torch.uint8).contiguous()
    target = target.to(torch.int64).contiguous()
    table = contract.exp2_table(device)
    hist, lst, info = _scratch(n, device)
    gtab = torch.empty(hist.shape, dtype=torch.int16, device=device)
    x16 = prep.x.view(torch.int16)
    stride_x, stride_keep, stride_tau, rows_inner, sx_outer, sk_outer = prep.row_args()
    flags = dict(IS_BF16=logits.dtype == torch.bfloat16, HAS_TAU=prep.has_tau)
    out16 = out.view(torch.int16)
    for r0 in range(0, n, hist.shape[0]):
        g = min(hist.shape[0], n - r0)
        _count_and_list(prep, keep_mask, hist, lst, info, row_stats[0], r0, g, False)
        grad_values_kernel[(g,)](
            prep.tau, tau64, table, *row_stats, lst, info, gtab, r0, stride_tau, **flags,
            WITH_ENTROPY=plan.with_entropy, OUT_KIND=kind, BLOCK=VALUE_BLOCK, num_warps=4,
            enable_fp_fusion=False,
        )  # fmt: skip
        gather_kernel[(g, -(-n_cols // COUNT_BLOCK))](
            x16, prep.keep, gtab, row_nan, out16, r0, stride_x, stride_keep, rows_inner,
            sx_outer, sk_outer, n_cols, prep.n_real, HAS_KEEP=keep_mask is not None,
            NAN_BITS=nan_bits, BLOCK_V=COUNT_BLOCK, num_warps=8,
        )  # fmt: skip
        grad_target_kernel[(g,)](
            prep.x, prep.keep, prep.tau, tau64, target, table, *row_stats, row_nan, out16, r0,
            *prep.row_args(), n_cols, prep.n_real, plan.vocab_start, plan.ignore_index,
            **flags, HAS_KEEP=keep_mask is not None, WITH_ENTROPY=plan.with_entropy,
            OUT_KIND=kind, num_warps=1, enable_fp_fusion=False,
        )  # fmt: skip
    return out.view(logits.shape)
