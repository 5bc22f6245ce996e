"""The exact fused LM head in one process: its definition, its invariances, its accuracy.

Bitwise claims use torch.equal / assert_bitwise_equal; accuracy claims compare with an fp64
GEMM and fp64 log-softmax of the same inputs. Multi-rank worlds: test_linear_distributed.py.
"""

import random
from fractions import Fraction

import numpy as np
import pytest
import torch

import exactlogp
from exactlogp import linear_contract as lc
from exactlogp.testing import assert_bitwise_equal, exact_logits, lm_head_inputs

BACKENDS = ["reference", "cpu"]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _exact_logits(h, w, bias=None, scale=1.0):
    """Python-integer reference of contract v1's L1-L5 (the 20-bit grid), one element at a
    time (small shapes only): v2's bits wherever every element is on the grid."""
    out = torch.empty(h.shape[0], w.shape[0], dtype=torch.float32)
    hs, ws = h.double().tolist(), w.double().tolist()
    for n, hr in enumerate(hs):
        e = _exponent(max(abs(v) for v in hr))
        a = [_rint(Fraction(v) * Fraction(2) ** (lc.QBITS - e)) for v in hr]
        for v, wr in enumerate(ws):
            f = _exponent(max(abs(x) for x in wr))
            c = [_rint(Fraction(x) * Fraction(2) ** (lc.QBITS - f)) for x in wr]
            exact = Fraction(sum(p * q for p, q in zip(a, c, strict=True))) * Fraction(2) ** (
                e + f - 2 * lc.QBITS
            )
            out[n, v] = _fp32(exact)
    if bias is not None:
        out = out + bias.float()
    return out * torch.tensor(scale, dtype=torch.float32) if scale != 1.0 else out


def _exponent(m: float) -> int:
    return 0 if m == 0 else __import__("math").frexp(m)[1]


def _rint(x: Fraction) -> int:
    return round(x)  # Python rounds Fractions half to even


def _fp32(x: Fraction) -> float:
    """Correctly rounded fp32 of an exact rational (via its two fp32 neighbours)."""
    f = torch.tensor(float(x), dtype=torch.float32)
    best = None
    for cand in (torch.nextafter(f, torch.tensor(-float("inf"))), f,
                 torch.nextafter(f, torch.tensor(float("inf")))):  # fmt: skip
        err = abs(Fraction(float(cand)) - x)
        bits = int(cand.view(torch.int32))
        if best is None or err < best[0] or (err == best[0] and bits % 2 == 0):
            best = (err, bits, float(cand))
    return best[2]


# --- the definition ---


@pytest.mark.parametrize("backend", BACKENDS)
def test_logits_are_the_exact_dot_products_rounded_once(backend):
    """L1-L5 with bias and logit_scale; on these rows every element is on L2's grid, so the
    v1 reference (the integers rounded once) and v2's definition agree."""
    h, w, _ = lm_head_inputs(5, 37, 11, torch.bfloat16, seed=1)
    h[2, 3] = 0.0
    h[4] = 0.0  # a zero row
    bias = torch.randn(11).to(torch.bfloat16)
    for b, s in ((None, 1.0), (bias, 0.625)):
        ours = exactlogp.linear_logits(h, w, b, logit_scale=s, backend=backend)
        assert_bitwise_equal(ours, _exact_logits(h, w, b, s))
        want = exact_logits(h, w)
        if b is not None:
            want = want + b.float()
        want = want * torch.tensor(s, dtype=torch.float32) if s != 1.0 else want
        assert_bitwise_equal(ours, want)


