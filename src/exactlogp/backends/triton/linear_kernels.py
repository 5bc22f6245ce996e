"""The exact integer GEMM of contracts exactlogp-linear-v1 and -v2 (L3) in Triton, on int8 slices.

Every operand of L3 is an integer with |x| <= 2^20. Written in balanced base 128,
x = x2 2^14 + x1 2^7 + x0 with x0, x1 in [-64, 63] and x2 in [-64, 64], each slice fits an
int8, and

    Z = sum_k a_k c_k = sum_{s=0..4} 2^(7 s) sum_{i+j=s} sum_k a_{i,k} c_{j,k}

The nine slice products are int8 x int8 dot products with int32 accumulation -- exact by
specification on int8 tensor cores (and in Triton's interpreter): each product is at most
2^12 in magnitude and at most three of them share an accumulator, so any K below 2^17
stays below 2^31. The five diagonal sums are combined in int64 at the end of the K loop.
Any tile shape, any order: the same integers as the reference's int64 arithmetic.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ... import linear_contract
from ...linear_contract import int8_slices

BLOCK_M, BLOCK_N, BLOCK_K = 64, 64, 64
MAX_K = 1 << 17  # three products of at most 2^12 per k stay below 2^31 in int32


@triton.jit
def exact_dot_kernel(
    a0_ptr,  # [M, K] int8 slices of A, lowest first, each contiguous
    a1_ptr,
    a2_ptr,
    c0_ptr,  # [P, K] int8 slices of C
    c1_ptr,
    c2_ptr,
    z_ptr,  # [M, P] int64 out
    M,  # sizes are never converted here: Triton passes a size of 1 as a constant
    P,
    K,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m64, n64 = rm.to(tl.int64), rn.to(tl.int64)
    acc0 = tl.zeros([BLOCK_M, BLOCK_N], tl.int32)
    acc1 = tl.zeros([BLOCK_M, BLOCK_N], tl.int32)
    acc2 = tl.zeros([BLOCK_M, BLOCK_N], tl.int32)
    acc3 = tl.zeros([BLOCK_M, BLOCK_N], tl.int32)
    acc4 = tl.zeros([BLOCK_M, BLOCK_N], tl.int32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        a_mask = (rm[:, None] < M) & (kk[None, :] < K)
        c_mask = (kk[:, None] < K) & (rn[None, :] < P)
        a_off = m64[:, None] * K + kk[None, :]
        c_off = n64[None, :] * K + kk[:, None]  # C^T tile: [BLOCK_K, BLOCK_N]
        a0 = tl.load(a0_ptr + a_off, mask=a_mask, other=0)
        a1 = tl.load(a1_ptr + a_off, mask=a_mask, other=0)
        a2 = tl.load(a2_ptr + a_off, mask=a_mask, other=0)
        c0 = tl.load(c0_ptr + c_off, mask=c_mask, other=0)
        c1 = tl.load(c1_ptr + c_off, mask=c_mask, other=0)
        c2 = tl.load(c2_ptr + c_off, mask=c_mask, other=0)
        acc0 += tl.dot(a0, c0, out_dtype=tl.int32)
        acc1 += tl.dot(a0, c1, out_dtype=tl.int32) + tl.dot(a1, c0, out_dtype=tl.int32)
        acc2 += (tl.dot(a0, c2, out_dtype=tl.int32) + tl.dot(a1, c1, out_dtype=tl.int32)
                 + tl.dot(a2, c0, out_dtype=tl.int32))  # fmt: skip
        acc3 += tl.dot(a1, c2, out_dtype=tl.int32) + tl.dot(a2, c1, out_dtype=tl.int32)
        acc4 += tl.dot(a2, c2, out_dtype=tl.int32)
    z = acc4.to(tl.int64)
    z = z * 128 + acc3.to(tl.int64)  # Horner in 2^7: exact in int64 (|Z| <= K 2^40)
    z = z * 128 + acc2.to(tl.int64)
    z = z * 128 + acc1.to(tl.int64)
    z = z * 128 + acc0.to(tl.int64)
    mask = (rm[:, None] < M) & (rn[None, :] < P)
    tl.store(z_ptr + m64[:, None] * P + n64[None, :], z, mask=mask)


def exact_dot(a: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """(M, P) int64 = a @ c^T exactly, for integer-valued a (M, K), c (P, K), |.| <= 2^20."""
    m, k = a.shape
    p = c.shape[0]
    out = torch.empty(m, p, dtype=torch.int64, device=a.device)
    if m == 0 or p == 0:
        return out
    if k > MAX_K:  # split K: each part is exact, int64 adds them
        return sum(exact_dot(a[:, i : i + MAX_K], c[:, i : i + MAX_K]) for i in range(0, k, MAX_K))
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(p, BLOCK_N))
    exact_dot_kernel[grid](
        *int8_slices(a), *int8_slices(c), out, m, p, k,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
    )  # fmt: skip
    return out


def diagonal_dot(a: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """(M, P) int64 = a @ c^T exactly, as linear_contract.diagonal_exact_dot: five int8
    GEMMs with int32 accumulation through torch._int_mm (cuBLASLt on a GPU)."""
    a3 = linear_contract.diagonal_layout(a, reverse=True)
    c3 = linear_contract.diagonal_layout(c, reverse=False)
    return linear_contract.diagonal_exact_dot(a3, c3, _int_mm)


def _int_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """torch._int_mm(a (M, K), b (K, N)) -> int32, zero-padded where CUDA's cuBLASLt route
    needs it (M > 16, K and N multiples of 8): zero rows and columns add nothing."""
    if a.device.type != "cuda":
        return torch._int_mm(a, b)
    m, k = a.shape
    n = b.shape[1]
    pm, pk, pn = max(17, m), -(-k // 8) * 8, -(-n // 8) * 8
    if (pm, pk, pn) != (m, k, n):
        a = torch.nn.functional.pad(a, (0, pk - k, 0, pm - m))
        b = torch.nn.functional.pad(b, (0, pn - n, 0, pk - k))
    return torch._int_mm(a, b)[:m, :n]


# --- the fused route: L2 in one pass, L3-L5 in one kernel (exact_gemm="int8_fused") ---
#
# head_slices quantises and slices a block of rows in one pass (fp32/bf16/fp16 in, int8
# out: no int64 or fp64 tensor in memory); head_logits runs the five diagonal GEMMs of
# linear_contract's diagonal layout on tl.dot, one int32 accumulator live at a time,
# combines them into the exact integer Z in registers and applies L4-L5 there, writing
# only fp32 logits. The same integers and the same roundings as linear_contract, so the
# same bits; docs/numerics.md section 12 has the proof of the diagonals.

QBITS: tl.constexpr = tl.constexpr(linear_contract.QBITS)
MAGIC: tl.constexpr = tl.constexpr(linear_contract.contract.MAGIC)
SLICE_BLOCK_R, SLICE_BLOCK_K = 16, 256


class HeadTile(NamedTuple):
    """head_logits_kernel's launch: any tile gives the same integers, so the same bits."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int

    @property
    def name(self) -> str:
        return f"{self.block_m}x{self.block_n}x{self.block_k}/w{self.num_warps}s{self.num_stages}"


