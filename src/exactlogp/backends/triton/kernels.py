"""Triton kernels of the contract (exactlogp.CONTRACT): max pass, partials pass, finalize and gradient.

Each kernel replays `exactlogp.contract` operation for operation, so its bits are the
reference's on any GPU and under the Triton interpreter:

  max pass     y = fp32(x) / tau -> running max of the valid, finite-or--inf y
  chunk maxima max of fp32(x) over each chunk of columns, NaN flagged -> / tau (exact cut)
  partials pass    d = y - M (fp64) -> exp_c -> quantize -> int64 limb sums, target, counters
  finalize     record -> bad flags -> S (double-double) -> log_c -> outputs, per-row stats
  gradient     d -> exp_c -> p = e / fl(S) -> g -> g / tau -> fp32 -> logits dtype

What keeps the bits equal (launch.py holds the launch side of it):
- Every contract constant is built with `tl.full(..., tl.float64)`: a bare Python float in
  a compiled Triton expression is typed fp32 and would be rounded (the interpreter does not
  round it, so the interpreter tests alone would not see the mistake; benchmarks/
  triton_ptx_check.py checks every fp64 immediate of the compiled code). Only 0.0, 1.0
  and 2.0, exact in fp32, appear bare.
- fp32 division is `tl.math.div_rn` (plain `/` on fp32 lowers to the approximate
  div.full); fp64 `/` lowers to div.rn.f64, the IEEE division.
- Integer <-> binary64 conversions in finalize are the contract's own: int64 -> fp64
  rounds to nearest even (cvt.rn), and fp64 -> int64 only ever meets integers.
- No FMA: the kernels are launched with enable_fp_fusion=False, so every + - * is emitted
  as a separately rounded .rn instruction that ptxas never contracts.
- No exp/log from Triton or libdevice: exp_c is Cody-Waite + the contract's table and
  polynomial in Horner order; 2^n is built from its bit pattern.
- bf16 is widened and narrowed with integer bit operations (exact, and identical in the
  interpreter, whose own bf16 conversions truncate).
- Float -> int conversions are done by reading the magic-number sum's bit pattern; every
  value reaching one is finite and in range (d is zeroed outside [CUTOFF, 0]).
- NaN outputs and gradients are written with the bit patterns the reference produces on
  the CPU.
"""

from __future__ import annotations

import struct

import triton
import triton.language as tl

from ... import contract


def _bits(value: float) -> int:
    return struct.unpack("<q", struct.pack("<d", value))[0]


# --- the contract's numbers, as compile-time constants (defined once, in contract.py) ---

CUTOFF: tl.constexpr = tl.constexpr(contract.CUTOFF)
MAGIC: tl.constexpr = tl.constexpr(contract.MAGIC)
MAGIC_BITS: tl.constexpr = tl.constexpr(_bits(contract.MAGIC))
LIMB_SCALE: tl.constexpr = tl.constexpr(contract.LIMB_SCALE)
INV_LN2_32: tl.constexpr = tl.constexpr(contract.INV_LN2_32)
LN2_32_HI: tl.constexpr = tl.constexpr(contract.LN2_32_HI)
LN2_32_LO: tl.constexpr = tl.constexpr(contract.LN2_32_LO)
P6: tl.constexpr = tl.constexpr(contract.EXP_POLY[0])  # 1/6!
P5: tl.constexpr = tl.constexpr(contract.EXP_POLY[1])
P4: tl.constexpr = tl.constexpr(contract.EXP_POLY[2])
P3: tl.constexpr = tl.constexpr(contract.EXP_POLY[3])
P2: tl.constexpr = tl.constexpr(contract.EXP_POLY[4])
P1: tl.constexpr = tl.constexpr(contract.EXP_POLY[5])
P0: tl.constexpr = tl.constexpr(contract.EXP_POLY[6])  # 1/0!
NUM_COLS: tl.constexpr = tl.constexpr(contract.NUM_COLS)
COL_E_HI: tl.constexpr = tl.constexpr(contract.COL_E_HI)
COL_E_LO: tl.constexpr = tl.constexpr(contract.COL_E_LO)
COL_W_HI: tl.constexpr = tl.constexpr(contract.COL_W_HI)
COL_W_LO: tl.constexpr = tl.constexpr(contract.COL_W_LO)
COL_TARGET_BITS: tl.constexpr = tl.constexpr(contract.COL_TARGET_BITS)
COL_OWNERS: tl.constexpr = tl.constexpr(contract.COL_OWNERS)
COL_TARGET_MASKED: tl.constexpr = tl.constexpr(contract.COL_TARGET_MASKED)
COL_NONFINITE: tl.constexpr = tl.constexpr(contract.COL_NONFINITE)
FRAC_BITS: tl.constexpr = tl.constexpr(contract.FRAC_BITS)
LIMB_MASK: tl.constexpr = tl.constexpr(contract.LIMB_MASK)
LIMB_ONE: tl.constexpr = tl.constexpr(1 << contract.FRAC_BITS)  # 1.0 as a high limb
LIMB_UNIT: tl.constexpr = tl.constexpr(contract.LIMB_UNIT)
LIMB2_UNIT: tl.constexpr = tl.constexpr(contract.LIMB2_UNIT)
SQRT_HALF: tl.constexpr = tl.constexpr(contract.SQRT_HALF)
LN2_HI: tl.constexpr = tl.constexpr(contract.LN2_HI)
LN2_LO: tl.constexpr = tl.constexpr(contract.LN2_LO)
# contract.LOG_POLY, 1/(2i+1) for i = 11 .. 1: the contract log's odd series in s^2
L23: tl.constexpr = tl.constexpr(contract.LOG_POLY[0])  # 1/23
L21: tl.constexpr = tl.constexpr(contract.LOG_POLY[1])
L19: tl.constexpr = tl.constexpr(contract.LOG_POLY[2])
L17: tl.constexpr = tl.constexpr(contract.LOG_POLY[3])
L15: tl.constexpr = tl.constexpr(contract.LOG_POLY[4])
L13: tl.constexpr = tl.constexpr(contract.LOG_POLY[5])
L11: tl.constexpr = tl.constexpr(contract.LOG_POLY[6])
L9: tl.constexpr = tl.constexpr(contract.LOG_POLY[7])
L7: tl.constexpr = tl.constexpr(contract.LOG_POLY[8])
L5: tl.constexpr = tl.constexpr(contract.LOG_POLY[9])
L3: tl.constexpr = tl.constexpr(contract.LOG_POLY[10])  # 1/3
BAD_TARGET_RANGE: tl.constexpr = tl.constexpr(contract.BAD_TARGET_RANGE)
BAD_TARGET_OWNER: tl.constexpr = tl.constexpr(contract.BAD_TARGET_OWNER)
BAD_TARGET_MASKED: tl.constexpr = tl.constexpr(contract.BAD_TARGET_MASKED)
BAD_NONFINITE: tl.constexpr = tl.constexpr(contract.BAD_NONFINITE)
BAD_NO_VALID_COLUMN: tl.constexpr = tl.constexpr(contract.BAD_NO_VALID_COLUMN)
BAD_TEMPERATURE: tl.constexpr = tl.constexpr(contract.BAD_TEMPERATURE)
BAD_RANKS: tl.constexpr = tl.constexpr(contract.BAD_RANKS)

