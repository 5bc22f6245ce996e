"""Contract exactlogp-linear-v2: LM-head logits from hidden states and weights, exactly.

The logits z = h W^T (+ bias) (* logit_scale) are a function of the values alone: not of
the batch, the rows batched together, the vocab shard, the tiling, the thread count or
the backend. Every dot product is the true real sum, rounded once:

  D.  z[n, v] = fl32(sum_k h[n, k] W[v, k])   correctly rounded (ties to even), for every
      finite bf16 / fp16 / fp32 input, subnormals included; an exact zero sum is +0
  L5. with a bias: z = fl32(z + fp32(b[v])); with logit_scale != 1: z = fl32(z * fp32(s))
  A row of h (or of W) holding NaN or inf gives NaN logits in that row (column).

D names no method; this is how every backend computes it:
  L1. e_n = the exponent of max_k |h[n, k]| (2^(e_n - 1) <= max < 2^e_n; 0 for a zero row);
      f_v likewise for each weight row W[v, :]
  L2. A[n, k] = rint_even(h[n, k] 2^(QBITS - e_n)),  C[v, k] = rint_even(W[v, k] 2^(QBITS - f_v))
      integers, |A|, |C| <= 2^QBITS; the residuals a' = h 2^(QBITS - e) - A and
      c' = W 2^(QBITS - f) - C are exact in binary64 (zero where the grid holds the element)
  L3. Z[n, v] = sum_k A[n, k] C[v, k]: an exact integer -- any order, tiling or device
  L4. where neither row has a residual, z = fl32(Z 2^(e_n + f_v - 2 QBITS)) is D itself;
      else the correction E = sum_k (h' c' + a' C) (h' = h 2^(QBITS - e)) is summed in
      binary64 -- exact where a certificate says so (bf16 / fp16 rows: nearly always),
      else with an error bound: where (Z + E) 2^(e_n + f_v - 2 QBITS) is provably inside
      one fp32 rounding interval its rounding is D; the rest (undecidable ties,
      cancellation, overflow: rare) are summed exactly (exact_round: integer limbs of every
      product). Outlier columns (massive activations) get the whole row's exponent and the
      rest of the row its own (block exponents along K), so they leave it on its grid.

The softmax contract (exactlogp.contract) then takes y = z / temperature. Backward uses
the integers of L2 (section "backward" below): the weight and bias gradients are exact
integer sums over the rows, the hidden gradient an exact integer sum over the vocabulary
(and so over the TP ranks, through one int64 all_reduce), each rounded once.
docs/numerics.md section 12 pins all of it.
"""

from __future__ import annotations

import warnings

import torch

from . import contract

LOGITS_CONTRACT = "exactlogp-linear-v2"  # v1: integrations/handshake.py says what changed

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
    return split(x, exps, finite, dim)[0]


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
    return round_odd(a * float(1 << lo_bits), tail.to(torch.float64))


def round_odd(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor | None = None) -> torch.Tensor:
    """a + b (+ c) (fp64) rounded to 53 bits to odd: fl(a + b) where it is exact, else the
    neighbour of the exact sum whose last bit is odd (TwoSum gives the exact error). c, if
    given, is below half an ulp of b (b's own rounding error), so that s + err + c stays
    within one ulp of s = fl(a + b)."""
    s, err = contract.two_sum(a, b)
    if c is not None:  # the sign of a binary64 sum is the sign of the exact one
        err = err.add_(c)
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
    return bias_and_scale(out, bias, logit_scale)


def bias_and_scale(out: torch.Tensor, bias, logit_scale: float) -> torch.Tensor:
    """L5 in place on fp32 logits (R, P)."""
    if bias is not None:
        out.add_(bias.to(torch.float32))
    if logit_scale != 1.0:
        out.mul_(torch.full((), logit_scale, dtype=torch.float32, device=out.device))
    return out


EPILOGUE = 1 << 17  # logits per step of the rounding (its temporaries stay in cache)


