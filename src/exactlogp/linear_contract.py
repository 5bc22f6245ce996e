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
    other axis: per row for dim=-1, per column for dim=0. Non-finite rows give 0."""
    scale = contract.pow2(QBITS - exps)
    if dim == -1:
        scale, finite = scale.unsqueeze(-1), finite.unsqueeze(-1)
    q = (x.to(torch.float64) * scale + contract.MAGIC) - contract.MAGIC  # exact, |.| <= 2^20
    return torch.where(finite, q, 0.0)


# --- L3. the exact integer dot products ---


def exact_dot(a: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """Z = a @ c^T in int64, exactly: a (M, K), c (P, K) integer-valued, |.| <= 2^QBITS.
    The reference: plain int64 arithmetic (backends compute the same integers faster)."""
    return a.to(torch.int64) @ c.to(torch.int64).transpose(0, 1)


def float_exact_dot(a: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """exact_dot through fp64 GEMMs over K-chunks of K_CHUNK: each chunk's every partial
    sum is an integer below 2^53, so the GEMM's order, blocking and FMA cannot change it;
    the chunks are added in int64."""
    a, c = a.to(torch.float64), c.to(torch.float64)
    out = None
    for k0 in range(0, max(a.shape[-1], 1), K_CHUNK):
        part = (a[:, k0 : k0 + K_CHUNK] @ c[:, k0 : k0 + K_CHUNK].transpose(0, 1)).to(torch.int64)
        out = part if out is None else out + part
    return out


# --- L4. one rounding of an exact integer times a power of two ---


def round_scaled(hi: torch.Tensor, exp: torch.Tensor, lo: torch.Tensor | None = None,
                 lo_bits: int = 0) -> torch.Tensor:  # fmt: skip
    """fl32((hi 2^lo_bits + lo) 2^exp), correctly rounded, for int64 hi (|hi| < 2^62) and
    0 <= lo < 2^lo_bits <= 2^20 (lo None: 0). The value is first rounded to 53 bits to odd
    (exact error by TwoSum; an inexact result gets an odd last bit), which makes the final
    rounding to fp32 -- normal, subnormal or overflowing -- the correct one."""
    a = hi.to(torch.float64)
    tail = (hi - a.to(torch.int64)) * (1 << lo_bits)  # exact, |.| <= 2^(9 + lo_bits)
    if lo is not None:
        tail = tail + lo
    s, err = contract.two_sum(a * float(1 << lo_bits), tail.to(torch.float64))
    bits = s.view(torch.int64)
    even_inexact = (err != 0) & ((bits & 1) == 0)
    toward = torch.where((err > 0) == (s > 0), 1, -1)  # one step of the last bit toward err
    s = torch.where(even_inexact, (bits + toward).view(torch.float64), s)
    return (s * contract.pow2(exp)).to(torch.float32)


# --- L4-L5. a block of logits ---


def logits_block(
    a: torch.Tensor,  # (R, H) integer-valued, from quantize
    e: torch.Tensor,  # (R,) int64
    finite_h: torch.Tensor,  # (R,) bool
    c: torch.Tensor,  # (P, H) integer-valued
    f: torch.Tensor,  # (P,) int64
    finite_w: torch.Tensor,  # (P,) bool
    bias: torch.Tensor | None,  # (P,) any float dtype
    logit_scale: float,  # already rounded to fp32
    dot=exact_dot,
) -> torch.Tensor:
    """(R, P) fp32 logits: L3-L5 for a block of rows and vocabulary rows."""
    z = round_scaled(dot(a, c), e.unsqueeze(-1) + f.unsqueeze(0) - 2 * QBITS)
    ok = finite_h.unsqueeze(-1) & finite_w.unsqueeze(0)
    z = torch.where(ok, z, torch.full((), float("nan"), device=z.device))
    if bias is not None:
        z = z + bias.to(torch.float32)
    if logit_scale != 1.0:
        z = z * torch.full((), logit_scale, dtype=torch.float32, device=z.device)
    return z


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


def grad_weight_block(g, live, a_col, eps, finite_eps, dot=exact_dot):
    """(dW block (P, H) fp32, db block (P,) fp32) from g (R, P) fp64 (logit_scale folded
    in) and a_col (R, H): h quantized per column (eps, finite_eps (H,)) over live rows."""
    u, finite_u = column_exponents(g, live)
    d = quantize(torch.where(live.unsqueeze(-1), g, 0.0), u, finite_u, dim=0)
    z = dot(d.transpose(0, 1), a_col.transpose(0, 1))  # (P, H)
    dw = round_scaled(z, u.unsqueeze(-1) + eps.unsqueeze(0) - 2 * QBITS)
    db = round_scaled(d.to(torch.int64).sum(0), u - QBITS)
    nan = torch.full((), float("nan"), device=dw.device)
    dw = torch.where(finite_u.unsqueeze(-1) & finite_eps.unsqueeze(0), dw, nan)
    return dw, torch.where(finite_u, db, nan)


def hidden_grad_scaled(g: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
    """y' = g 2^(f_v - QBITS) (R, P) fp64: the hidden gradient's terms on C's integers."""
    return g * contract.pow2(f - QBITS).unsqueeze(0)


def hidden_grad_slices(y: torch.Tensor, big: torch.Tensor, live: torch.Tensor):
    """(D1, D2) integer-valued fp64 with y 2^(2 QBITS - G) = D1 2^QBITS + D2, rounded to
    even; 0 <= D2 < 2^QBITS, |D1| <= 2^QBITS. `big` (R,) is G_n."""
    scale = contract.pow2(2 * QBITS - big).unsqueeze(-1)
    d = (torch.where(live.unsqueeze(-1), y, 0.0) * scale + contract.MAGIC) - contract.MAGIC
    d1 = torch.floor(d * 2.0**-QBITS)
    return d1, d - d1 * 2.0**QBITS


def hidden_grad_round(z1: torch.Tensor, z2: torch.Tensor, big: torch.Tensor) -> torch.Tensor:
    """fl32((z1 2^QBITS + z2) 2^(G - 2 QBITS)) for the int64 sums z1, z2 (R, H)."""
    hi = z1 + (z2 >> QBITS)
    lo = z2 & ((1 << QBITS) - 1)
    return round_scaled(hi, (big - 2 * QBITS).unsqueeze(-1), lo, QBITS)