def test_rounding_of_big_integers_is_correct():
    """round_scaled against exact rationals: values past 2^53, ties, subnormal and
    overflowing results, negative values."""
    rng = random.Random(3)
    his, los, exps = [], [], []
    for _ in range(4000):
        kind = rng.randrange(4)
        hi = rng.getrandbits(rng.randrange(1, 62)) * rng.choice([1, -1])
        if kind == 1:  # exactly halfway between two fp32 values
            hi = ((1 << 24) + 2 * rng.getrandbits(23) + 1) << rng.randrange(0, 30)
        lo = rng.getrandbits(20)
        exp = rng.choice([rng.randrange(-200, 100), rng.randrange(-250, -190)])
        his.append(hi), los.append(lo), exps.append(exp)
    hi_t, lo_t, exp_t = (torch.tensor(v, dtype=torch.int64) for v in (his, los, exps))
    ours = lc.round_scaled(hi_t, exp_t, lo_t, 20)
    for i in range(len(his)):
        exact = (Fraction(his[i] * (1 << 20) + los[i])) * Fraction(2) ** exps[i]
        want = _fp32(exact) if abs(exact) < Fraction(2) ** 128 else None
        got = float(ours[i])
        if want is None or abs(want) == float("inf"):
            assert got in (float("inf"), -float("inf")) or abs(got) > 3e38, (i, got)
        else:
            assert got == want, (his[i], los[i], exps[i], got, want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_equals_selected_logprobs_of_the_exact_logits(dtype):
    h, w, t = lm_head_inputs(40, 96, 700, dtype, seed=2)
    t[5] = -100
    bias = (0.2 * torch.randn(700)).to(dtype)
    tau = torch.linspace(0.5, 1.5, 40)
    cases = [
        dict(),
        dict(bias=bias, logit_scale=0.75, with_entropy=True),
        dict(temperature=0.7, vocab_size=650),
        dict(temperature=tau, with_entropy=True, ignore_index=-100),
    ]
    for kw in cases:
        tk = torch.where(t >= 0, t % kw.get("vocab_size", 700), t)
        logits = exactlogp.linear_logits(
            h, w, kw.get("bias"), logit_scale=kw.get("logit_scale", 1.0)
        )
        rest = {k: v for k, v in kw.items() if k not in ("bias", "logit_scale")}
        want = exactlogp.selected_logprobs(logits, tk, **rest)
        for backend in BACKENDS:
            got = exactlogp.linear_selected_logprobs(h, w, tk, backend=backend, **kw)
            for a, b in zip(got, want, strict=True):
                assert (a is None) == (b is None)
                if a is not None:
                    assert_bitwise_equal(a, b, f"{dtype} {kw.keys()} {backend}")


# --- invariances ---


def test_logits_do_not_depend_on_the_batch_the_order_or_the_shard():
    h, w, _ = lm_head_inputs(50, 64, 300, torch.bfloat16, seed=4)
    full = exactlogp.linear_logits(h, w)
    perm = torch.randperm(50, generator=torch.Generator().manual_seed(0))
    assert_bitwise_equal(exactlogp.linear_logits(h[perm], w), full[perm])
    for i in (0, 17, 49):
        assert_bitwise_equal(exactlogp.linear_logits(h[i : i + 1], w), full[i : i + 1])
    for lo, hi in ((0, 1), (1, 100), (100, 299), (299, 300)):
        assert_bitwise_equal(exactlogp.linear_logits(h, w[lo:hi]), full[:, lo:hi])


def test_many_rows_in_blocks_give_the_bits_of_each_row_alone():
    from exactlogp import linear

    h, w, t = lm_head_inputs(linear.ROW_BLOCK + 37, 32, 200, torch.bfloat16, seed=5)
    res = exactlogp.linear_selected_logprobs(h, w, t, with_entropy=True)
    for i in (0, linear.ROW_BLOCK - 1, linear.ROW_BLOCK, linear.ROW_BLOCK + 36):
        alone = exactlogp.linear_selected_logprobs(h[i : i + 1], w, t[i : i + 1], with_entropy=True)
        for a, b in zip(res, alone, strict=True):
            assert_bitwise_equal(a[i : i + 1], b)


def _spy_backward(monkeypatch):
    """(logits computed, rows whose predicted grid missed per backward) lists, filled as
    backwards run."""
    from exactlogp import linear

    computed, missed = [], []
    real, passes = linear._Weight.logits, linear._hidden_passes
    monkeypatch.setattr(linear._Weight, "logits",
                        lambda self, h, *r, **k: computed.append(h.a.shape[0]) or real(self, h, *r, **k))  # fmt: skip

    def hidden_passes(grads, *args, **kw):
        big = passes(grads, *args, **kw)
        missed.append(grads.missed)
        return big

    monkeypatch.setattr(linear, "_hidden_passes", hidden_passes)
    return computed, missed


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "kw",
    [dict(), dict(with_entropy=True, logit_scale=0.625, temperature=0.7),
     dict(with_entropy=True, vocab_size=290, ignore_index=32, temperature="rows")],
)  # fmt: skip
def test_past_the_keep_budget_the_backward_computes_the_logits_once_on_a_predicted_grid(
    backend, kw, monkeypatch
):
    """Where dL/dz fit GRAD_KEEP_BYTES, pass 1 keeps them for pass 2. Where they do not,
    the forward saves each row's largest logit
    per weight-exponent class and the backward slices the hidden gradient on the grid they
    predict, in the same pass as dW: the logits once (not twice), every prediction right
    on these rows (with an entropy gradient too), and the kept path's bits -- with padding,
    per-row temperatures, an ignored row and ignore_index equal to the class count."""
    from exactlogp import linear

    h, w, t = lm_head_inputs(21, 48, 300, torch.bfloat16, seed=8)
    t[4] = kw.get("ignore_index", -100)
    t.clamp_(max=kw.get("vocab_size", 300) - 1)
    if kw.get("temperature") == "rows":
        kw = {**kw, "temperature": torch.linspace(0.5, 1.5, 21)}
    bias = torch.randn(300, generator=torch.Generator().manual_seed(4)).bfloat16()
    monkeypatch.setattr(linear, "GRAD_BLOCK_ELEMENTS", 21 * 64)  # blocks of 64 weight rows
    computed, missed = _spy_backward(monkeypatch)

    def grads(budget):
        monkeypatch.setattr(linear, "GRAD_KEEP_BYTES", budget)
        hh, ww, bb = (x.clone().requires_grad_(True) for x in (h, w, bias))
        res = exactlogp.linear_selected_logprobs(hh, ww, t, bias=bb, backend=backend, **kw)
        computed.clear()
        loss = res.logprobs.sum() - 0.1 * res.lse.sum()
        (loss if res.entropy is None else loss + 0.5 * res.entropy.sum()).backward()
        return [hh.grad, ww.grad, bb.grad], len(computed)

    kept, once = grads(1 << 30)
    predicted, one_pass = grads(0)
    assert (once, one_pass) == (5, 5) and missed == [None, 0], (once, one_pass, missed)
    for a, b in zip(kept, predicted, strict=True):
        assert_bitwise_equal(a, b)


