"""The constants and elementwise pieces of the contract, checked against mpmath and Python ints."""

import math
from fractions import Fraction

import mpmath
import pytest
import torch

from exactlogp import contract

mpmath.mp.prec = 200


def correctly_rounded(x) -> float:
    """The binary64 nearest to the mpmath value x (ties to even), via exact rationals."""
    f = float(x)
    exact = Fraction(mpmath.nstr(x, 80, strip_zeros=False, min_fixed=-1e9, max_fixed=1e9))
    below, above = math.nextafter(f, -math.inf), math.nextafter(f, math.inf)
    for other in (below, above):
        if abs(Fraction(other) - exact) < abs(Fraction(f) - exact):
            return other
    return f


def test_exp2_table_is_correctly_rounded():
    for j, value in enumerate(contract.EXP2_TABLE):
        assert value == correctly_rounded(mpmath.power(2, mpmath.mpf(j) / 32)), j


def test_polynomial_coefficients_are_correctly_rounded():
    assert contract.EXP_POLY == tuple(
        correctly_rounded(1 / mpmath.factorial(i)) for i in range(6, -1, -1)
    )
    assert contract.LOG_POLY == tuple(
        correctly_rounded(mpmath.mpf(1) / (2 * i + 1)) for i in range(11, 0, -1)
    )


def test_ln2_splits_are_exact_enough_and_short():
    ln2 = mpmath.log(2)
    assert contract.INV_LN2_32 == correctly_rounded(32 / ln2)
    assert contract.SQRT_HALF == correctly_rounded(mpmath.sqrt(0.5))
    # hi parts: few enough significant bits that k * hi is exact for every k used
    # (|k| <= 2956 in exp_c, |k| <= 21 in log_c)
    for hi, lo, target, k_bits in (
        (contract.LN2_32_HI, contract.LN2_32_LO, ln2 / 32, 12),
        (contract.LN2_HI, contract.LN2_LO, ln2, 11),
    ):
        mantissa = Fraction(hi) / Fraction(2) ** math.frexp(hi)[1]
        bits = next(b for b in range(54) if (mantissa * 2**b).denominator == 1)
        assert bits + k_bits <= 53, (hi, bits)
        assert abs(mpmath.mpf(hi) + mpmath.mpf(lo) - target) < mpmath.mpf(2) ** -95


def test_exp_c_is_accurate_over_the_whole_domain():
    d = torch.cat(
        [
            torch.linspace(contract.CUTOFF, 0.0, 20001, dtype=torch.float64),
            -torch.logspace(-300, 1.8, 2000, dtype=torch.float64),
            torch.tensor([0.0, -0.0, -64.0, -math.log(2) / 64, -math.log(2) / 32]),
        ]
    )
    e = contract.exp_c(d)
    worst = max(
        abs((mpmath.mpf(float(v)) - mpmath.exp(float(x))) / mpmath.exp(float(x)))
        for x, v in zip(d[::7].tolist(), e[::7].tolist(), strict=True)
    )
    # docs/numerics.md section 4: 3.12 u from the roundings (measured: 2^-51.55)
    assert worst < 3.12 * 2.0**-53, float(worst)
    assert contract.exp_c(torch.zeros(1, dtype=torch.float64)).item() == 1.0


def test_quantize_is_the_exact_rounded_fixed_point_value():
    gen = torch.Generator().manual_seed(0)
    v = torch.cat(
        [
            torch.rand(5000, generator=gen, dtype=torch.float64),
            torch.rand(5000, generator=gen, dtype=torch.float64) * 2.0**-60,
            torch.tensor([0.0, 1.0, 2.0**-84, 1.5 * 2.0**-84, 2.5 * 2.0**-84, 1 - 2.0**-53]),
        ]
    )
    hi, lo = contract.quantize(v)
    for x, h, lo_ in zip(v.tolist(), hi.tolist(), lo.tolist(), strict=True):
        scaled = Fraction(x) * 2**84
        q = round(scaled)  # Python's round on Fraction: half to even
        assert h * 2**42 + lo_ == q
        assert 0 <= lo_ <= 2**42


@pytest.mark.parametrize("hi_lo", [(2**42, 0), (2**42, 1), (2**42 + 5, 2**42 + 3), (2**62, 2**62)])
def test_limbs_to_double_double_is_exact(hi_lo):
    hi, lo = hi_lo
    vh, vl = contract.limbs_to_double_double(torch.tensor([hi]), torch.tensor([lo]))
    exact = Fraction(hi, 2**42) + Fraction(lo, 2**84)
    assert Fraction(vh.item()) + Fraction(vl.item()) == exact
    assert vh.item() == float(exact)  # vh is the correctly rounded value


def test_log_c_keeps_relative_precision_near_one_and_is_accurate_far_from_it():
    cases = [(1.0, 2.0**-60), (1.0, 1e-30), (1.0 + 2.0**-40, -(2.0**-94)), (1.0, 0.0)]
    cases += [(1.0 + k * 1e-3, 1e-19) for k in range(1, 2000, 37)]
    cases += [(float(2.0**k * 1.37), 0.0) for k in range(0, 21)]
    sh = torch.tensor([c[0] for c in cases], dtype=torch.float64)
    sl = torch.tensor([c[1] for c in cases], dtype=torch.float64)
    got = contract.log_c(sh, sl)
    for (h, low), g in zip(cases, got.tolist(), strict=True):
        exact = mpmath.log(mpmath.mpf(h) + mpmath.mpf(low))
        if exact == 0:
            assert g == 0.0
        else:
            assert abs((g - exact) / exact) < 2.0**-50, (h, low, g)
