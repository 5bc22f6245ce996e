"""The exact integer GEMM of contract exactlogp-linear-v1 (L3) in Triton, on int8 slices.

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