def test_no_bound_is_kept_where_no_hidden_gradient_can_flow(monkeypatch):
    """Past the budget the forward keeps a _GridBound only when a hidden gradient can flow:
    not under no_grad (though hidden requires grad), nor for hidden without requires_grad."""
    from exactlogp import linear

    monkeypatch.setattr(linear, "GRAD_KEEP_BYTES", 0)
    built = []
    real = linear._GridBound.__init__
    monkeypatch.setattr(linear._GridBound, "__init__",
                        lambda self, *a: built.append(1) or real(self, *a))  # fmt: skip
    h, w, t = lm_head_inputs(5, 16, 40, torch.bfloat16, seed=2)
    hh = h.clone().requires_grad_(True)
    with torch.no_grad():
        exactlogp.linear_selected_logprobs(hh, w, t)
    exactlogp.linear_selected_logprobs(h, w.clone().requires_grad_(True), t)
    assert built == []
    exactlogp.linear_selected_logprobs(hh, w, t)
    assert built == [1]


def test_a_wrong_prediction_costs_its_rows_a_second_pass_not_bits(monkeypatch):
    """Predictions too high, too low (far below: the slices are clamped) and absent for some
    rows: those rows, and only those, are sliced again from their own logits on the true
    grid; the gradients keep the bits of the kept path."""
    from exactlogp import linear

    h, w, t = lm_head_inputs(13, 40, 200, torch.bfloat16, seed=9)
    computed, missed = _spy_backward(monkeypatch)
    real = linear._DLogits.predicted_top

    def wrong(self, bound):
        top = real(self, bound).clone()
        top[1], top[5], top[6] = top[1] * 4.0, top[5] * 2.0**-60, 0.0
        return top

    def grads(budget):
        monkeypatch.setattr(linear, "GRAD_KEEP_BYTES", budget)
        hh, ww = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
        res = exactlogp.linear_selected_logprobs(hh, ww, t, with_entropy=True)
        computed.clear()
        (res.logprobs.sum() + res.entropy.sum()).backward()
        return [hh.grad, ww.grad], list(computed)

    kept, _ = grads(1 << 30)
    monkeypatch.setattr(linear._DLogits, "predicted_top", wrong)
    predicted, rows = grads(0)
    assert missed[-1] == 3 and rows == [13, 3], (missed, rows)
    for a, b in zip(kept, predicted, strict=True):
        assert_bitwise_equal(a, b)


