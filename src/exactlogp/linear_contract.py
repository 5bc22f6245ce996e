"""Contract exactlogp-linear-v1: LM-head logits from hidden states and weights, exactly.

The logits z = h W^T (+ bias) (* logit_scale) are a function of the values alone: not of
the batch, the rows batched together, the vocab shard, the tiling, the thread count or
the backend. Every dot product is computed exactly, in integers, and rounded once:

  L1. e_n = the exponent of max_k |h[n, k]| (2^(e_n - 1) <= max < 2^e_n; 0 for a zero row);
      f_v likewise for each weight row W[v, :]
  L2. A[n, k] = rint_even(h[n, k] 2^(QBITS - e_n)),  C[v, k] = rint_even(W[v, k] 2^(QBITS - f_v))
      integers, |A|, |C| <= 2^QBITS
  L3. Z[n, v] = sum_k A[n, k] C[v, k]: an exact integer -- any order, tiling or device
  L4. z[n, v] = fl32(Z 2^(e_n + f_v - 2 QBITS)): correctly rounded (ties to even)
  L5. with a bias: z = fl32(z + fp32(b[v])); with logit_scale != 1: z = fl32(z * fp32(s))
  A row of h (or of W) holding NaN or inf gives NaN logits in that row (column).

The softmax contract (exactlogp.contract) then takes y = z / temperature. Backward uses the
same integers (section "backward" below): the weight and bias gradients are exact integer
sums over the rows, the hidden gradient an exact integer sum over the vocabulary (and so
over the TP ranks, through one int64 all_reduce), each rounded once. docs/numerics.md
section 12 pins all of it.
"""

from __future__ import annotations

import torch

from . import contract

LOGITS_CONTRACT = "exactlogp-linear-v1"

QBITS = 20  # bits of each quantized operand: |A|, |C| <= 2^20
# fp64 holds every integer up to 2^53 exactly; a product is <= 2^(2 QBITS) = 2^40, so any
# sum of up to 2^13 of them -- in any order, with or without FMA -- is exact: a float GEMM
# over K-chunks of this length computes L3 exactly.
K_CHUNK = 1 << (53 - 2 * QBITS)
MAX_HIDDEN = 1 << 22  # keeps |Z| <= H 2^40 below 2^62


# --- L1-L2. scales and integers ---


def row_exponents(x: torch.Tensor, live: torch.Tensor | None = None):
    """(e (R,) int64, finite (R,) bool) of each row of x (R, K): 2^(e-1) <= max|x| < 2^e.

    `live` (R,) restricts a column-wise use to some rows; see column_exponents."""
    if x.shape[-1] == 0:
        zeros = torch.zeros(x.shape[:-1], dtype=torch.int64, device=x.device)
        return zeros, torch.ones_like(zeros, dtype=torch.bool)
    m = x.abs().amax(-1).to(torch.float64)
    finite = torch.isfinite(m)
    _, e = torch.frexp(torch.where(finite, m, 0.0))
    return e.to(torch.int64), finite


def column_exponents(x: torch.Tensor, live: torch.Tensor):
    """(e (K,), finite (K,)) of each column of x (R, K) over the rows where live (R,)."""
    return row_exponents(torch.where(live.unsqueeze(-1), x, 0.0).transpose(0, 1))


def quantize(x: torch.Tensor, exps: torch.Tensor, finite: torch.Tensor, dim: int = -1):
    """rint_even(x 2^(QBITS - e)) as integer-valued fp64, e (and finite) along `dim`'s
    other axis: per row for dim=-1, per column for dim=0. Non-finite rows are 0 (the NaN
    scales of unit_scales mark their outputs)."""
    scale = contract.pow2(QBITS - exps)
    if dim == -1:
        scale, finite = scale.unsqueeze(-1), finite.unsqueeze(-1)
    q = torch.round(x.to(torch.float64) * scale)  # exact product; ties to even; <= 2^20
    return torch.where(finite, q, 0.0)


def unit_scales(exps: torch.Tensor, finite: torch.Tensor) -> torch.Tensor:
    """2^exps as fp64, NaN where not finite."""
    return torch.where(finite, contract.pow2(exps), float("nan"))