# Bit patterns of the NaN the reference writes into a NaN row's gradient on the CPU:
# fp64 NaN -> fp32 0x7fc00000 -> fp16 0x7e00 / bf16 0xffff (torch's vectorised conversion).
NAN_F32: tl.constexpr = tl.constexpr(0x7FC00000)
NAN_F16: tl.constexpr = tl.constexpr(0x7E00)
NAN_BF16: tl.constexpr = tl.constexpr(0xFFFF)

# Output dtype codes of the gradient kernel (constexpr OUT_KIND).
OUT_F32: tl.constexpr = tl.constexpr(0)
OUT_F16: tl.constexpr = tl.constexpr(1)
OUT_BF16: tl.constexpr = tl.constexpr(2)


# --- 1. upcast and temperature ---


@triton.jit
def _scaled(
    x_row, keep_row, cols, in_range, tau,
    IS_BF16: tl.constexpr, HAS_TAU: tl.constexpr, HAS_KEEP: tl.constexpr,
):  # fmt: skip
    """(y, valid): y = fp32(x) / tau; valid = in range (real columns) and kept.

    bf16 logits are read as int16 bit patterns and widened exactly by a shift.
    """
    if IS_BF16:
        raw = tl.load(x_row + cols, mask=in_range, other=0)
        y = (raw.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        y = tl.load(x_row + cols, mask=in_range, other=0.0).to(tl.float32)
    if HAS_TAU:
        y = tl.math.div_rn(y, tau)  # IEEE fp32 division, round to nearest even
    valid = in_range
    if HAS_KEEP:
        valid = valid & (tl.load(keep_row + cols, mask=in_range, other=0) != 0)
    return y, valid


# --- 3. contract exponential ---


@triton.jit
def _exp_c(d, table_ptr):
    """contract.exp_c for fp64 d in [CUTOFF, 0]."""
    magic = tl.full([], MAGIC, tl.float64)
    big = d * tl.full([], INV_LN2_32, tl.float64) + magic
    kd = big - magic  # rint(d * 32 / ln2), round half to even
    # k = int(kd): big = MAGIC + k holds k in its low bits, and MAGIC's low word is 0.
    k = big.to(tl.int64, bitcast=True).to(tl.int32)
    r = (d - kd * tl.full([], LN2_32_HI, tl.float64)) - kd * tl.full([], LN2_32_LO, tl.float64)
    p = tl.full([], P6, tl.float64)
    p = p * r + tl.full([], P5, tl.float64)  # Horner, each step two roundings (no FMA)
    p = p * r + tl.full([], P4, tl.float64)
    p = p * r + tl.full([], P3, tl.float64)
    p = p * r + tl.full([], P2, tl.float64)
    p = p * r + tl.full([], P1, tl.float64)
    p = p * r + tl.full([], P0, tl.float64)
    table = tl.load(table_ptr + (k & 31))
    scale = (((k >> 5) + 1023).to(tl.int64) << 52).to(tl.float64, bitcast=True)  # 2^(k >> 5)
    return (table * p) * scale


# --- 4. quantize ---


@triton.jit
def _quantize(v):
    """contract.quantize for v in [0, 1] (or -0): (hi, lo) int64 limbs.

    floor and rint are read from the bit pattern of s + MAGIC instead of converting a
    float to an integer: the same integers, with no conversion instruction.
    """
    magic = tl.full([], MAGIC, tl.float64)
    scale = tl.full([], LIMB_SCALE, tl.float64)
    s = v * scale  # exact
    big = s + magic  # MAGIC + rint(s), exact since 0 <= s <= 2^42
    near = big - magic
    up = near > s  # rint rounded up: floor(s) is one less
    hi = big.to(tl.int64, bitcast=True) - MAGIC_BITS - up.to(tl.int64)
    rem = s - tl.where(up, near - 1.0, near)  # s - floor(s), exact
    lo = (rem * scale + magic).to(tl.int64, bitcast=True) - MAGIC_BITS  # rint, exact
    return hi, lo


@triton.jit
def _terms(y, valid, m64):
    """(dz, term): term = valid & CUTOFF <= d <= 0 for d = y - M in fp64 (false for NaN);
    dz = d on terms, 0 elsewhere, so exp_c only ever sees [CUTOFF, 0]."""
    d = y.to(tl.float64) - m64
    term = valid & (d >= tl.full([], CUTOFF, tl.float64)) & (d <= 0.0)
    return tl.where(term, d, 0.0), term


@triton.jit
def _owned_column(target_ptr, row, vocab_start, n_real, ignore_index):
    """(owner, local column) of this row's target: contract.owned_target_columns
    transcribed (real columns are those below n_real), so that no launch precedes."""
    target = tl.load(target_ptr + row)
    local = target - vocab_start
    owner = (target != ignore_index) & (local >= 0) & (local < n_real)
    return owner, tl.where(owner, local, 0).to(tl.int32)


@triton.jit
def _row_ptr(ptr, row64, rows_inner, stride_outer, stride_row):
    """Row `row64` of rows read in two levels without a copy: row r % rows_inner of block
    r // rows_inner ((B, T, V) views such as logits[:, :-1, :]; plain (N, V) rows have
    rows_inner >= N, so the block is always 0)."""
    return ptr + (row64 // rows_inner) * stride_outer + (row64 % rows_inner) * stride_row


@triton.jit
def _row_span(x_ptr, keep_ptr, tau_ptr, stride_x, stride_keep, stride_tau, rows_inner,
              stride_x_outer, stride_keep_outer, n_real, cols_per_program,
              HAS_TAU: tl.constexpr):  # fmt: skip
    """This program's row: (row, its logits, its keep mask, its temperature) and the
    columns [start, stop) it covers (program_id(1) splits a long row)."""
    row = tl.program_id(0)
    row64 = row.to(tl.int64)
    tau = tl.load(tau_ptr + row64 * stride_tau) if HAS_TAU else 1.0
    start = tl.program_id(1) * cols_per_program
    stop = tl.minimum(start + cols_per_program, n_real)
    x_row = _row_ptr(x_ptr, row64, rows_inner, stride_x_outer, stride_x)
    keep_row = _row_ptr(keep_ptr, row64, rows_inner, stride_keep_outer, stride_keep)
    return row, x_row, keep_row, tau, start, stop


# --- 2. the max pass ---


@triton.jit
def row_max_kernel(
    x_ptr,  # [N, V_local] logits, row stride stride_x (bf16 passed as int16)
    keep_ptr,  # [N, V_local] uint8 keep mask (unused unless HAS_KEEP)
    tau_ptr,  # [N] fp32 temperature, stride_tau 0 for a scalar (unused unless HAS_TAU)
    out_ptr,  # [N, num_programs(1)] fp32 partial maxima
    stride_x,  # between rows of a block
    stride_keep,
    stride_tau,
    rows_inner,  # rows per block (_row_ptr)
    stride_x_outer,  # between blocks of rows
    stride_keep_outer,
    n_real,  # local columns below the padding
    cols_per_program,  # a multiple of BLOCK_V
    IS_BF16: tl.constexpr,
    HAS_TAU: tl.constexpr,
    HAS_KEEP: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row, x_row, keep_row, tau, start, stop = _row_span(
        x_ptr, keep_ptr, tau_ptr, stride_x, stride_keep, stride_tau, rows_inner, stride_x_outer,
        stride_keep_outer, n_real, cols_per_program, HAS_TAU,
    )  # fmt: skip
    offs = tl.arange(0, BLOCK_V)
    acc = tl.full([BLOCK_V], float("-inf"), tl.float32)
    for c0 in range(start, stop, BLOCK_V):
        cols = c0 + offs
        in_range = cols < stop
        y, valid = _scaled(x_row, keep_row, cols, in_range, tau, IS_BF16, HAS_TAU, HAS_KEEP)
        ok = valid & (y == y) & (y != float("inf"))  # NaN and +inf are counted, not maxed
        acc = tl.maximum(acc, tl.where(ok, y, float("-inf")))
    slot = row.to(tl.int64) * tl.num_programs(1) + tl.program_id(1)
    tl.store(out_ptr + slot, tl.max(acc, axis=0))


# --- the class maxima of the fused LM head's backward (Backend.class_max) ---


@triton.jit
def class_max_kernel(
    z_ptr,  # [R, P] fp32 logits, row stride stride_z, unit column stride
    cls_ptr,  # [P] int32 class of each column (CLASSES or more: none)
    skip_ptr,  # [R] int64 the column each row leaves out (-1: none)
    out_ptr,  # [R, CLASSES] fp32 out
    P,
    stride_z,
    CLASSES: tl.constexpr,  # a power of two
    BLOCK_V: tl.constexpr,
):
    """One program per row: the max of z over each class's columns, -inf for none. Plain
    compares and selects, no atomics: a row's columns fall into a few classes, which
    atomics would serialise on."""
    row = tl.program_id(0).to(tl.int64)
    skip = tl.load(skip_ptr + row)
    ks = tl.arange(0, CLASSES)
    acc = tl.full([CLASSES], float("-inf"), tl.float32)
    for c0 in range(0, P, BLOCK_V):
        cols = c0 + tl.arange(0, BLOCK_V)
        ok = (cols < P) & (cols != skip)
        z = tl.load(z_ptr + row * stride_z + cols, mask=ok, other=float("-inf"))
        c = tl.load(cls_ptr + cols, mask=ok, other=CLASSES)
        hit = c[None, :] == ks[:, None]  # [CLASSES, BLOCK_V]
        acc = tl.maximum(acc, tl.max(tl.where(hit, z[None, :], float("-inf")), axis=1))
    tl.store(out_ptr + row * CLASSES + ks, acc)


# --- the chunk maxima of the exact cut (Backend.chunk_max) ---


@triton.jit
def chunk_max_kernel(
    x_ptr,  # [N, V_local] logits, row stride stride_x (bf16 passed as int16)
    tau_ptr,  # [N] fp32 temperature, stride_tau 0 for a scalar (unused unless HAS_TAU)
    out_ptr,  # [N, n_chunks] fp32 chunk maxima of y
    stride_x,  # between rows of a block
    stride_tau,
    rows_inner,  # rows per block (_row_ptr)
    stride_x_outer,  # between blocks of rows
    n_real,  # local columns below the padding
    n_chunks,  # ceil(n_real / chunk)
    chunk,  # columns per chunk
    chunks_per_program,  # a multiple of BLOCK_C
    IS_BF16: tl.constexpr,
    HAS_TAU: tl.constexpr,
    BLOCK_C: tl.constexpr,  # chunks per step of the loop
    BLOCK_K: tl.constexpr,  # columns of a chunk per step (a power of two)
):
    """Each chunk's max of fp32(x) over its real columns, NaN where one of them is NaN
    (an explicit flag: the max never sees a NaN), then y = max / tau by one IEEE division
    per chunk, a zero as +0. IEEE division by a fixed tau is monotonic, so this is the max
    of y (for tau > 0) and, for every tau, base.Backend.chunk_max's bits."""
    row64 = tl.program_id(0).to(tl.int64)
    tau = tl.load(tau_ptr + row64 * stride_tau) if HAS_TAU else 1.0
    x_row = _row_ptr(x_ptr, row64, rows_inner, stride_x_outer, stride_x)
    first = tl.program_id(1) * chunks_per_program
    stop = tl.minimum(first + chunks_per_program, n_chunks)
    offs_c = tl.arange(0, BLOCK_C)
    offs_k = tl.arange(0, BLOCK_K)
    nan = tl.full([BLOCK_C], NAN_F32, tl.int32).to(tl.float32, bitcast=True)
    for c0 in range(first, stop, BLOCK_C):
        chunks = c0 + offs_c
        live = chunks < stop
        top = tl.full([BLOCK_C], float("-inf"), tl.float32)
        has_nan = tl.zeros([BLOCK_C], tl.int32)
        for k0 in range(0, chunk, BLOCK_K):
            k = k0 + offs_k
            cols = chunks[:, None] * chunk + k[None, :]
            in_range = live[:, None] & (k[None, :] < chunk) & (cols < n_real)
            x, _ = _scaled(x_row, x_row, cols, in_range, 1.0, IS_BF16, False, False)
            top = tl.maximum(top, tl.max(tl.where(in_range & (x == x), x, float("-inf")), 1))
            has_nan = tl.maximum(has_nan, tl.max((in_range & (x != x)).to(tl.int32), 1))
        top = tl.where(has_nan != 0, nan, top)
        if HAS_TAU:
            top = tl.math.div_rn(top, tau)  # IEEE fp32 division, round to nearest even
        top = tl.where(top == 0.0, 0.0, top)  # -0 -> +0
        tl.store(out_ptr + row64 * n_chunks + chunks, top, mask=live)


# --- 3-5. the partials pass ---


@triton.jit
def partials_kernel(
    x_ptr,  # [N, V_local] logits, row stride stride_x (bf16 passed as int16)
    keep_ptr,  # [N, V_local] uint8 keep mask (unused unless HAS_KEEP)
    tau_ptr,  # [N] fp32 temperature, stride_tau 0 for a scalar (unused unless HAS_TAU)
    max_ptr,  # [N] fp32 global row max
    target_ptr,  # [N] int64 global target ids
    table_ptr,  # [32] fp64 contract.EXP2_TABLE
    out_ptr,  # [N, num_programs(1), NUM_COLS] int64 partial records
    stride_x,  # between rows of a block
    stride_keep,
    stride_tau,
    rows_inner,  # rows per block (_row_ptr)
    stride_x_outer,  # between blocks of rows
    stride_keep_outer,
    n_real,  # local columns below the padding
    vocab_start,
    ignore_index,
    cols_per_program,  # a multiple of BLOCK_V
    IS_BF16: tl.constexpr,
    HAS_TAU: tl.constexpr,
    HAS_KEEP: tl.constexpr,
    WITH_ENTROPY: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row, x_row, keep_row, tau, start, stop = _row_span(
        x_ptr, keep_ptr, tau_ptr, stride_x, stride_keep, stride_tau, rows_inner, stride_x_outer,
        stride_keep_outer, n_real, cols_per_program, HAS_TAU,
    )  # fmt: skip
    row64, part = row.to(tl.int64), tl.program_id(1)
    m64 = tl.load(max_ptr + row).to(tl.float64)
    offs = tl.arange(0, BLOCK_V)

    # per-lane sums, reduced once after the loop: int64 sums are exact in any order (a lane
    # adds at most n_real / BLOCK_V limbs < 2^42 each), so no block reduction per step
    e_hi = tl.zeros([BLOCK_V], tl.int64)
    e_lo = tl.zeros([BLOCK_V], tl.int64)
    w_hi = tl.zeros([BLOCK_V], tl.int64)
    w_lo = tl.zeros([BLOCK_V], tl.int64)
    nonfinite = tl.zeros([BLOCK_V], tl.int32)
    for c0 in range(start, stop, BLOCK_V):
        cols = c0 + offs
        in_range = cols < stop
        y, valid = _scaled(x_row, keep_row, cols, in_range, tau, IS_BF16, HAS_TAU, HAS_KEEP)
        dz, term = _terms(y, valid, m64)
        e = tl.where(term, _exp_c(dz, table_ptr), 0.0)
        hi, lo = _quantize(e)
        e_hi += hi
        e_lo += lo
        if WITH_ENTROPY:
            hi, lo = _quantize(e * (-dz))
            w_hi += hi
            w_lo += lo
        bad = valid & ((y != y) | (y == float("inf")))
        nonfinite += bad.to(tl.int32)

    rec = out_ptr + (row64 * tl.num_programs(1) + part) * NUM_COLS
    tl.store(rec + COL_E_HI, tl.sum(e_hi, axis=0))
    tl.store(rec + COL_E_LO, tl.sum(e_lo, axis=0))
    tl.store(rec + COL_W_HI, tl.sum(w_hi, axis=0))
    tl.store(rec + COL_W_LO, tl.sum(w_lo, axis=0))
    tl.store(rec + COL_NONFINITE, tl.sum(nonfinite.to(tl.int64), axis=0))

    # --- the target: its fp32 bits, owner and masked counts, from program 0 of the row ---
    owner, t_col = _owned_column(target_ptr, row, vocab_start, n_real, ignore_index)
    owner = owner & (part == 0)
    y_t, kept = _scaled(x_row, keep_row, t_col, owner, tau, IS_BF16, HAS_TAU, HAS_KEEP)
    bits = y_t.to(tl.int32, bitcast=True).to(tl.int64)  # sign-extended, as the reference
    masked = (owner & ~kept).to(tl.int64)
    tl.store(rec + COL_TARGET_BITS, tl.where(owner, bits, 0))
    tl.store(rec + COL_OWNERS, owner.to(tl.int64))
    tl.store(rec + COL_TARGET_MASKED, masked)


# --- 7. finalize ---


@triton.jit
def _two_sum(a, b):
    """contract.two_sum: s = fl(a + b) and its exact rounding error."""
    s = a + b
    bb = s - a
    return s, (a - (s - bb)) + (b - bb)


@triton.jit
def _limbs_to_double_double(hi, lo):
    """contract.limbs_to_double_double: int64 limb sums -> (fl(value), exact rest)."""
    hi = hi + (lo >> FRAC_BITS)  # carry; >> on int64 is arithmetic, as torch's
    lo = lo & LIMB_MASK
    a = hi.to(tl.float64)  # int64 -> binary64, round to nearest even
    r = hi - a.to(tl.int64)  # a is an integer below 2^63 (limb sums < 2^62): exact
    t = r * LIMB_ONE + lo
    unit = tl.full([], LIMB_UNIT, tl.float64)
    return _two_sum(a * unit, t.to(tl.float64) * tl.full([], LIMB2_UNIT, tl.float64))


@triton.jit
def _frexp(x):
    """torch.frexp for a normal binary64 x: (m, k), x = m 2^k, |m| in [0.5, 1).

    The exponent field is set to 1022 by subtracting k << 52 from the bit pattern (no
    borrow reaches the sign). S is 0 or a multiple of 2^-84 below 2^22, never subnormal;
    S = 0 (no local pass produces it) gives NaN through sl / sh whatever m and k are.
    """
    bits = x.to(tl.int64, bitcast=True)
    k = ((bits >> 52) & 0x7FF) - 1022
    return (bits - (k << 52)).to(tl.float64, bitcast=True), k


@triton.jit
def _log_c(sh, sl):
    """contract.log_c: log(sh + sl) = k ln2 + 2 atanh(g / (2 + g)), in the same order."""
    m, k = _frexp(sh)
    small = m < tl.full([], SQRT_HALF, tl.float64)
    m = tl.where(small, m * 2.0, m)
    kd = tl.where(small, k - 1, k).to(tl.float64)
    g = m - 1.0  # exact (Sterbenz)
    s = g / (2.0 + g)  # fp64 `/` is IEEE div.rn.f64
    s2 = s + s
    z = s * s
    poly = tl.full([], L23, tl.float64)
    poly = poly * z + tl.full([], L21, tl.float64)  # Horner, no FMA
    poly = poly * z + tl.full([], L19, tl.float64)
    poly = poly * z + tl.full([], L17, tl.float64)
    poly = poly * z + tl.full([], L15, tl.float64)
    poly = poly * z + tl.full([], L13, tl.float64)
    poly = poly * z + tl.full([], L11, tl.float64)
    poly = poly * z + tl.full([], L9, tl.float64)
    poly = poly * z + tl.full([], L7, tl.float64)
    poly = poly * z + tl.full([], L5, tl.float64)
    poly = poly * z + tl.full([], L3, tl.float64)
    tail = kd * tl.full([], LN2_LO, tl.float64) + sl / sh
    return kd * tl.full([], LN2_HI, tl.float64) + (s2 + (s2 * (poly * z) + tail))


@triton.jit
def _bad_flags(rec, rows, live, row_max, target, ignored, bad_tau_ptr, disagree_ptr, vocab_size,
               HAS_VOCAB: tl.constexpr, HAS_BAD_TAU: tl.constexpr,
               HAS_DISAGREE: tl.constexpr):  # fmt: skip
    """contract.finalize's BAD_* flags of each row; 0 on ignored rows but BAD_RANKS."""
    out_of_range = target < 0
    if HAS_VOCAB:
        out_of_range = out_of_range | (target >= vocab_size)
    owners = tl.load(rec + COL_OWNERS, mask=live, other=0)
    masked = tl.load(rec + COL_TARGET_MASKED, mask=live, other=0)
    nonfinite = tl.load(rec + COL_NONFINITE, mask=live, other=0)
    bad = tl.where(out_of_range, BAD_TARGET_RANGE, 0).to(tl.int64)
    bad = bad | tl.where(~out_of_range & (owners != 1), BAD_TARGET_OWNER, 0)
    bad = bad | tl.where(masked != 0, BAD_TARGET_MASKED, 0)
    bad = bad | tl.where(nonfinite != 0, BAD_NONFINITE, 0)
    bad = bad | tl.where(row_max == float("-inf"), BAD_NO_VALID_COLUMN, 0)
    if HAS_BAD_TAU:
        bad_tau = tl.load(bad_tau_ptr + rows, mask=live, other=0) != 0
        bad = bad | tl.where(bad_tau, BAD_TEMPERATURE, 0)
    bad = tl.where(ignored, 0, bad)
    if HAS_DISAGREE:
        disagree = tl.load(disagree_ptr + rows, mask=live, other=0) != 0
        bad = bad | tl.where(disagree, BAD_RANKS, 0)
    return bad


@triton.jit
def _store_output(out_ptr, rows, live, v, bad, ignored):
    """fl32(v) as bits; on ignored rows +0, then on bad rows the reference's NaN bits."""
    bits = v.to(tl.float32).to(tl.int32, bitcast=True)
    bits = tl.where(ignored, 0, bits)
    tl.store(out_ptr + rows, tl.where(bad != 0, NAN_F32, bits), mask=live)


@triton.jit
def finalize_kernel(
    max_ptr,  # [N] fp32 global row max
    rec_ptr,  # [N, NUM_COLS] int64 record summed over all ranks, row stride stride_rec
    target_ptr,  # [N] int64 global target ids
    bad_tau_ptr,  # [N] uint8 bad per-row temperature (unused unless HAS_BAD_TAU)
    disagree_ptr,  # [N] uint8 rows the ranks disagree on (unused unless HAS_DISAGREE)
    logprobs_ptr,  # [N] fp32, written as int32 bit patterns
    entropy_ptr,  # [N] fp32, same
    lse_ptr,  # [N] fp32, same
    s_hi_ptr,  # [N] fp64 fl(S)
    s_lo_ptr,  # [N] fp64 S - fl(S)
    log_s_ptr,  # [N] fp64
    ent64_ptr,  # [N] fp64 entropy before rounding
    bad_ptr,  # [N] int64 BAD_* flags
    ignored_ptr,  # [N] bool, written as uint8
    n_rows,
    stride_rec,
    vocab_size,  # unused unless HAS_VOCAB
    ignore_index,
    HAS_VOCAB: tl.constexpr,
    HAS_BAD_TAU: tl.constexpr,
    HAS_DISAGREE: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    live = rows < n_rows
    rec = rec_ptr + rows.to(tl.int64) * stride_rec
    row_max = tl.load(max_ptr + rows, mask=live, other=0.0)
    target = tl.load(target_ptr + rows, mask=live, other=0)
    ignored = target == ignore_index
    bad = _bad_flags(rec, rows, live, row_max, target, ignored, bad_tau_ptr, disagree_ptr,
                     vocab_size, HAS_VOCAB, HAS_BAD_TAU, HAS_DISAGREE)  # fmt: skip

    # Bad and ignored rows get S = 1 so that log_c stays in its domain, as in the contract.
    skip = (bad != 0) | ignored
    e_hi = tl.where(skip, LIMB_ONE, tl.load(rec + COL_E_HI, mask=live, other=0))
    e_lo = tl.where(skip, 0, tl.load(rec + COL_E_LO, mask=live, other=0))
    sh, sl = _limbs_to_double_double(e_hi, e_lo)
    log_s = _log_c(sh, sl)
    w_hi = tl.load(rec + COL_W_HI, mask=live, other=0)
    wh, _ = _limbs_to_double_double(w_hi, tl.load(rec + COL_W_LO, mask=live, other=0))

    m64 = row_max.to(tl.float64)
    t_bits = tl.load(rec + COL_TARGET_BITS, mask=live, other=0).to(tl.int32)  # low 32 bits
    y_t = t_bits.to(tl.float32, bitcast=True).to(tl.float64)
    entropy64 = log_s + wh / sh
    _store_output(logprobs_ptr, rows, live, (y_t - m64) - log_s, bad, ignored)
    _store_output(entropy_ptr, rows, live, entropy64, bad, ignored)
    _store_output(lse_ptr, rows, live, m64 + log_s, bad, ignored)
    tl.store(s_hi_ptr + rows, sh, mask=live)
    tl.store(s_lo_ptr + rows, sl, mask=live)
    tl.store(log_s_ptr + rows, log_s, mask=live)
    tl.store(ent64_ptr + rows, entropy64, mask=live)
    tl.store(bad_ptr + rows, bad, mask=live)
    tl.store(ignored_ptr + rows, ignored.to(tl.uint8), mask=live)


# --- backward: elementwise from the saved per-row statistics ---


@triton.jit
def _grad_bits(g, row_nan, OUT_KIND: tl.constexpr):
    """fp64 -> fp32 -> out dtype, each step round to nearest even, as int32 bit patterns
    (16-bit ones in the low half); NaN, and every column of a NaN row, as the reference's."""
    g32 = g.to(tl.float32)
    is_nan = (g32 != g32) | row_nan
    if OUT_KIND == OUT_F32:
        bits = tl.where(is_nan, NAN_F32, g32.to(tl.int32, bitcast=True))
    elif OUT_KIND == OUT_F16:
        h = g32.to(tl.float16).to(tl.int16, bitcast=True)
        bits = tl.where(is_nan, NAN_F16, h.to(tl.int32))
    else:
        u = g32.to(tl.uint32, bitcast=True)
        rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16  # round to nearest even, exact
        bits = tl.where(is_nan, NAN_BF16, rounded.to(tl.int32))
    return bits


@triton.jit
def _store_grad(out_ptr, offs, mask, g, row_nan, OUT_KIND: tl.constexpr):
    """_grad_bits written to the output (int32 or int16 bit patterns)."""
    bits = _grad_bits(g, row_nan, OUT_KIND)
    if OUT_KIND == OUT_F32:
        tl.store(out_ptr + offs, bits, mask=mask)
    else:
        tl.store(out_ptr + offs, bits.to(tl.int16), mask=mask)


@triton.jit
def _grad_columns(y, valid, m64, table_ptr, s_hi, s_lo, log_s, h, ca, cb, ct, cl,
                  WITH_ENTROPY: tl.constexpr):  # fmt: skip
    """(g, g_t): contract.grad_block of these columns before the division by tau, as
    columns that are not the target (+0 without a term) and as the target column; ca, cb,
    ct, cl are the row's coefficients a, b, c, l (contract.GradStats coef_*)."""
    dz, term = _terms(y, valid, m64)
    e = tl.where(term, _exp_c(dz, table_ptr), 0.0)
    p = e / s_hi  # fp64 `/` is IEEE div.rn.f64
    if WITH_ENTROPY:
        bq = cb * ((dz - log_s) + h)
        g = p * (ca - bq)
        g_t = p * (cl - bq)
    else:
        g = p * ca
        g_t = p * cl
    g = tl.where(term, g, 0.0)
    # the target column: c * (1 - p_t) + p_t * (l - b q_t), 1 - p_t from the exact S
    one_minus_p = ((s_hi - e) + s_lo) / s_hi
    return g, ct * one_minus_p + g_t


@triton.jit
def _grad_row_stats(row, max_ptr, s_hi_ptr, s_lo_ptr, log_s_ptr, ent_ptr, coef_a_ptr,
                    coef_b_ptr, coef_t_ptr, coef_l_ptr):  # fmt: skip
    """The row's statistics _grad_columns takes after y and valid."""
    return (
        tl.load(max_ptr + row).to(tl.float64), tl.load(s_hi_ptr + row), tl.load(s_lo_ptr + row),
        tl.load(log_s_ptr + row), tl.load(ent_ptr + row), tl.load(coef_a_ptr + row),
        tl.load(coef_b_ptr + row), tl.load(coef_t_ptr + row), tl.load(coef_l_ptr + row),
    )  # fmt: skip


@triton.jit
def grad_kernel(
    x_ptr,  # [N, V_local] logits, row stride stride_x (bf16 passed as int16)
    keep_ptr,  # [N, V_local] uint8 keep mask (unused unless HAS_KEEP)
    tau_ptr,  # [N] fp32 temperature for y, stride_tau 0 for a scalar
    tau64_ptr,  # [N] fp64 temperature the gradient is divided by, same stride
    target_ptr,  # [N] int64 global target ids
    table_ptr,  # [32] fp64 contract.EXP2_TABLE
    max_ptr,  # [N] fp32 global row max
    s_hi_ptr,  # [N] fp64 fl(S)
    s_lo_ptr,  # [N] fp64 S - fl(S)
    log_s_ptr,  # [N] fp64
    ent_ptr,  # [N] fp64 entropy before rounding
    coef_a_ptr,  # [N] fp64 g_lse - g_logprob
    coef_b_ptr,  # [N] fp64 g_entropy
    coef_t_ptr,  # [N] fp64 g_logprob
    coef_l_ptr,  # [N] fp64 g_lse
    row_nan_ptr,  # [N] uint8
    out_ptr,  # [N, V_local] contiguous, written as int32 / int16 bit patterns
    stride_x,  # between rows of a block
    stride_keep,
    stride_tau,
    rows_inner,  # rows per block (_row_ptr)
    stride_x_outer,  # between blocks of rows
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
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0)
    row64 = row.to(tl.int64)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    in_cols = cols < n_cols
    real = cols < n_real
    tau = tl.load(tau_ptr + row64 * stride_tau) if HAS_TAU else 1.0
    y, valid = _scaled(
        _row_ptr(x_ptr, row64, rows_inner, stride_x_outer, stride_x),
        _row_ptr(keep_ptr, row64, rows_inner, stride_keep_outer, stride_keep), cols, real, tau,
        IS_BF16, HAS_TAU, HAS_KEEP,
    )  # fmt: skip
    m64, s_hi, s_lo, log_s, h, ca, cb, ct, cl = _grad_row_stats(
        row, max_ptr, s_hi_ptr, s_lo_ptr, log_s_ptr, ent_ptr, coef_a_ptr, coef_b_ptr,
        coef_t_ptr, coef_l_ptr,
    )  # fmt: skip
    g, _ = _grad_columns(y, valid, m64, table_ptr, s_hi, s_lo, log_s, h, ca, cb, ct, cl,
                         WITH_ENTROPY)  # fmt: skip
    # the target column's own formula, on its y alone: its IEEE division by s_hi runs once
    # per program, not once per column (the columns' g_t is never computed)
    owner, t_col = _owned_column(target_ptr, row, vocab_start, n_real, ignore_index)
    y_t, valid_t = _scaled(
        _row_ptr(x_ptr, row64, rows_inner, stride_x_outer, stride_x),
        _row_ptr(keep_ptr, row64, rows_inner, stride_keep_outer, stride_keep), t_col, owner,
        tau, IS_BF16, HAS_TAU, HAS_KEEP,
    )  # fmt: skip
    _, g_t = _grad_columns(y_t, valid_t, m64, table_ptr, s_hi, s_lo, log_s, h, ca, cb, ct, cl,
                           WITH_ENTROPY)  # fmt: skip
    g = tl.where(owner & (cols == t_col), g_t, g)
    if HAS_TAU:
        g = g / tl.load(tau64_ptr + row64 * stride_tau)
    row_nan = tl.load(row_nan_ptr + row) != 0
    _store_grad(out_ptr + row64 * n_cols, cols, in_cols, g, row_nan, OUT_KIND)