# --- accuracy ---


def _fp64(h, w, t, bias=None, scale=1.0, tau=1.0):
    z = (h.double() @ w.double().T + (0.0 if bias is None else bias.double())) * scale / tau
    lp = torch.log_softmax(z, -1)
    return lp.gather(-1, t.unsqueeze(-1)).squeeze(-1), -(lp.exp() * lp).sum(-1)


@pytest.mark.parametrize("hidden", [256, 2048])
def test_logprobs_and_entropy_are_within_1e4_of_fp64_where_bf16_logits_are_not(hidden):
    """Realistic rows (RMS-normed hidden, confident and flat rows): the exact head is
    within 1e-4 (measured: ~1e-6) of the fp64 GEMM + fp64 log-softmax of the same bf16
    inputs; the common pipeline (bf16 GEMM output, fp32 log_softmax) is off by ~1e-2."""
    h, w, t = lm_head_inputs(64, hidden, 4000, torch.bfloat16, seed=6)
    lp64, ent64 = _fp64(h, w, t)
    res = exactlogp.linear_selected_logprobs(h, w, t, with_entropy=True)
    err_lp = (res.logprobs.double() - lp64).abs().max().item()
    err_ent = (res.entropy.double() - ent64).abs().max().item()
    assert err_lp < 1e-4 and err_ent < 1e-4, (err_lp, err_ent)
    common = torch.log_softmax((h @ w.T).float(), -1).gather(-1, t.unsqueeze(-1)).squeeze(-1)
    assert (common.double() - lp64).abs().max().item() > 10 * err_lp


def test_gradients_match_fp64_autograd():
    h, w, t = lm_head_inputs(48, 128, 900, torch.float32, seed=7)
    t[3] = -100
    bias = 0.1 * torch.randn(900)
    hh, ww, bb = (x.clone().requires_grad_(True) for x in (h, w, bias))
    res = exactlogp.linear_selected_logprobs(
        hh, ww, t, bias=bb, with_entropy=True, temperature=0.8, logit_scale=1.25
    )
    g = torch.randn(48, generator=torch.Generator().manual_seed(1))
    (g * res.logprobs + 0.3 * res.entropy).sum().backward()
    h64, w64, b64 = (x.double().requires_grad_(True) for x in (h, w, bias))
    scale = float(torch.tensor(1.25, dtype=torch.float32))
    tau = float(torch.tensor(0.8, dtype=torch.float32))
    live = t != -100
    lp, ent = _fp64(h64, w64, t.clamp(min=0), b64, scale, tau)
    (g.double() * lp * live + 0.3 * ent * live).sum().backward()
    for name, ours, ref in (("hidden", hh, h64), ("weight", ww, w64), ("bias", bb, b64)):
        diff = ours.grad.double() - ref.grad
        assert diff.norm() <= 1e-4 * ref.grad.norm(), name
        assert diff.abs().max() <= 1e-4 * ref.grad.abs().max(), name
    assert torch.equal(hh.grad[3], torch.zeros_like(hh.grad[3]))


