"""Accuracy claims: every output is the correctly rounded fp32 of the exact value, except
where the exact value lies within the documented error bound of a rounding midpoint.

Ground truth: an fp64 pipeline that is accurate near logprob = 0 (log1p of the
non-argmax terms) and, for a few rows, mpmath at 60 digits.
"""

import math

import pytest
import torch

from exactlogp import selected_logprobs
from exactlogp.testing import (
    error_bound,
    fp64_reference,
    fp64_reference_grad,
    llm_like_logits,
    mpmath_row,
    ulp32,
)

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def near_certain_rows(num_rows: int, vocab: int, dtype, seed: int):
    """Rows whose target is the argmax by 22..34: logprob between about -1e-5 and -1e-12."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_rows, vocab, generator=gen) * 2.0
    target = torch.randint(0, vocab, (num_rows,), generator=gen)
    x[torch.arange(num_rows), target] = 22.0 + 12.0 * torch.rand(num_rows, generator=gen)
    return x.to(dtype), target


def assert_correctly_rounded(ours: torch.Tensor, exact: torch.Tensor, bound: torch.Tensor, what):
    """ours == fp32(exact) wherever exact +- bound rounds to one fp32 value; and in every
    case |ours - exact| <= 0.5 ulp + bound.

    Where the absolute part of the bound (vocab * 2^-84, the fixed-point grid) is not
    small against an ulp -- |logprob| below ~1e-20 -- only the second claim holds.
    """
    lo, hi = (exact - bound).to(torch.float32), (exact + bound).to(torch.float32)
    decided = lo == hi
    assert torch.equal(ours[decided], exact.to(torch.float32)[decided]), what
    err = (ours.to(torch.float64) - exact).abs()
    assert (err <= 0.5 * ulp32(ours) + bound).all(), (what, err.max().item())
    regular = bound < ulp32(exact) * 2.0**-8
    assert decided[regular].float().mean() > 0.99, what  # near-ties are rare


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ["llm_like", "near_certain"])
def test_outputs_are_correctly_rounded(dtype, case):
    vocab = 4099
    if case == "llm_like":
        x, t = llm_like_logits(48, vocab, dtype, seed=5)
    else:
        x, t = near_certain_rows(48, vocab, dtype, seed=6)
    res = selected_logprobs(x, t, with_entropy=True)
    ref = fp64_reference(x, t)
    if case == "near_certain":
        assert (res.logprobs > -1e-4).all() and (res.logprobs < 0).all()
        assert res.logprobs.max() > -1e-10
    for name in ("logprobs", "entropy", "lse"):
        bound = error_bound(ref.scale[name], vocab)
        assert_correctly_rounded(getattr(res, name), getattr(ref, name), bound, (dtype, name))


def test_temperature_and_keep_mask_accuracy():
    x, t = llm_like_logits(32, 2053, torch.bfloat16, seed=7)
    tau = torch.linspace(0.25, 1.75, 32)
    keep = torch.rand(x.shape, generator=torch.Generator().manual_seed(1)) > 0.5
    keep[torch.arange(32), t] = True
    res = selected_logprobs(x, t, temperature=tau, keep_mask=keep, with_entropy=True)
    ref = fp64_reference(x, t, temperature=tau, keep_mask=keep)
    for name in ("logprobs", "entropy", "lse"):
        bound = error_bound(ref.scale[name], 2053)
        assert_correctly_rounded(getattr(res, name), getattr(ref, name), bound, name)


def test_against_mpmath_rows():
    x, t = llm_like_logits(4, 300, torch.float32, seed=8)
    xc, tc = near_certain_rows(4, 300, torch.float32, seed=9)
    x, t = torch.cat([x, xc]), torch.cat([t, tc])
    res = selected_logprobs(x, t, with_entropy=True)
    for i in range(8):
        exact = torch.tensor(mpmath_row(x[i].double(), int(t[i])), dtype=torch.float64)
        ours = torch.stack([res.logprobs[i], res.entropy[i], res.lse[i]])
        bound = 2.0**-48 * exact.abs() + 300 * 2.0**-84
        assert_correctly_rounded(ours, exact, bound, i)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gradients_match_fp64_analytic(dtype):
    vocab = 1031
    x, t = llm_like_logits(16, vocab, dtype, seed=10)
    t[3] = -100
    tau = 0.8
    x = x.requires_grad_(True)
    res = selected_logprobs(x, t, with_entropy=True, temperature=tau)
    gen = torch.Generator().manual_seed(2)
    g_lp, g_ent, g_lse = (torch.randn(16, generator=gen) for _ in range(3))
    (g_lp * res.logprobs + g_ent * res.entropy + g_lse * res.lse).sum().backward()
    assert x.grad.dtype == dtype

    live = t != -100
    ref = fp64_reference(x.detach()[live], t[live], temperature=tau)
    exact = fp64_reference_grad(ref, t[live], g_lp[live], g_ent[live], g_lse[live], tau)
    ours = x.grad[live].to(torch.float64)
    # our fp64 gradient is within 2^-45 of the magnitudes it is built from; it is then
    # rounded to fp32 and, for bf16/fp16, once more to the input dtype
    col = lambda v: v.abs().unsqueeze(-1)  # noqa: E731
    magnitude = ref.probs * (col(g_lp[live]) + col(g_lse[live]) + 80 * col(g_ent[live]))
    bound = 2.0**-45 * (magnitude + col(g_lp[live])) / tau + 0.5 * ulp32(exact)
    # the contract drops terms with y - M < -64, so their gradient is exactly 0
    bound = bound + torch.where(ref.probs <= math.exp(-64), magnitude / tau, 0.0)
    if dtype != torch.float32:
        finfo = torch.finfo(dtype)
        bound = bound + finfo.eps * torch.clamp(exact.abs(), min=finfo.smallest_normal)
    assert ((ours - exact).abs() <= bound).all()
    assert torch.equal(x.grad[~live], torch.zeros_like(x.grad[~live]))


def test_near_certain_target_gradient_keeps_its_relative_precision():
    """d logprob / dy_t = 1 - p_t is computed from the exact S ((S - e_t) / S), not as
    1 - e_t / S: at logprob ~ -1e-13 the latter is off by ~500 ulp, this is within 1 ulp."""
    import mpmath

    rows = []
    for lift in (9.0, 16.0, 23.0, 30.0, 34.5):  # 1 - p_t from ~1e-2 down to ~1e-13
        row = [0.5 * math.sin(j) for j in range(200)]
        row[17] = lift
        rows.append(row)
    x = torch.tensor(rows, dtype=torch.float32, requires_grad=True)
    t = torch.full((len(rows),), 17)
    selected_logprobs(x, t).logprobs.sum().backward()
    with mpmath.workdps(60):
        for i in range(len(rows)):
            y = [mpmath.mpf(float(v)) for v in x[i].detach()]
            m = max(y)
            s = mpmath.fsum(mpmath.exp(v - m) for v in y)
            one_minus_p = 1 - mpmath.exp(y[17] - m) / s
            ours = float(x.grad[i, 17])
            err_ulps = abs(mpmath.mpf(ours) - one_minus_p) / float(ulp32(torch.tensor(ours)))
            assert err_ulps <= 0.5 + 2.0**-20, (i, float(one_minus_p), ours, float(err_ulps))
    assert float(x.grad[-1, 17]) < 1e-12


def test_fp32_midpoints_can_round_twice_as_documented():
    """The binary64 value is rounded to fp32 once more; where the exact value lies within
    the error bound of an fp32 midpoint the result may be the other neighbour
    (docs/numerics.md section 8 gives this row)."""
    x = torch.tensor([[64.0, -(2.0**30), 44.0]])
    res = selected_logprobs(x, torch.tensor([1]))
    # exact: -2^30 - 64 - 2.06e-9, just past the midpoint -2^30 - 64 of -2^30 and
    # -2^30 - 128; binary64 rounds it onto the midpoint, which ties to even: -2^30
    assert res.logprobs.item() == -(2.0**30)
    exact = mpmath_row(x[0].double(), 1)[0]
    assert abs(res.logprobs.item() - exact) <= 0.5 * 128 + 2.0**-49 * abs(exact)


def test_lse_near_zero_has_an_absolute_not_a_relative_bound():
    """lse = M + log S cancels when M ~ -log S: on an all-equal row of value fl32(-ln V)
    it is ~1e-12, and the absolute bound 2^-52 |M| + 2^-49 log S + V 2^-85 is thousands
    of fp32 ulps of that (docs/numerics.md section 8)."""
    import mpmath

    vocab = 42073
    m = float(torch.tensor(-math.log(vocab), dtype=torch.float32))
    res = selected_logprobs(torch.full((1, vocab), m), torch.tensor([0]))
    with mpmath.workdps(60):
        exact = float(mpmath.mpf(m) + mpmath.log(vocab))
    err = abs(res.lse.item() - exact)
    assert err <= 2.0**-52 * abs(m) + 2.0**-49 * math.log(vocab) + vocab * 2.0**-85
    assert err / float(ulp32(torch.tensor(exact))) > 1000  # measured: ~6949 ulp


def test_a_near_certain_logprob_has_an_absolute_bound_on_a_full_vocabulary():
    """logprob -1e-15 on a 151936-token row (target logit 0, the rest fl32(-46.47)): the
    absolute part of the bound, V 2^-85 ~ 4e-21, is tens of fp32 ulps there, and the
    value is within it, not within an ulp (docs/numerics.md section 8: measured 25 ulp)."""
    import mpmath

    vocab = 151936
    x = torch.full((1, vocab), -46.47)
    x[0, 0] = 0.0
    res = selected_logprobs(x, torch.tensor([0]))
    with mpmath.workdps(60):
        exact = -mpmath.log(1 + (vocab - 1) * mpmath.exp(mpmath.mpf(float(x[0, 1]))))
    exact = float(exact)
    err = abs(res.logprobs.item() - exact)
    tail = (vocab - 1) * math.exp(float(x[0, 1]))  # S - 1
    rho = 2.0**-53 * tail * -float(x[0, 1]) + 2.0**-51 * tail + vocab * 2.0**-85
    assert err <= 0.5 * float(ulp32(torch.tensor(exact))) + 2.0**-49 * abs(exact) + rho
    assert err / float(ulp32(torch.tensor(exact))) > 10  # the absolute part shows
