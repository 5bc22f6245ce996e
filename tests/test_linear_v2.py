"""Contract exactlogp-linear-v2: every logit is the true dot product, rounded once.

Checked against exactlogp.testing.exact_logits (Python integers, independent of the code)
on the inputs where contract v1 was not exact -- outlier channels, fp32, wide exponent
ranges, ties, cancellation, subnormals, overflow -- on every CPU backend and on each of
the correction's paths (sparse / dense, the exactness certificate,
the binary64 bound, the exact limb sum). Triton's routes: tests/test_linear_triton.py.
"""

import random

import pytest
import torch

import exactlogp
from exactlogp import linear_contract as lc
from exactlogp.testing import assert_bitwise_equal, exact_logits, lm_head_inputs

BACKENDS = ["reference", "cpu"]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _outliers(rows, hidden, vocab, dtype, outlier, seed=3):
    return lm_head_inputs(rows, hidden, vocab, dtype, seed=seed, outlier=outlier,
                          outlier_channels=2)[:2]  # fmt: skip


def _assert_definition(z, h, w):
    want = exact_logits(h, w)
    assert_bitwise_equal(z, want)  # signs of zero included


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("outlier", [1.0, 100.0, 1000.0])
def test_logits_are_the_true_dot_products_rounded_once(backend, dtype, outlier):
    h, w = _outliers(6, 96, 40, dtype, outlier)
    _assert_definition(exactlogp.linear_logits(h, w, backend=backend), h, w)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_h4096_with_1000x_channels_and_fp32_inputs(backend, dtype):
    """The issue's case: H = 4096, two channels 1000x the rest (bf16), and fp32 inputs."""
    h, w = _outliers(3, 4096, 7, dtype, 1000.0 if dtype == torch.bfloat16 else 8.0)
    rows = lc.hidden_rows(h)
    assert rows.res is not None  # contract v1 was not exact here
    _assert_definition(exactlogp.linear_logits(h, w, backend=backend), h, w)


def _hard_rows(dtype, seed):
    """Rows built to be hard: wide exponent ranges, exact ties, cancellation to tiny or
    zero sums, subnormal elements and results, sums past fp32's largest."""
    rng = random.Random(seed)
    lo = -140 if dtype != torch.float16 else -24
    hi = 120 if dtype != torch.float16 else 14

    def val():
        if rng.random() < 0.15:
            return 0.0
        return rng.choice([-1, 1]) * rng.uniform(1, 2) * 2.0 ** rng.randint(lo, hi)

    h = torch.tensor([[val() for _ in range(5)] for _ in range(8)]).to(dtype)
    w = torch.tensor([[val() for _ in range(5)] for _ in range(9)]).to(dtype)
    h, w = torch.nan_to_num(h, 0.0, 0.0, 0.0), torch.nan_to_num(w, 0.0, 0.0, 0.0)
    one = 1.0 + 2.0**-7 if dtype == torch.bfloat16 else 1.0 + 2.0**-10
    if dtype == torch.float32:
        one = 1.0 + 2.0**-23
    # a tie: x + half an fp32 ulp of x, x with an odd last bit (and below: the same + tiny)
    h[0] = torch.tensor([one, 2.0**-24, 2.0**-24, 0.0, 0.0]).to(dtype)
    w[0] = torch.tensor([1.0, 1.0, 0.0, 0.0, 0.0]).to(dtype)
    w[1] = torch.tensor([1.0, 1.0, 2.0**-14, 0.0, 0.0]).to(dtype)
    # cancellation: a - a + tiny, and a - a exactly (+0)
    a, tiny = (2.0**10, 2.0**-14) if dtype == torch.float16 else (2.0**60, 2.0**-60)
    h[1] = torch.tensor([a, -a, tiny, 1.0, 0.0]).to(dtype)
    w[2] = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0]).to(dtype)
    w[3] = torch.tensor([1.0, 1.0, 0.0, 0.0, 0.0]).to(dtype)
    w[4] = torch.tensor([1.0, 1.0, -1.0, 0.0, 0.0]).to(dtype)  # -tiny: rounds to itself
    # overflow: two products of 2^127 (fp16: its own largest)
    big = 2.0**63 if dtype != torch.float16 else 2.0**7
    h[2] = torch.tensor([big, big, 0.0, 0.0, 1.0]).to(dtype)
    w[5] = torch.tensor([big, big, 0.0, 0.0, 0.0]).to(dtype)
    return h, w


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_ties_cancellation_subnormals_and_overflow(backend, dtype):
    for seed in range(4):
        h, w = _hard_rows(dtype, seed)
        _assert_definition(exactlogp.linear_logits(h, w, backend=backend), h, w)