def test_rows_without_gradient_add_exactly_nothing_even_when_nan():
    h, w, t = lm_head_inputs(24, 64, 300, torch.bfloat16, seed=8)
    t[[2, 9]] = -100
    weights = torch.ones(24)
    weights[15] = 0.0  # a row the loss leaves out

    def grads(hidden):
        hh, ww = hidden.clone().requires_grad_(True), w.clone().requires_grad_(True)
        res = exactlogp.linear_selected_logprobs(hh, ww, t, validate=False)
        (torch.where(weights > 0, res.logprobs, 0.0)).sum().backward()
        return hh.grad, ww.grad

    clean = grads(h)
    poisoned = h.clone()
    poisoned[[2, 9, 15]] = float("nan")
    dirty = grads(poisoned)
    assert torch.isfinite(dirty[1]).all()
    assert_bitwise_equal(dirty[1], clean[1], "weight gradient")
    live = [i for i in range(24) if i not in (2, 9, 15)]
    assert_bitwise_equal(dirty[0][live], clean[0][live], "hidden gradient, other rows")
    assert torch.equal(dirty[0][[2, 9, 15]], torch.zeros_like(dirty[0][[2, 9, 15]]))


def test_adversarial_values_agree_between_backends():
    """Wide exponent ranges, zeros, subnormals, the largest bf16, H not a multiple of
    anything: the reference (int64) and the CPU backend (fp64 GEMM) give the same bits."""
    gen = torch.Generator().manual_seed(9)
    h = torch.randn(9, 131, generator=gen) * torch.logspace(-30, 30, 131).unsqueeze(0)
    w = torch.randn(50, 131, generator=gen) * torch.logspace(20, -20, 131).unsqueeze(0)
    h[0] = 0.0
    h[1, ::3] = 1e-40  # subnormal in fp32
    w[3] = 0.0
    bh, bw = h.to(torch.bfloat16), w.to(torch.bfloat16)
    bh[2, 0] = torch.finfo(torch.bfloat16).max
    bw[4, 1] = -torch.finfo(torch.bfloat16).max
    for hh, ww in ((h, w), (bh, bw)):
        a = exactlogp.linear_logits(hh, ww, backend="reference")
        b = exactlogp.linear_logits(hh, ww, backend="cpu")
        assert_bitwise_equal(a, b)


def test_bad_arguments_name_the_argument():
    h, w, t = lm_head_inputs(4, 16, 50, torch.bfloat16, seed=10)
    call = exactlogp.linear_selected_logprobs
    with pytest.raises(TypeError, match="weight dtype torch.float32 must equal hidden dtype"):
        call(h, w.float(), t)
    with pytest.raises(
        ValueError, match=r"weight shape \(50, 15\) must be \(V_local, H\) with H = 16"
    ):
        call(h, w[:, :15], t)
    with pytest.raises(ValueError, match=r"bias shape \(49,\) must be \(V_local,\)"):
        call(h, w, t, bias=torch.zeros(49))
    with pytest.raises(ValueError, match="logit_scale must be finite and > 0.*softcap"):
        call(h, w, t, logit_scale=float("inf"))
    with pytest.raises(ValueError, match=r"target shape \(3,\) must equal hidden shape"):
        call(h, w, t[:3])
    with pytest.raises(TypeError, match="hidden must be bfloat16, float16 or float32"):
        call(h.double(), w.double(), t)
    with pytest.raises(ValueError, match=r"hidden has a hidden size of 0 \(shape \(4, 0\)\)"):
        call(h[:, :0], w[:, :0], t)
    with pytest.raises(ValueError, match=r"hidden has a hidden size of 0"):
        exactlogp.linear_logits(h[:, :0], w[:, :0])
    meta = torch.empty(4, 16, dtype=torch.bfloat16, device="meta")
    with pytest.raises(ValueError, match=r"hidden is a meta tensor \(shape \(4, 16\), no values\)"):
        call(meta, w.to("meta"), t.to("meta"))
    with pytest.raises(ValueError, match=r"vocab_parallel_logits is a meta tensor"):
        exactlogp.selected_logprobs(torch.empty(4, 9, device="meta"), t.to("meta"))