# --- L3. the exact integer dot products ---


def exact_dot(a: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """Z = a @ c^T in int64, exactly: a (M, K), c (P, K) integer-valued, |.| <= 2^QBITS.
    The reference: plain int64 arithmetic (backends compute the same integers faster)."""
    return a.to(torch.int64) @ c.to(torch.int64).transpose(0, 1)


def float_exact_dot(a: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """exact_dot through fp64 GEMMs over K-chunks of K_CHUNK: each chunk's every partial
    sum is an integer of at most 2^53, so the GEMM's order, blocking and FMA cannot change
    it. One chunk's result is returned as it is (integer-valued fp64, exact); several are
    added in int64."""
    a, c = a.to(torch.float64), c.to(torch.float64)
    if a.shape[-1] <= K_CHUNK:
        # + 0.0: an exact zero sum is +0 (exact_dot's integer 0), never the -0 an fp64
        # GEMM gives for a single -0 product (H = 1, or all other terms 0); exact otherwise
        return (a @ c.transpose(0, 1)).add_(0.0)
    out = None
    for k0 in range(0, a.shape[-1], K_CHUNK):
        part = (a[:, k0 : k0 + K_CHUNK] @ c[:, k0 : k0 + K_CHUNK].transpose(0, 1)).to(torch.int64)
        out = part if out is None else out + part
    return out


# --- L3 on int8 tensor cores: five diagonal GEMMs with int32 accumulation ---
#
# Every operand is an integer with |x| <= 2^20: in balanced base 128 it is three int8
# slices, x = x2 2^14 + x1 2^7 + x0 (x0, x1 in [-64, 63], x2 in [-64, 64]), so
#
#     Z = sum_k a_k c_k = sum_{s=0..4} 2^(7 s) D_s,   D_s = sum_{i+j=s} sum_k a_{i,k} c_{j,k}
#
# Each diagonal D_s is one int8 GEMM over the concatenation of its slice pairs along K
# (K' = K, 2K, 3K, 2K, K): with the hidden slices laid out reversed, [a2 | a1 | a0], and the
# weight's in order, [c0 | c1 | c2], diagonal s is the GEMM of the column windows
# A[:, (2 - min(s, 2)) K : (3 - max(s - 2, 0)) K] and C[:, max(s - 2, 0) K : (min(s, 2) + 1) K].
# Every product of two slices is at most 2^12 in magnitude, so an int32 accumulator of
# K' <= 3K products is exact in any order while 3K 2^12 < 2^31, i.e. K < 174763: K is
# split into chunks of DIAGONAL_MAX_K and the chunks' Z are added in int64.
DIAGONAL_MAX_K = 1 << 17


def int8_slices(x: torch.Tensor) -> torch.Tensor:
    """(3, R, K) int8 balanced base-128 slices of integer-valued x (R, K), |x| <= 2^20."""
    v = x.to(torch.int64)
    out = []
    for _ in range(2):
        low = ((v + 64) & 127) - 64  # in [-64, 63]
        out.append(low)
        v = (v - low) >> 7  # exact: v - low is a multiple of 128
    out.append(v)  # in [-64, 64]
    return torch.stack(out).to(torch.int8).contiguous()


def diagonal_layout(x: torch.Tensor, reverse: bool) -> torch.Tensor:
    """(R, 3K) int8: x's slices side by side along K, [x0 | x1 | x2] (the weight's layout)
    or reversed, [x2 | x1 | x0] (the hidden states')."""
    s = int8_slices(x)
    return torch.cat(list(s.flip(0) if reverse else s), dim=-1)


def diagonal_exact_dot(a3: torch.Tensor, c3: torch.Tensor, int_mm=None) -> torch.Tensor:
    """(M, P) int64 = exact_dot(a, c) from a3 = diagonal_layout(a, reverse=True) and
    c3 = diagonal_layout(c, reverse=False), as five int8 GEMMs with int32 accumulation
    (`int_mm`, default torch._int_mm: cuBLASLt on CUDA, a CPU kernel here), K chunked."""
    int_mm = int_mm or torch._int_mm
    k = a3.shape[-1] // 3
    if k > DIAGONAL_MAX_K:
        parts = [slice(i, min(i + DIAGONAL_MAX_K, k)) for i in range(0, k, DIAGONAL_MAX_K)]
        return sum(diagonal_exact_dot(_k_part(a3, k, p), _k_part(c3, k, p), int_mm) for p in parts)
    z = None
    for s in range(5):
        lo_a, hi_a = (2 - min(s, 2)) * k, (3 - max(s - 2, 0)) * k
        lo_c, hi_c = max(s - 2, 0) * k, (min(s, 2) + 1) * k
        d = int_mm(a3[:, lo_a:hi_a].contiguous(), c3[:, lo_c:hi_c].t().contiguous())
        d = d.to(torch.int64) << (7 * s)  # |D_s| 2^(7 s) <= 3 K 2^40: far inside int64
        z = d if z is None else z.add_(d)
    return z


def _k_part(x3: torch.Tensor, k: int, part: slice) -> torch.Tensor:
    """The columns of K-chunk `part` of each of the three slices of a diagonal layout."""
    return torch.cat([x3[:, i * k + part.start : i * k + part.stop] for i in range(3)], dim=-1)


# --- L4. one rounding of an exact integer times a power of two ---


def odd53(hi: torch.Tensor, lo: torch.Tensor | None = None, lo_bits: int = 0) -> torch.Tensor:
    """hi 2^lo_bits + lo rounded to 53 bits *to odd*, as fp64: the exact value when it fits,
    else the neighbour whose last bit is odd. Rounding that once more to fp32 (with any
    exact power-of-two scaling in between) is the correctly rounded fp32 of the exact
    value -- normal, subnormal or overflowing. hi: int64 with |hi| < 2^62, 0 <= lo <
    2^lo_bits <= 2^20 (lo None: 0); or an integer-valued fp64 tensor of at most 2^53
    (exact_dot of one K-chunk), returned as it is."""
    if hi.dtype == torch.float64 and lo is None:
        return hi
    a = hi.to(torch.float64)
    tail = (hi - a.to(torch.int64)) * (1 << lo_bits)  # exact, |.| <= 2^(9 + lo_bits)
    if lo is not None:
        tail = tail + lo
    s, err = contract.two_sum(a * float(1 << lo_bits), tail.to(torch.float64))
    bits = s.view(torch.int64)
    even_inexact = (err != 0) & ((bits & 1) == 0)
    toward = torch.where((err > 0) == (s > 0), 1, -1)  # one step of the last bit toward err
    return torch.where(even_inexact, (bits + toward).view(torch.float64), s)


def round_scaled(hi: torch.Tensor, exp: torch.Tensor, lo: torch.Tensor | None = None,
                 lo_bits: int = 0) -> torch.Tensor:  # fmt: skip
    """fl32((hi 2^lo_bits + lo) 2^exp), correctly rounded (see odd53)."""
    return (odd53(hi, lo, lo_bits) * contract.pow2(exp)).to(torch.float32)


# --- L4-L5. a block of logits ---


def logits_block(
    a: torch.Tensor,  # (R, H) integer-valued, from quantize
    row_scale: torch.Tensor,  # (R,) fp64: unit_scales(e - 2 QBITS, finite_h)
    c: torch.Tensor,  # (P, H) integer-valued
    col_scale: torch.Tensor,  # (P,) fp64: unit_scales(f, finite_w)
    bias: torch.Tensor | None,  # (P,) any float dtype
    logit_scale: float,  # already rounded to fp32
    dot=exact_dot,
    out: torch.Tensor | None = None,  # (R, P) fp32 to write into
) -> torch.Tensor:
    """(R, P) fp32 logits: L3-L5 for a block of rows and vocabulary rows. The power of two
    2^(e_n + f_v - 2 QBITS) is applied as two exact scalings (no fp64 overflow or
    underflow is possible on the way), and NaN scales mark the non-finite rows/columns."""
    z = odd53(dot(a, c))  # in place when the dot is already exact fp64
    z = z.mul_(row_scale.unsqueeze(-1)).mul_(col_scale.unsqueeze(0))  # exact scalings
    out = torch.empty(z.shape, dtype=torch.float32, device=z.device) if out is None else out
    out.copy_(z)  # the one rounding to fp32
    if bias is not None:
        out.add_(bias.to(torch.float32))
    if logit_scale != 1.0:
        out.mul_(torch.full((), logit_scale, dtype=torch.float32, device=out.device))
    return out


# --- backward: the gradients of z = h W^T + b, through the same integers ---
#
# With g = dL/dz (fp32) times logit_scale (an exact fp64 product):
#   dW[v, k] = sum_n g[n, v] h[n, k]   g quantized per column v (u_v over the live rows),
#                                      h per column k (eps_k over the live rows): one exact
#                                      integer sum over the rows, rounded once
#   db[v]    = sum_n g[n, v]           the same integers of g
#   dh[n, k] = sum_v g[n, v] W[v, k]   W is 2^(f_v - QBITS) C[v, k]; g 2^(f_v - QBITS) is
#                                      quantized per row n on a grid of 2^(G_n - 2 QBITS),
#                                      G_n from its max over the whole vocabulary (all
#                                      ranks), in two 20-bit slices; one exact integer sum
#                                      over the vocabulary, rounded once
# Live rows are those with a gradient; the others take no part in any scale and add 0.
# (The softmax contract gives them an exact +0 in every column, so g needs no masking; a
# NaN in g only ever reaches outputs that are NaN anyway.)


def grad_weight_block(g, a_col, eps, finite_eps, dot=exact_dot):
    """(dW block (P, H) fp32, db block (P,) fp32) from g (R, P) fp64 (logit_scale folded
    in; +0 on the rows without gradient) and a_col (R, H): h quantized per column (eps,
    finite_eps (H,)) over the live rows."""
    u, finite_u = row_exponents(g.transpose(0, 1))
    d = torch.round(g * contract.pow2(QBITS - u).unsqueeze(0))  # exact; |d| <= 2^20
    z = odd53(dot(d.transpose(0, 1), a_col.transpose(0, 1)))  # (P, H)
    dw = z.mul_(unit_scales(u - QBITS, finite_u).unsqueeze(-1))  # exact scalings, NaN marks
    dw = dw.mul_(unit_scales(eps - QBITS, finite_eps).unsqueeze(0)).to(torch.float32)
    db = d.sum(0) * unit_scales(u - QBITS, finite_u)  # exact: sums of <= 2^20-sized integers
    return dw, db.to(torch.float32)


def hidden_grad_terms(g: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
    """y = g 2^(f_v - QBITS) (R, P) fp64, exact: the hidden gradient's terms on C's
    integers (W = 2^(f_v - QBITS) C)."""
    return g * contract.pow2(f - QBITS).unsqueeze(0)


def hidden_grad_slices(y: torch.Tensor, big: torch.Tensor):
    """(D1, D2) integer-valued fp64 with rint_even(y 2^(2 QBITS - G)) = D1 2^QBITS + D2;
    0 <= D2 < 2^QBITS, |D1| <= 2^QBITS. `big` (R,) is G_n (|y| < 2^G_n)."""
    d = torch.round(y * contract.pow2(2 * QBITS - big).unsqueeze(-1))  # exact; <= 2^40
    d2 = torch.remainder(d, float(1 << QBITS))  # exact for integers, in [0, 2^20)
    return (d - d2) * 2.0**-QBITS, d2


def hidden_grad_round(z1: torch.Tensor, z2: torch.Tensor, big: torch.Tensor) -> torch.Tensor:
    """fl32((z1 2^QBITS + z2) 2^(G - 2 QBITS)) for the int64 sums z1, z2 (R, H)."""
    hi = z1 + (z2 >> QBITS)
    lo = z2 & ((1 << QBITS) - 1)
    return round_scaled(hi, (big - 2 * QBITS).unsqueeze(-1), lo, QBITS)