def test_a_tiny_negative_sum_is_minus_zero_and_an_exact_zero_plus_zero():
    h = torch.tensor([[2.0**-100, -(2.0**-100), 3.0]])
    w = torch.tensor([[2.0**-100, 0.0, 0.0], [1.0, 1.0, 0.0], [-(2.0**-100), 0.0, 0.0]])
    z = exactlogp.linear_logits(h, w)
    assert z[0, 0].item() == 0.0 and not torch.signbit(z[0, 0])  # 2^-200 rounds to +0
    assert z[0, 1].item() == 0.0 and not torch.signbit(z[0, 1])  # exactly 0: +0
    assert z[0, 2].item() == 0.0 and torch.signbit(z[0, 2])  # -2^-200 rounds to -0
    _assert_definition(z, h, w)


def test_exact_round_is_the_definition_on_long_and_carrying_sums():
    """The limb sum alone: many equal products (carries through every limb), alternating
    signs, the widest exponent ranges."""
    gen = torch.Generator().manual_seed(4)
    k = 3000
    x = torch.full((4, k), 1.9921875, dtype=torch.bfloat16)
    y = torch.full((4, k), 1.9921875, dtype=torch.bfloat16)
    y[1, ::2] *= -1
    y[2] = (
        torch.randn(k, generator=gen) * 2.0 ** torch.randint(-60, 60, (k,), generator=gen)
    ).bfloat16()
    x[3] = (
        torch.randn(k, generator=gen) * 2.0 ** torch.randint(-120, 100, (k,), generator=gen)
    ).bfloat16()
    got = lc.exact_round(x, y)
    want = torch.stack([exact_logits(x[i : i + 1], y[i : i + 1])[0, 0] for i in range(4)])
    assert_bitwise_equal(got, want)


def _paths(monkeypatch, path):
    if path == "dense":
        monkeypatch.setattr(lc, "SPARSE_BELOW", 0.0)
    elif path == "sparse":
        monkeypatch.setattr(lc, "SPARSE_BELOW", 2.0)
    elif path == "bound":  # no certificate: every corrected logit through the bound's test
        real = lc.correction

        def no_certificate(rows, cols):
            e, bound = real(rows, cols)
            if e is not None and bound is None:
                bound = torch.zeros_like(e).add_(2.0**-60)
            return e, bound

        monkeypatch.setattr(lc, "correction", no_certificate)
    elif path == "exact_sum":  # every corrected logit through the limb sum
        real = lc.round_corrected

        def undecided(*args):
            val, _ = real(*args)
            return val, torch.ones(val.shape, dtype=torch.bool)

        monkeypatch.setattr(lc, "round_corrected", undecided)


@pytest.mark.parametrize("path", ["dense", "sparse", "bound", "exact_sum"])
def test_every_path_of_the_correction_gives_the_same_bits(monkeypatch, path):
    cases = [_outliers(5, 128, 30, dt, m) for dt in DTYPES for m in (1.0, 1000.0)]
    cases += [_hard_rows(dt, 7) for dt in DTYPES]
    before = [exactlogp.linear_logits(h, w, backend="cpu") for h, w in cases]
    _paths(monkeypatch, path)
    for (h, w), z in zip(cases, before, strict=True):
        got = exactlogp.linear_logits(h, w, backend="cpu")
        assert_bitwise_equal(got, z)
        assert_bitwise_equal(got, exact_logits(h, w))