# candidates for the GPU check to time (gpucheck/linear.py); HEAD_TILE is the one used
HEAD_TILES = (
    HeadTile(64, 64, 64, 4, 3),
    HeadTile(64, 64, 128, 4, 3),
    HeadTile(128, 64, 64, 8, 3),
    HeadTile(128, 128, 64, 8, 3),
    HeadTile(128, 128, 128, 8, 3),
    HeadTile(16, 128, 128, 4, 3),  # a decode step: 16-row tiles (mma.sync, not wgmma)
)
HEAD_TILE = HEAD_TILES[0]
# products of two slices are at most 2^12: an int32 accumulator takes 2^18 of them
# (2^30 < 2^31) before it is folded into the diagonal's int64 sum
FOLD_K = 1 << 18
DIAGONAL_WIDTHS = (1, 2, 3, 2, 1)  # K' / K of diagonal s


@triton.jit
def head_slices_kernel(
    x_ptr,  # [R, K] bf16/fp16/fp32 rows, unit column stride
    e_ptr,  # [R] int64: L1's exponent of each row
    finite_ptr,  # [R] uint8: 1 where the row is finite
    out_ptr,  # [R, 3K] int8 out: the diagonal layout
    R,
    K,
    stride_x,
    REVERSE: tl.constexpr,  # [x2 | x1 | x0] (hidden states) instead of [x0 | x1 | x2]
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rr = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rk = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    r64 = rr.to(tl.int64)
    row_ok = rr < R
    mask = row_ok[:, None] & (rk[None, :] < K)
    x = tl.load(x_ptr + r64[:, None] * stride_x + rk[None, :], mask=mask, other=0.0)
    e = tl.load(e_ptr + rr, mask=row_ok, other=0)
    finite = tl.load(finite_ptr + rr, mask=row_ok, other=0) != 0
    # 2^(QBITS - e) from its bits: QBITS - e is in [-109, 168] for these dtypes, a normal
    scale = ((-e + (QBITS + 1023)) << 52).to(tl.float64, bitcast=True)
    magic = tl.full([], MAGIC, tl.float64)
    t = x.to(tl.float64) * scale[:, None]  # exact: a power of two, |t| <= 2^QBITS
    q = (t + magic) - magic  # rint_even(t), as contract.MAGIC promises for |t| < 2^51
    v = tl.where(finite[:, None], q, 0.0).to(tl.int64)
    out = out_ptr + r64[:, None] * (3 * K) + rk[None, :]
    for s in tl.static_range(3):  # balanced base 128, lowest slice first
        if s < 2:
            low = ((v + 64) & 127) - 64  # in [-64, 63]
            v = (v - low) >> 7  # exact: v - low is a multiple of 128
        else:
            low = v  # in [-64, 64]
        col = (2 - s) * K if REVERSE else s * K
        tl.store(out + col, low.to(tl.int8), mask=mask)


def head_slices(x: torch.Tensor, e: torch.Tensor, finite: torch.Tensor, reverse: bool):
    """(R, 3K) int8 = linear_contract.diagonal_layout(quantize(x, e, finite), reverse) in one
    pass over x (R, K) bf16/fp16/fp32."""
    r, k = x.shape
    x = x if k == 0 or x.stride(-1) == 1 else x.contiguous()
    out = torch.empty(r, 3 * k, dtype=torch.int8, device=x.device)
    if r == 0 or k == 0:
        return out
    grid = (triton.cdiv(r, SLICE_BLOCK_R), triton.cdiv(k, SLICE_BLOCK_K))
    head_slices_kernel[grid](
        x, e.contiguous(), finite.to(torch.uint8), out, r, k, x.stride(0),
        REVERSE=reverse, BLOCK_R=SLICE_BLOCK_R, BLOCK_K=SLICE_BLOCK_K, enable_fp_fusion=False,
    )  # fmt: skip
    return out


@triton.jit
def _diagonal(z, a_ptr, c_ptr, rm, rn, M, P, K, LO_A: tl.constexpr, LO_C: tl.constexpr,
              WIDTH: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr, FOLD: tl.constexpr):  # fmt: skip
    """z 2^7 + sum over k < WIDTH K of A[m, LO_A K + k] C[n, LO_C K + k], in int64: one
    int8 GEMM of the diagonal's windows, its int32 accumulation added into z every FOLD
    columns (one int64 tile live, not two: the same integer)."""
    m64, n64 = rm.to(tl.int64), rn.to(tl.int64)
    rk = tl.arange(0, BLOCK_K)
    width = WIDTH * K
    a_row = a_ptr + m64[:, None] * (3 * K) + LO_A * K
    c_row = c_ptr + n64[None, :] * (3 * K) + LO_C * K  # C^T tile: [BLOCK_K, BLOCK_N]
    z = z * 128  # Horner in 2^7: exact in int64 (|Z| <= K 2^40)
    for f0 in range(0, width, FOLD):
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.int32)
        for k0 in range(f0, tl.minimum(f0 + FOLD, width), BLOCK_K):
            kk = k0 + rk
            a_mask = (rm[:, None] < M) & (kk[None, :] < width)
            c_mask = (kk[:, None] < width) & (rn[None, :] < P)
            a = tl.load(a_row + kk[None, :], mask=a_mask, other=0)
            c = tl.load(c_row + kk[:, None], mask=c_mask, other=0)
            acc += tl.dot(a, c, out_dtype=tl.int32)
        z += acc.to(tl.int64)
    return z