def logits_rows(rows, cols, col_scale, bias, logit_scale: float, dot=exact_dot, out=None):
    """(R, P) fp32 logits of contract v2 (D, then L5) for a block of hidden rows (HiddenRows)
    and weight rows (WeightRows; col_scale (P,) their unit_scales(f, finite)): L3's integers
    from `dot`, the correction where a residual takes part, the exact rounding where the
    correction's bound leaves a logit undecided."""
    z, z_out = rows.dot(cols.c, dot)
    e, bound = correction(rows, cols)
    r_all, p = z.shape
    out = torch.empty(r_all, p, dtype=torch.float32, device=z.device) if out is None else out
    step = max(1, EPILOGUE // max(p, 1))
    for r0 in range(0, r_all, step):
        r = slice(r0, r0 + step)
        pick = lambda t, r=r: None if t is None else t[r]  # noqa: E731
        val, undecided = round_corrected(pick(z), pick(e), pick(bound), rows.scale[r],
                                         col_scale, pick(z_out), pick(rows.shift))  # fmt: skip
        out[r].copy_(val)
        if undecided is not None:
            n, v = torch.nonzero(undecided, as_tuple=True)
            if n.numel():
                out[r][n, v] = exact_round(rows.values[r][n], cols.values[v])
    return bias_and_scale(out, bias, logit_scale)


# --- L4, contract v2: the residual correction, its bound, and the exact rounding ---
#
# With h' = h 2^(QBITS - e) = A + a' and W' = W 2^(QBITS - f) = C + c' (binary64, exact),
#     h W = 2^(e + f - 2 QBITS) (A C + h' c' + a' C)     summed over k,
# so the true dot product is 2^(e + f - 2 QBITS) (Z + E), E = sum_k (h' c' + a' C). Every
# product in E is exact in binary64 (at most 24 x 24 significant bits, exponents far inside
# its range); only E's additions round: whatever their order, blocking or FMA use, the sum
# of at most 2H terms errs by at most gamma (sum |terms|) <= gamma 2^QBITS (||a'||_1 +
# ||c'||_1), gamma = (2H + 2) 2^-52 (twice the classical (2H) u / (1 - 2H u), which also
# covers the binary64 rounding of the two norms). E is summed sparse where the residuals
# are (bf16 and fp16 rows hold few: only their elements below 2^(e - 12), resp. 2^(e - 9)).

SPARSE_BELOW = 1 / 4  # residuals with fewer nonzeros than this share are summed sparse
_MANTISSA32 = (1 << 29) - 1  # the 29 bits binary64 has beyond binary32's significand
_HALF32 = 1 << 28  # those bits at a binary32 midpoint


def split(x: torch.Tensor, exps: torch.Tensor, finite: torch.Tensor, dim: int = -1):
    """(q, scaled): scaled = x 2^(QBITS - e) as fp64 (exact), q = rint_even(scaled) -- L2's
    integers (quantize) -- with e along `dim`'s other axis as in quantize; both 0 on the
    non-finite rows (columns). scaled - q is the residual, exact."""
    scale = contract.pow2(QBITS - exps)
    if dim == -1:
        scale, finite = scale.unsqueeze(-1), finite.unsqueeze(-1)
    scaled = torch.where(finite, x.to(torch.float64) * scale, 0.0)  # exact product
    return torch.round(scaled), scaled  # ties to even; |q| <= 2^20


NO_GRAIN = 1 << 20  # the grain of a row with no element to take part


def grain(x: torch.Tensor, bits: int, dim: int = -1) -> torch.Tensor:
    """exponent(min over the nonzero |x| along `dim`) - bits (int64; NO_GRAIN where none):
    every element is a multiple of 2^grain when each holds at most `bits` significant bits
    (its input dtype's: a residual is a part of one)."""
    low = torch.where(x != 0, x.abs(), torch.inf).amin(dim)
    _, ex = torch.frexp(torch.where(torch.isinf(low), 0.0, low))
    return torch.where(torch.isinf(low), NO_GRAIN, ex.to(torch.int64) - bits)


def _residual(res: torch.Tensor, bits: int):
    """(the residual res (R, K) as the correction multiplies it -- dense, or sparse CSR
    where it is sparse -- or None where all are 0; its per-row L1 norm (fp64) and grain)."""
    l1 = torch.zeros(res.shape[0], dtype=torch.float64, device=res.device)
    none = torch.full_like(l1, NO_GRAIN, dtype=torch.int64)
    at = None
    if bits <= 16:  # bf16 / fp16: residuals are rare, their positions found in one pass
        at = torch.nonzero(res if res.is_contiguous() else res.t())
        nnz = at.shape[0]
    else:  # fp32: residuals nearly everywhere, only counted
        nnz = int(torch.count_nonzero(res))
    if nnz == 0:
        return None, l1, none
    if nnz >= SPARSE_BELOW * res.numel():  # dense (fp32 inputs): no certificate sought
        return res, res.abs().sum(-1), torch.full_like(l1, -NO_GRAIN, dtype=torch.int64)
    if at is None:
        at = torch.nonzero(res if res.is_contiguous() else res.t())
    if not res.is_contiguous():  # the transpose of a contiguous (K, R): sorted by row here
        at = at.flip(1)
        at = at[torch.argsort(at[:, 0] * res.shape[1] + at[:, 1])]
    row, col = at[:, 0], at[:, 1]
    vals = res[row, col]
    _, ex = torch.frexp(vals)
    l1.index_add_(0, row, vals.abs())
    fine = none
    fine = fine.scatter_reduce_(0, row, ex.to(torch.int64) - bits, "amin")
    crow = torch.zeros(res.shape[0] + 1, dtype=torch.int64, device=res.device)
    crow[1:] = torch.cumsum(torch.bincount(row, minlength=res.shape[0]), 0)
    with warnings.catch_warnings():  # torch calls CSR a beta; we use only CSR @ dense
        warnings.simplefilter("ignore", UserWarning)
        res = torch.sparse_csr_tensor(crow, col, vals, res.shape)
    return res, l1, fine


def significand_bits(dtype: torch.dtype) -> int:
    """Significant bits of an element of `dtype` (the hidden bit included)."""
    return {torch.bfloat16: 8, torch.float16: 11, torch.float32: 24}.get(dtype, 53)


class HiddenRows:
    """A block of hidden rows (R, H) for the logits, in units of 2^(e_n - QBITS) per row:

    a       (R, H) fp64: L2's integers A -- 0 in the outlier columns, if any
    a3      the fused head's (R, 3H) int8 layout of A, or None
    scale   (R,) fp64 2^(e_n - 2 QBITS); NaN marks a non-finite row
    values  the rows as given (exact_round reads them)
    scaled  h' = h 2^(QBITS - e_n) (R, H) fp64, exact; scaled_t its transpose, made once
    res     a' = h' - A - (outlier integers), (R, H) dense or sparse CSR; None where all 0
    l1, grain, res_grain, top   (R,): ||a'||_1, the grains of h' and a', a bound of |h'|
    out, a_out, shift   the outlier columns (block exponents along K), or None: their
            integers (R, len(out)) on the grid of the row's largest element, 2^shift
            times coarser than e_n's, so that one channel far above the rest does not
            push every other element of its row off the grid

    e_n is the exponent of the row's largest element outside the outlier columns, at most
    MAX_SHIFT below that of the whole row."""

    def __init__(self, a, a3, scale, values, scaled, res, l1, grain, res_grain, top,
                 out=None, a_out=None, shift=None):  # fmt: skip
        self.a, self.a3, self.scale, self.values, self.scaled = a, a3, scale, values, scaled
        self.res, self.l1, self.grain, self.res_grain, self.top = res, l1, grain, res_grain, top
        self.out, self.a_out, self.shift = out, a_out, shift
        self._scaled_t = None

    @property
    def scaled_t(self) -> torch.Tensor:
        if self._scaled_t is None:
            self._scaled_t = self.scaled.t().contiguous()
        return self._scaled_t

    def take(self, index: torch.Tensor) -> HiddenRows:
        """The same for the rows `index`."""
        res = self.res
        if res is not None:
            res = (res.to_dense() if res.layout == torch.sparse_csr else res)[index]
            res, _, _ = _residual(res, significand_bits(self.values.dtype))
        pick = lambda t: None if t is None else t[index]  # noqa: E731
        return HiddenRows(pick(self.a), pick(self.a3), self.scale[index], self.values[index],
                          self.scaled[index], res, self.l1[index], self.grain[index],
                          self.res_grain[index], self.top[index], self.out,
                          pick(self.a_out), pick(self.shift))  # fmt: skip

    def dot(self, c: torch.Tensor, dot=exact_dot):
        """(z, z_out): Z = z + z_out 2^shift (R, P), the exact integer dot products with the
        weight integers c (P, H) in units of 2^(e_n + f_v - 2 QBITS); z_out None without
        outlier columns. Each from `dot`: int64 or integer-valued fp64."""
        z = dot(self.a, c)
        return z, (None if self.out is None else dot(self.a_out, c[:, self.out]))


OUTLIER_RMS = 16.0  # an element this many times its row's RMS makes its column an outlier
MAX_OUTLIERS = 64  # more outlier columns than this: no split
MAX_SHIFT = 15  # |Z| <= (H - 64) 2^40 + 64 2^(40 + 15) < 2^63 for every H <= MAX_HIDDEN


def outlier_columns(x: torch.Tensor) -> torch.Tensor | None:
    """The columns of x (R, H) where some row holds an element OUTLIER_RMS times its RMS
    (half sqrt(H) times on rows shorter than 1024) -- LLM hidden states' massive-activation
    channels -- or None if there are none or more than MAX_OUTLIERS. A choice of method
    only: any choice gives the same logits."""
    if x.shape[0] == 0 or x.shape[1] == 0:
        return None
    xf = x.float().abs()
    rms = xf.square().mean(-1, keepdim=True).sqrt()
    # no element passes sqrt(H) times the RMS: short rows get half that
    ratio = min(OUTLIER_RMS, 0.5 * x.shape[1] ** 0.5)
    cols = torch.nonzero((xf >= ratio * rms).any(0)).squeeze(1)
    return cols if 0 < cols.numel() <= MAX_OUTLIERS else None


def hidden_rows(x: torch.Tensor, a3: torch.Tensor | None = None) -> HiddenRows:
    """HiddenRows of hidden states x (R, H); `a3`: the fused head's layout of L2's integers
    of the same rows, kept where no column is split off."""
    e, finite = row_exponents(x)
    bits = significand_bits(x.dtype)
    q, scaled = split(x, e, finite)
    res, l1, fine = _residual(scaled - q, bits)
    out = None if res is None else outlier_columns(x)  # on the grid: nothing to split off
    if out is None:
        # without a residual h' is an integer: a multiple of 2^0 (its grain is at least 0)
        coarse = grain(scaled, bits) if res is not None else torch.zeros_like(fine)
        top = torch.full_like(l1, float(1 << QBITS))
        return HiddenRows(q, a3, unit_scales(e - 2 * QBITS, finite), x, scaled, res, l1,
                          coarse, fine, top)  # fmt: skip
    rest = x.clone()
    rest[:, out] = 0
    e_rest, _ = row_exponents(rest)
    empty = rest.abs().amax(-1) == 0
    e_rest = torch.where(empty, e, e_rest).clamp(min=e - MAX_SHIFT, max=e)
    shift = e - e_rest
    q, scaled = split(x, e_rest, finite)  # h' in e_rest's units, every column
    q_out, _ = split(x[:, out], e, finite)  # the outlier columns on the whole row's grid
    q[:, out] = 0
    res = scaled - q
    res[:, out] -= q_out * contract.pow2(shift).unsqueeze(-1)  # exact: 2^shift q_out
    res, l1, fine = _residual(res, bits)
    coarse = grain(scaled, bits)
    top = contract.pow2(shift + QBITS)  # |h'| < 2^(QBITS + shift)
    return HiddenRows(q, None, unit_scales(e_rest - 2 * QBITS, finite), x, scaled, res, l1,
                      coarse, fine, top, out, q_out, shift)  # fmt: skip


def on_grid(x: torch.Tensor, exps: torch.Tensor, finite: torch.Tensor) -> torch.Tensor:
    """(R,) bool: rows of x (R, K) with no residual (every element on L2's grid)."""
    out = torch.empty(x.shape[0], dtype=torch.bool, device=x.device)
    step = max(1, (1 << 21) // max(x.shape[-1], 1))
    for r0 in range(0, x.shape[0], step):
        r = slice(r0, r0 + step)
        q, scaled = split(x[r], exps[r], finite[r])
        out[r] = (q == scaled).all(-1)
    return out


class WeightRows:
    """A block of weight rows: `c` (P, H) fp64 integers (a view of their (H, P) contiguous
    transpose, which the hidden residual's sparse product reads), `values` (P, H) as
    given; and, found on first use (the backward's hidden gradient reads only `c`), `res`
    c' ((P, H) dense or sparse CSR, None where all 0), `l1` (P,) and `res_grain` (P,)."""

    def __init__(self, c: torch.Tensor, values: torch.Tensor, residual: torch.Tensor):
        self.c, self.values = c, values
        self._residual, self._found = residual, None  # c' (P, H), a view of (H, P)

    def _parts(self):
        if self._found is None:
            self._found = _residual(self._residual, significand_bits(self.values.dtype))
            self._residual = None
        return self._found

    @property
    def res(self) -> torch.Tensor | None:
        return self._parts()[0]

    @property
    def l1(self) -> torch.Tensor:
        return self._parts()[1]

    @property
    def res_grain(self) -> torch.Tensor:
        return self._parts()[2]


def weight_rows(w: torch.Tensor, f: torch.Tensor, finite: torch.Tensor) -> WeightRows:
    """WeightRows of weight rows w (P, H) with L1's exponents f, finite (P,)."""
    scaled = torch.empty(w.shape[1], w.shape[0], dtype=torch.float64, device=w.device)
    scaled.copy_(w.t()).mul_(contract.pow2(QBITS - f))  # W'^T (H, P): one pass, exact
    scaled = torch.where(finite, scaled, 0.0)
    q = torch.round(scaled)
    return WeightRows(q.t(), w, scaled.sub_(q).t())


def correction(rows: HiddenRows, cols: WeightRows):
    """(E (R, P) fp64 or None where no residual takes part, its error bound (R, P); None
    where E is exact everywhere).

    The bound is 0 where E is exact: its terms (h' c' and a' C) are multiples of 2^L, L =
    min(grain(a'_n), grain(h'_n) + grain(c'_v)), and the sum of their magnitudes M <=
    2^QBITS ||a'_n||_1 + top_n ||c'_v||_1 is below 2^(53 + L), so every partial sum, in any
    order, is exact in binary64 (bf16 and fp16 residuals: nearly always)."""
    e = None
    if rows.res is not None:
        e = _times_weight(rows.res, cols.c)  # (R, P)
    if cols.res is not None:
        if cols.res.layout == torch.sparse_csr:  # (P, H) @ (H, R)
            part = (cols.res @ rows.scaled_t).t()
            e = part.contiguous() if e is None else e.add_(part)
        elif e is None:
            e = rows.scaled @ cols.res.t()
        else:  # both dense (fp32 inputs): one GEMM adds into the other's result
            e = torch.addmm(e, rows.scaled, cols.res.t())
    if e is None:
        return None, None
    unit = float(1 << QBITS) * (1 + 2.0**-40)  # |C| <= 2^QBITS; (norms' roundings)
    top = rows.top * (1 + 2.0**-40)
    # first with the block's largest ||c'||_1 and smallest grain: often exact for all rows
    mass = rows.l1 * unit + top * cols.l1.amax()
    fine = torch.minimum(rows.res_grain, rows.grain + cols.res_grain.amin())
    if not bool((torch.ldexp(mass, -fine.clamp(max=2000)) >= 2.0**53).any()):
        return e, None  # exact everywhere
    mass = (rows.l1 * unit).unsqueeze(-1) + top.unsqueeze(-1) * cols.l1.unsqueeze(0)
    fine = torch.minimum(rows.res_grain.unsqueeze(-1),
                         rows.grain.unsqueeze(-1) + cols.res_grain.unsqueeze(0))  # fmt: skip
    inexact = torch.ldexp(mass, -fine.clamp(max=2000)) >= 2.0**53
    gamma = (2 * rows.scaled.shape[-1] + 2) * 2.0**-52
    return e, torch.where(inexact, mass * gamma, 0.0)


def _times_weight(res: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """res @ c^T (R, P) for a residual res (R, H), dense or sparse CSR, and weight integers
    c (P, H) (weight_rows' c is a view of the contiguous c^T the sparse product reads)."""
    return res @ (c.t() if res.layout != torch.sparse_csr else c.t().contiguous())


def round_corrected(z, e, bound, row_scale, col_scale, z_out=None, shift=None):
    """(fl32((Z + E) 2^(e_n + f_v - 2 QBITS)) (R, P), `undecided` (R, P) bool or None) for
    the exact integers Z = z + z_out 2^shift (int64, or integer-valued fp64) and E (None:
    0) with |E - E_true| <= bound (None: exact). Where E is exact the value is D's; else
    it is D's where the value plus or minus the bound (and binary64's own roundings) stays
    on one side of a binary32 midpoint, in binary32's normal range. `undecided` marks the
    rest, and the few sums whose own combination was not provably exact."""
    undecided = None
    if z.dtype == torch.int64 or (z_out is not None and z_out.dtype == torch.int64):
        z = z.to(torch.int64)
        if z_out is not None:
            z = z + (z_out.to(torch.int64) << shift.unsqueeze(-1))
        zh = z.to(torch.float64)
        zl = (z - zh.to(torch.int64)).to(torch.float64)  # Z's few bits past 2^53
        if e is None:
            a = round_odd(zh, zl)
        else:
            s, t = contract.two_sum(zh, e)
            t, u = contract.two_sum(t, zl)
            a = round_odd(s, t, u)  # Z + E rounded to odd, where |E| < 2^50
            undecided = e.abs() >= 2.0**50
    else:
        if z_out is not None:  # an integer sum, exact where below 2^52
            z = z + z_out * contract.pow2(shift).unsqueeze(-1)
            undecided = z.abs() >= 2.0**52
        if e is None:
            a = z
        elif bound is None:  # Z + E exact in two terms: fl(Z + E) is D's but at midpoints
            return _round_sum(z, e, row_scale, col_scale, undecided)
        else:
            a = round_odd(z, e)
    if bound is not None:
        # a's 29 bits past binary32's significand against a midpoint's: scale-free
        mid = ((a.view(torch.int64) & ~_MANTISSA32) | _HALF32).view(torch.float64)
        margin = (a - mid).abs_().sub_(a.abs() * 2.0**-51)  # (exact; a's own roundings)
        # no other midpoint within the bound: the nearest is at least a quarter ulp32 away
        decided = (margin > bound) & (bound < a.abs() * 2.0**-27)
    a = a.mul(row_scale.unsqueeze(-1)).mul_(col_scale.unsqueeze(0))  # exact scalings
    if bound is not None:
        mag = a.abs()
        decided &= (mag >= 2.0**-126) & (mag < 2.0**127)
        decided |= (bound == 0) | torch.isnan(a)
        undecided = ~decided if undecided is None else undecided | ~decided
    if undecided is not None:
        undecided &= ~torch.isnan(a)
    return a.to(torch.float32), undecided


def _round_sum(z, e, row_scale, col_scale, undecided):
    """round_corrected's common case, E exact and Z fp64: fl32(fl(Z + E) 2^k) is fl32((Z +
    E) 2^k) except where fl(Z + E) lies exactly on a binary32 midpoint (or in binary32's
    subnormal range); only those few are rounded again, to odd from the exact error."""
    a = (z + e).mul_(row_scale.unsqueeze(-1)).mul_(col_scale.unsqueeze(0))  # exact scalings
    out = a.to(torch.float32)
    mag = a.abs()
    again = ((a.view(torch.int64) & _MANTISSA32) == _HALF32) | ((mag < 2.0**-126) & (mag > 0))
    n, v = torch.nonzero(again, as_tuple=True)
    if n.numel():
        zz, ee = z[n, v], e[n, v]
        odd = round_odd(zz, ee).mul_(row_scale[n]).mul_(col_scale[v])
        out[n, v] = odd.to(torch.float32)
    return out, undecided


# --- the exact rounding of a few dot products: every product in integer limbs ---

LIMB = 20  # bits per limb
EXACT_BASE = -440  # the limbs' unit: 2^-440, below every product's last bit (an fp32
# subnormal squared is 2^-298, 53 bits long) by more than three limbs
EXACT_LIMBS = 40  # 2^(EXACT_BASE + 20 * 40) = 2^360 > H 2^257: every sum fits
EXACT_PAIRS = 1 << 21  # products per chunk


def exact_round(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """(M,) fp32: fl32(sum_k x[m, k] y[m, k]) correctly rounded (ties to even), +0 for an
    exact zero, for finite x, y (M, K) of bf16 / fp16 / fp32 values (every product exact
    in binary64). The definition D itself, for the few logits round_corrected leaves."""
    m, k = x.shape
    out = torch.empty(m, dtype=torch.float32, device=x.device)
    step = max(1, EXACT_PAIRS // max(k, 1))
    for m0 in range(0, m, step):
        out[m0 : m0 + step] = _exact_round(x[m0 : m0 + step], y[m0 : m0 + step])
    return out


def _carry(acc: torch.Tensor) -> torch.Tensor:
    """The same number with every limb but the top one in [0, 2^LIMB)."""
    for i in range(acc.shape[1] - 1):
        c = acc[:, i] >> LIMB  # floor
        acc[:, i] -= c << LIMB
        acc[:, i + 1] += c
    return acc


def _exact_round(x, y):
    m, k = x.shape
    acc = torch.zeros(m, EXACT_LIMBS, dtype=torch.int64, device=x.device)
    for k0 in range(0, k, 1 << 20):  # a limb takes 3 2^20 pieces < 2^40 between carries
        p = x[:, k0 : k0 + (1 << 20)].to(torch.float64) * y[:, k0 : k0 + (1 << 20)].to(
            torch.float64
        )
        mant, ex = torch.frexp(p)  # p = mant 2^ex, exact
        v = (mant * 2.0**53).to(torch.int64)  # |v| < 2^53
        pos = ex.to(torch.int64) - 53 - EXACT_BASE  # v's last bit, >= 0
        limb = torch.div(pos, LIMB, rounding_mode="floor")
        off = pos - limb * LIMB
        for i in range(3):  # v = v0 + v1 2^20 + v2 2^40, v0, v1 in [0, 2^20)
            piece = v >> (LIMB * i)
            piece = piece if i == 2 else piece & ((1 << LIMB) - 1)
            acc.scatter_add_(1, limb + i, piece << off)
        acc = _carry(acc)
    neg = acc[:, -1] < 0
    acc = torch.where(neg.unsqueeze(-1), _carry(-acc), acc)
    idx = torch.arange(EXACT_LIMBS, device=x.device)
    nz = acc != 0
    top = torch.where(nz, idx, -1).amax(-1)  # the highest nonzero limb; -1: an exact 0
    low = torch.where(nz, idx, EXACT_LIMBS).amin(-1)
    j = top.clamp(min=3).unsqueeze(-1)
    hi = (acc.gather(1, j) << (2 * LIMB)) + (acc.gather(1, j - 1) << LIMB) + acc.gather(1, j - 2)
    lo = acc.gather(1, j - 3) | (low.unsqueeze(-1) < j - 3).to(torch.int64)  # sticky bit
    mag = odd53(hi, lo, LIMB) * contract.pow2(LIMB * (j - 3) + EXACT_BASE)
    val = torch.where(neg.unsqueeze(-1), -mag, mag).squeeze(-1)
    return torch.where(top < 0, 0.0, val).to(torch.float32)


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