def test_v1_bits_are_kept_where_v1_was_exact():
    """Where neither the hidden row nor the weight row has a residual (every element on
    L2's 20-bit grid), contract v1's logits were already the true dot products rounded
    once: v2 gives the same bits there. Elsewhere v2 moves only logits v1 got wrong."""
    for dtype, outlier in ((torch.bfloat16, 8.0), (torch.bfloat16, 100.0), (torch.float16, 30.0)):
        h, w = _outliers(12, 256, 64, dtype, outlier, seed=9)
        e, fin = lc.row_exponents(h)
        f, ff = lc.row_exponents(w)
        v1 = lc.logits_block(lc.quantize(h, e, fin), lc.unit_scales(e - 2 * lc.QBITS, fin),
                             lc.quantize(w, f, ff), lc.unit_scales(f, ff), None, 1.0)  # fmt: skip
        v2 = exactlogp.linear_logits(h, w)
        on_grid = [(q == x).all(-1) for q, x in (lc.split(h, e, fin), lc.split(w, f, ff))]
        lossless = on_grid[0].unsqueeze(-1) & on_grid[1].unsqueeze(0)  # v1's own grid
        assert lossless.any() and not lossless.all()
        assert_bitwise_equal(v2[lossless], v1[lossless])
        truth = exact_logits(h, w)
        assert_bitwise_equal(v2, truth)
        moved = v2 != v1
        assert moved.any()  # v1 was wrong somewhere here, and only where it was inexact
        assert not (moved & lossless).any()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_fused_head_and_its_gradients_run_on_v2_logits(dtype):
    """linear_selected_logprobs is selected_logprobs of linear_logits bitwise (forward and,
    through the logits' own backward, the weight and hidden gradients), on rows whose
    logits v1 rounded wrongly."""
    h, w = _outliers(7, 160, 50, dtype, 1000.0)
    t = torch.arange(7) * 5
    hf, wf = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    got = exactlogp.linear_selected_logprobs(hf, wf, t, with_entropy=True)
    z = exactlogp.linear_logits(h, w)
    want = exactlogp.selected_logprobs(z, t, with_entropy=True)
    for a, b in zip(got, want, strict=True):
        assert_bitwise_equal(a, b)
    (got.logprobs.sum() + got.entropy.sum()).backward()
    assert torch.isfinite(hf.grad.float()).all() and torch.isfinite(wf.grad.float()).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_certified_correction_is_the_exact_sum(dtype):
    """correction() reports no bound only where E is exact, and within its bound elsewhere:
    checked against Fractions, on hidden rows with and without residuals against weight
    rows with a few elements off the grid and rows spanning 2^0 .. 2^-60 (whose residual
    terms would not fit 53 bits)."""
    from fractions import Fraction

    def fractions(t):
        if t is None:
            return None
        t = t.to_dense() if t.layout == torch.sparse_csr else t
        return [[Fraction(x) for x in r] for r in t.tolist()]

    gen = torch.Generator().manual_seed(12)
    spans = 2.0 ** -torch.randint(0, 60, (6, 40), generator=gen).float()
    spans[:3] = 1.0  # and a few elements 2^-14 .. 2^-16 of the rest: a sparse residual
    spans[:3, :3] = 2.0 ** -torch.randint(14, 17, (3, 3), generator=gen).float()
    w = (torch.randn(6, 40, generator=gen) * spans).to(dtype)
    on_grid = (torch.randint(-8, 9, (3, 40), generator=gen).float() / 4).to(dtype)
    off_grid = (torch.randn(3, 40, generator=gen) * spans[:3]).to(dtype)
    certified = 0
    for block in (w[:3], w[3:]):  # few residuals / many: the correction is sparse / dense
        f, ff = lc.row_exponents(block)
        cols = lc.weight_rows(block, f, ff)
        c, cres = fractions(cols.c), fractions(cols.res)
        for h in (on_grid, off_grid, torch.cat([on_grid, off_grid])):
            rows = lc.hidden_rows(h)
            e, bound = lc.correction(rows, cols)
            scaled, res = fractions(rows.scaled), fractions(rows.res)
            for n in range(h.shape[0]):
                for v in range(3):
                    true = sum(
                        scaled[n][k] * cres[v][k] + (0 if res is None else res[n][k] * c[v][k])
                        for k in range(40)
                    )
                    if bound is None or bound[n, v] == 0:
                        certified += 1
                        assert Fraction(e[n, v].item()) == true, (n, v)
                    else:
                        err = abs(Fraction(e[n, v].item()) - true)
                        assert err <= Fraction(bound[n, v].item())
    # bf16: the certificate holds somewhere (sparse residuals); fp32: never sought (dense)
    assert (certified > 0) == (dtype == torch.bfloat16)