@triton.jit
def head_logits_kernel(
    a_ptr,  # [M, 3K] int8: the hidden rows' diagonal layout, reversed
    c_ptr,  # [P, 3K] int8: the weight rows' diagonal layout
    row_scale_ptr,  # [M] fp64: 2^(e_n - 2 QBITS), NaN for a non-finite row
    col_scale_ptr,  # [P] fp64: 2^f_v, NaN for a non-finite weight row
    bias_ptr,  # [P] any float (unused without HAS_BIAS)
    out_ptr,  # [M, P] fp32 out, row stride stride_out
    tau_ptr,  # [M] fp32 temperature, stride_tau 0 for a scalar (unused unless HAS_TAU)
    max_ptr,  # [M, num_programs(1)] fp32 out: the tiles' maxima of y (unused unless WRITE_MAX)
    M,
    P,
    K,
    stride_out,
    stride_tau,
    n_real,  # columns below the padding: the max leaves the others out
    logit_scale,  # fp32, already rounded
    HAS_BIAS: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    WRITE_MAX: tl.constexpr,
    HAS_TAU: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    FOLD: tl.constexpr,
):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    # --- L3: Z = sum_s 2^(7 s) D_s, Horner from the top diagonal (exact in int64) ---
    z = tl.zeros([BLOCK_M, BLOCK_N], tl.int64)
    z = _diagonal(z, a_ptr, c_ptr, rm, rn, M, P, K, 0, 2, 1, BLOCK_M, BLOCK_N, BLOCK_K, FOLD)
    z = _diagonal(z, a_ptr, c_ptr, rm, rn, M, P, K, 0, 1, 2, BLOCK_M, BLOCK_N, BLOCK_K, FOLD)
    z = _diagonal(z, a_ptr, c_ptr, rm, rn, M, P, K, 0, 0, 3, BLOCK_M, BLOCK_N, BLOCK_K, FOLD)
    z = _diagonal(z, a_ptr, c_ptr, rm, rn, M, P, K, 1, 0, 2, BLOCK_M, BLOCK_N, BLOCK_K, FOLD)
    z = _diagonal(z, a_ptr, c_ptr, rm, rn, M, P, K, 2, 0, 1, BLOCK_M, BLOCK_N, BLOCK_K, FOLD)
    # --- L4: round Z to 53 bits to odd (linear_contract.odd53), scale, round to fp32 ---
    near = z.to(tl.float64)  # round to nearest; |Z| <= 2^62
    tail = z - near.to(tl.int64)  # exact: the rounding error, |tail| <= 2^9
    bits = near.to(tl.int64, bitcast=True)
    toward = tl.where((tail > 0) == (near > 0), 1, -1)  # one step of the last bit to Z
    stepped = (bits + toward).to(tl.float64, bitcast=True)
    odd = tl.where((tail != 0) & ((bits & 1) == 0), stepped, near)
    row_ok, col_ok = rm < M, rn < P
    row_scale = tl.load(row_scale_ptr + rm, mask=row_ok, other=1.0)
    col_scale = tl.load(col_scale_ptr + rn, mask=col_ok, other=1.0)
    out = ((odd * row_scale[:, None]) * col_scale[None, :]).to(tl.float32)  # exact scalings
    # --- L5: bias, then logit_scale, each one fp32 rounding ---
    if HAS_BIAS:
        out = out + tl.load(bias_ptr + rn, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if HAS_SCALE:
        out = out * logit_scale
    offs = rm.to(tl.int64)[:, None] * stride_out + rn.to(tl.int64)[None, :]
    tl.store(out_ptr + offs, out, mask=row_ok[:, None] & col_ok[None, :])
    # --- the softmax's max pass on this tile: kernels.row_max_kernel's arithmetic ---
    if WRITE_MAX:
        y = out
        if HAS_TAU:
            tau = tl.load(tau_ptr + rm.to(tl.int64) * stride_tau, mask=row_ok, other=1.0)
            y = tl.math.div_rn(y, tau[:, None])  # IEEE fp32 division, round to nearest even
        ok = (rn < n_real)[None, :] & (y == y) & (y != float("inf"))  # NaN, +inf not maxed
        top = tl.max(tl.where(ok, y, float("-inf")), axis=1)
        slot = rm.to(tl.int64) * tl.num_programs(1) + tl.program_id(1)
        tl.store(max_ptr + slot, top, mask=row_ok)


def head_logits(a3, row_scale, c3, col_scale, bias, logit_scale: float, out=None,
                tile: HeadTile | None = None, max_of=None):  # fmt: skip
    """(M, P) fp32 = linear_contract.logits_block of the rows whose diagonal layouts are
    a3 (M, 3K, reversed) and c3 (P, 3K), written into `out` (unit column stride) if given;
    on `tile` (HEAD_TILE by default).

    max_of: None, or (temperature, n_real) -- then returns (logits, (M,) fp32 row max):
    Backend.row_max of these logits (the max of y = logits / tau over the first n_real
    columns, NaN and +inf left out, -inf if none), from the tiles' maxima the epilogue
    writes: the softmax's max pass need not read the logits again."""
    tile = tile or HEAD_TILE
    assert FOLD_K % tile.block_k == 0, "a fold must end at a K-block's end"
    m, p = a3.shape[0], c3.shape[0]
    k = a3.shape[1] // 3
    dev = a3.device
    out = torch.empty(m, p, dtype=torch.float32, device=dev) if out is None else out
    if m == 0 or p == 0:
        if max_of is None:
            return out
        return out, torch.full((m,), float("-inf"), dtype=torch.float32, device=dev)
    grid = (triton.cdiv(m, tile.block_m), triton.cdiv(p, tile.block_n))
    tau, stride_tau, has_tau, n_real, maxima = out, 0, False, p, out  # stand-ins
    if max_of is not None:
        temperature, n_real = max_of
        if temperature.per_row:
            tau, stride_tau, has_tau = temperature.rows.to(dev).contiguous(), 1, True
        elif not temperature.is_one:  # torch.full: the host does not wait on the device
            tau = torch.full((1,), temperature.scalar, dtype=torch.float32, device=dev)
            has_tau = True
        maxima = torch.empty(m, grid[1], dtype=torch.float32, device=dev)
    head_logits_kernel[grid](
        a3, c3, row_scale.contiguous(), col_scale.contiguous(),
        c3 if bias is None else bias.contiguous(), out, tau, maxima, m, p, k, out.stride(0),
        stride_tau, n_real, logit_scale, HAS_BIAS=bias is not None,
        HAS_SCALE=logit_scale != 1.0, WRITE_MAX=max_of is not None, HAS_TAU=has_tau,
        BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, FOLD=FOLD_K,
        num_warps=tile.num_warps, num_stages=tile.num_stages, enable_fp_fusion=False,
    )  # fmt: skip
    if max_of is None:
        return out
    return out, (maxima[:, 0] if grid[1] == 1 else maxima.amax(dim=1))