def test_the_heads_errors_name_its_own_logits():
    """The fused head has no vocab_parallel_logits argument: its row and shard errors name
    its logits, hidden @ weight.T."""
    h, w, t = lm_head_inputs(4, 16, 50, torch.float32, seed=11)
    call = exactlogp.linear_selected_logprobs
    bad = t.clone()
    bad[2] = 50
    with pytest.raises(ValueError, match=r"target\[2\] = 50 is not a column of the logits "
                       r"hidden @ weight\.T, which holds the whole vocabulary \[0, 50\)"):  # fmt: skip
        call(h, w, bad)
    with pytest.raises(ValueError, match=r"vocab_size=60 is larger than the 50 columns of the "
                       r"logits hidden @ weight\.T"):  # fmt: skip
        call(h, w, t, vocab_size=60)
    nan = h.clone()
    nan[1, 3] = float("nan")
    with pytest.raises(ValueError, match=r"the logits hidden @ weight\.T row\[1\] has 50 NaN"):
        call(nan, w, t)


@pytest.mark.parametrize("hidden", [256, 2048])
def test_fp32_logits_are_within_half_an_ulp(hidden):
    """fp32 hidden states and weights (section 12 of docs/numerics.md): every logit is within
    0.5 ulp32 of the exact dot product (the fp64 reference's own error, H 2^-53 sum |h||W|,
    added) -- contract v1's 20-bit grid was not (tests/test_linear_v2.py: bit for bit)."""
    h, w, _ = lm_head_inputs(16, hidden, 500, torch.float32, seed=7)
    z = exactlogp.linear_logits(h, w).double()
    hd, wd = h.double(), w.double()
    exact = hd @ wd.T
    ulp = torch.from_numpy(np.spacing(z.float().abs().numpy())).double()
    bound = 0.5 * ulp + hidden * 2.0**-53 * (hd.abs() @ wd.abs().T)
    err = (z - exact).abs()
    assert (err <= bound).all(), float((err - bound).max())
    assert float(err.max()) > 0  # not all exact: the bound is what is tested


def test_five_diagonal_int8_gemms_give_the_exact_integers(monkeypatch):
    """linear_contract.diagonal_exact_dot (the int8 tensor-core route: five int8 GEMMs with
    int32 accumulation, torch._int_mm) equals exact_dot's int64 arithmetic: operands at
    +-2^20, one-row and one-column shapes, and K split into chunks (a small chunk here, so
    that the split and its int64 sum run)."""
    gen = torch.Generator().manual_seed(8)
    top = 1 << 20
    for m, p, k in ((1, 3, 1), (3, 5, 7), (17, 9, 64), (20, 31, 200)):
        a = torch.randint(-top, top + 1, (m, k), generator=gen).double()
        c = torch.randint(-top, top + 1, (p, k), generator=gen).double()
        a[0], c[0] = -top, -top  # the largest products, all of one sign
        a3, c3 = lc.diagonal_layout(a, reverse=True), lc.diagonal_layout(c, reverse=False)
        assert a3.dtype == torch.int8 and a3.shape == (m, 3 * k)
        assert torch.equal(lc.diagonal_exact_dot(a3, c3), lc.exact_dot(a, c)), (m, p, k)
    monkeypatch.setattr(lc, "DIAGONAL_MAX_K", 8)
    a = torch.randint(-top, top + 1, (5, 29), generator=gen).double()
    c = torch.randint(-top, top + 1, (6, 29), generator=gen).double()
    a3, c3 = lc.diagonal_layout(a, reverse=True), lc.diagonal_layout(c, reverse=False)
    assert torch.equal(lc.diagonal_exact_dot(a3, c3), lc.exact_dot(a, c))
