"""Semantics of selected_logprobs and its clear errors for every bad input."""

import math

import pytest
import torch

import exactlogp
from exactlogp import selected_logprobs
from exactlogp.testing import assert_bitwise_equal, llm_like_logits


@pytest.fixture
def batch():
    return llm_like_logits(6, 97, torch.float32, seed=11)


def run(x, t, **kw):
    return selected_logprobs(x, t, **kw)


# --- semantics ---


def test_result_type_shapes_and_contract(batch):
    x, t = batch
    res = run(x, t)
    assert isinstance(res, exactlogp.LogprobResult)
    assert res.entropy is None
    assert res.logprobs.dtype == res.lse.dtype == torch.float32
    assert res.logprobs.shape == res.lse.shape == t.shape
    assert exactlogp.CONTRACT == "exactlogp-v2"
    assert run(x, t, with_entropy=True).entropy.shape == t.shape


def test_leading_dims_are_flattened_rows(batch):
    x, t = batch
    flat = run(x, t, with_entropy=True)
    nested = run(x.view(2, 3, -1), t.view(2, 3), with_entropy=True)
    for a, b in zip(nested, flat, strict=True):
        assert_bitwise_equal(a.reshape(-1), b)


def test_inputs_are_never_mutated(batch):
    x, t = batch
    x = x.to(torch.bfloat16).requires_grad_(True)
    mask = torch.rand(x.shape) > 0.2
    mask[torch.arange(6), t] = True
    tau = torch.full(t.shape, 0.7)
    before = [v.detach().clone() for v in (x, t, mask, tau)]
    res = run(x, t, keep_mask=mask, temperature=tau, with_entropy=True)
    (res.logprobs.sum() + res.entropy.sum() + res.lse.sum()).backward()
    for v, b in zip((x, t, mask, tau), before, strict=True):
        assert_bitwise_equal(v.detach(), b)


def test_ignore_index_rows_are_zero_with_zero_gradient(batch):
    x, t = batch
    t = t.clone()
    t[[1, 4]] = -100
    x = x.clone().requires_grad_(True)
    res = run(x, t, with_entropy=True)
    (res.logprobs.sum() + res.entropy.sum() + 2 * res.lse.sum()).backward()
    for out in res:
        assert_bitwise_equal(out[[1, 4]], torch.zeros(2))
    assert_bitwise_equal(x.grad[[1, 4]], torch.zeros(2, x.shape[1]))
    assert (x.grad[[0, 2, 3, 5]] != 0).any()
    other = t.clone()
    other[[1, 4]] = 7
    custom = run(x.detach(), other.masked_fill(t == -100, 5), ignore_index=5)
    assert_bitwise_equal(custom.logprobs[[0, 2, 3, 5]], res.logprobs[[0, 2, 3, 5]])


def test_ignored_rows_do_not_use_their_temperature(batch):
    x, t = batch
    t = t.clone()
    t[[0, 3]] = -100
    tau = torch.tensor([0.0, 0.5, 0.9, -1.0, 1.2, 2.0])  # bad values only on ignored rows
    x = x.clone().requires_grad_(True)
    res = run(x, t, temperature=tau, with_entropy=True)
    (res.logprobs.sum() + res.entropy.sum() + res.lse.sum()).backward()
    assert_bitwise_equal(x.grad[[0, 3]], torch.zeros(2, x.shape[1]))
    assert torch.isfinite(x.grad).all()


def test_keep_mask_equals_dropping_the_columns(batch):
    x, t = batch
    keep = torch.ones(x.shape[1], dtype=torch.bool)
    keep[::3] = False
    keep[t] = True
    compact_t = torch.cumsum(keep, 0)[t] - 1
    masked = run(x, t, keep_mask=keep.expand_as(x).clone(), with_entropy=True)
    compact = run(x[:, keep].contiguous(), compact_t, with_entropy=True)
    for a, b in zip(masked, compact, strict=True):
        assert_bitwise_equal(a, b)


def test_padding_columns_never_take_part(batch):
    x, t = batch
    garbage = torch.tensor([float("nan"), float("inf"), 1e30, -1e30, 88.0])
    padded = torch.cat([x, garbage.expand(x.shape[0], -1)], dim=1)
    a = run(padded, t, vocab_size=x.shape[1], with_entropy=True)
    b = run(x, t, with_entropy=True)
    for u, v in zip(a, b, strict=True):
        assert_bitwise_equal(u, v)


def test_temperature_is_fp32_division_and_per_row_equals_rows_alone(batch):
    x, t = batch
    x = x.to(torch.bfloat16)
    tau = 0.7
    a = run(x, t, temperature=tau)
    b = run(x.float() / torch.tensor(tau, dtype=torch.float32), t)
    assert_bitwise_equal(a.logprobs, b.logprobs)
    taus = torch.tensor([0.3, 0.5, 0.7, 1.0, 1.3, 2.0])
    per_row = run(x, t, temperature=taus, with_entropy=True)
    for i in range(6):
        alone = run(x[i : i + 1], t[i : i + 1], temperature=float(taus[i]), with_entropy=True)
        for u, v in zip(per_row, alone, strict=True):
            assert_bitwise_equal(u[i : i + 1], v)


def test_minus_inf_logits_are_valid_and_excluded(batch):
    x, t = batch
    x = x.clone()
    x[:, 0] = float("-inf")
    t = t.clone()
    t[0] = 0  # a target at -inf has probability 0
    res = run(x, t)
    assert res.logprobs[0] == float("-inf")
    assert torch.isfinite(res.logprobs[1:]).all()


def test_module_form_matches_the_function(batch):
    x, t = batch
    module = exactlogp.SelectedLogprobs(with_entropy=True, temperature=0.9)
    for a, b in zip(module(x, t), run(x, t, with_entropy=True, temperature=0.9), strict=True):
        assert_bitwise_equal(a, b)


def test_empty_batch():
    res = run(torch.zeros(0, 10), torch.zeros(0, dtype=torch.long), with_entropy=True)
    assert res.logprobs.shape == res.entropy.shape == (0,)


# --- validate=False: NaN in the bad row only ---


def test_bad_rows_give_nan_only_there_without_validation(batch):
    x, t = batch
    x, t = x.clone(), t.clone()
    x[1, 5] = float("nan")
    x[2, :] = float("-inf")
    t[3] = 1000  # out of range
    x[4, 9] = float("inf")
    tau = torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0, -2.0])
    x = x.requires_grad_(True)
    res = run(x, t, validate=False, with_entropy=True, temperature=tau)
    bad = [1, 2, 3, 4, 5]
    for out in res:
        assert torch.isnan(out[bad]).all()
    clean = run(x.detach()[:1], t[:1], with_entropy=True)
    for u, v in zip(res, clean, strict=True):
        assert_bitwise_equal(u[:1], v)
    # the loss reads row 0 only: the bad rows get an exact +0 gradient, not NaN
    res.logprobs[0].backward()
    assert torch.isfinite(x.grad[0]).all()
    assert_bitwise_equal(x.grad[bad], torch.zeros_like(x.grad[bad]))
    alone = x.grad[0].clone()
    # a gradient flowing into a bad row makes that row NaN; row 0 is bitwise unchanged
    x.grad = None
    res = run(x, t, validate=False, with_entropy=True, temperature=tau)
    (res.logprobs[0] + res.logprobs[1] + res.entropy[5]).backward()
    assert torch.isnan(x.grad[[1, 5]]).all()
    assert_bitwise_equal(x.grad[[2, 3, 4]], torch.zeros_like(x.grad[[2, 3, 4]]))
    assert_bitwise_equal(x.grad[0], alone)


# --- clear errors ---


def _raises(exc, match, x, t, **kw):
    with pytest.raises(exc, match=match):
        run(x, t, **kw)


def test_argument_type_errors(batch):
    x, t = batch
    _raises(TypeError, "vocab_parallel_logits must be a torch.Tensor", x.tolist(), t)
    _raises(TypeError, "bfloat16, float16 or float32, got torch.float64", x.double(), t)
    _raises(TypeError, "integer token ids, got dtype torch.float32", x, t.float())
    _raises(TypeError, "integer token ids, got dtype torch.bool", x, t > 3)
    _raises(TypeError, "keep_mask must be a bool tensor, got torch.int64", x, t, keep_mask=t)
    _raises(TypeError, "temperature must be a float or a tensor, got str", x, t, temperature="1")
    _raises(TypeError, "temperature tensor must be floating point", x, t, temperature=t)
    _raises(TypeError, "with_entropy must be a bool", x, t, with_entropy=1)
    _raises(TypeError, "vocab_size must be an int or None, got float", x, t, vocab_size=97.0)
    _raises(TypeError, "target must be a torch.Tensor, got list", x, t.tolist())


def test_argument_value_errors(batch):
    x, t = batch
    _raises(ValueError, r"target shape \(5,\) must equal .* \(6,\)", x, t[:5])
    _raises(ValueError, r"keep_mask shape \(6, 96\)", x, t, keep_mask=torch.ones(6, 96, dtype=bool))
    _raises(ValueError, r"temperature tensor shape \(3,\)", x, t, temperature=torch.ones(3))
    for tau in (0.0, -1.0, math.nan, math.inf, 1e-50, 1e40):
        _raises(ValueError, "temperature must be finite and > 0 in float32", x, t, temperature=tau)
    _raises(ValueError, r"vocab_size must be <= 1048576, got 1048577", x, t, vocab_size=2**20 + 1)
    _raises(ValueError, r"vocab_size must be >= 1, got 0", x, t, vocab_size=0)
    _raises(ValueError, r"vocab_start must be >= 0, got -1", x, t, vocab_start=-1)
    _raises(ValueError, r"ends at column 1048673 > 2\^20", torch.zeros(1, 2**20 + 97), t[:1])
    _raises(ValueError, "backend must be 'auto' or one of", x, t, backend="cuda-magic")
    _raises(ValueError, "target is on meta but must be on cpu", x, t.to("meta"))


def test_data_errors_name_the_row_and_value(batch):
    x, t = batch
    bad_t = t.clone()
    bad_t[2] = 90
    _raises(
        ValueError, r"target\[2\] = 90 is outside \[0, vocab_size=90\)", x, bad_t, vocab_size=90
    )
    bad_t[2] = -3
    _raises(ValueError, r"target\[2\] = -3 is outside", x, bad_t)
    bad_t[2] = 200
    _raises(
        ValueError,
        r"target\[2\] = 200 is not a column of vocab_parallel_logits, which holds the whole "
        r"vocabulary \[0, 97\) \(there is no tensor-parallel group\)",
        x,
        bad_t,
    )
    mask = torch.ones_like(x, dtype=torch.bool)
    mask[4, t[4]] = False
    _raises(
        ValueError,
        rf"target\[4\] = {int(t[4])} is a column that keep_mask drops",
        x,
        t,
        keep_mask=mask,
    )
    y = x.clone()
    y[3, 7] = float("nan")
    y[3, 8] = float("inf")
    _raises(ValueError, r"row\[3\] has 2 NaN or \+inf", y, t)
    y = x.clone()
    y[5] = float("-inf")
    _raises(ValueError, r"row\[5\] has no valid column", y, t)
    tau = torch.ones(6)
    tau[1] = 0.0
    _raises(ValueError, r"temperature\[1\] = 0.0 must be finite and > 0", x, t, temperature=tau)
    y = x.view(2, 3, -1).clone()
    y[1, 2, 0] = float("nan")
    y[1, 1, 0] = float("nan")
    _raises(ValueError, r"row\[1, 1\] .* \(1 more bad row\)", y, t.view(2, 3))


def test_single_process_edges_are_errors(batch):
    x, t = batch
    # without a TP group the logits are the whole vocabulary
    _raises(ValueError, r"vocab_start=5 but there is no tensor-parallel group", x, t, vocab_start=5)
    _raises(ValueError, r"vocab_size=98 is larger than the 97 columns", x, t, vocab_size=98)
    # unsigned ids would wrap around (uint64) or cannot be ignore_index
    for dtype in (torch.uint8, torch.uint16, torch.uint32, torch.uint64):
        _raises(TypeError, rf"signed integer token ids .* got dtype {dtype}", x, t.to(dtype))
    # Python ints beyond int64 name the argument instead of overflowing somewhere inside
    _raises(
        ValueError,
        r"ignore_index must be <= 9223372036854775807, got 1180591620717411303424",
        x,
        t,
        ignore_index=2**70,
    )
    _raises(
        ValueError, r"ignore_index must be >= -9223372036854775808", x, t, ignore_index=-(2**64)
    )
    _raises(ValueError, r"vocab_start must be <= 16777216", x, t, vocab_start=2**70)
    _raises(ValueError, r"vocab_size must be <= 1048576", x, t, vocab_size=2**70)
    # the temperature is not differentiated: a tensor that asks for it is refused
    tau = torch.ones(6, requires_grad=True)
    _raises(ValueError, r"temperature is a tensor that requires grad", x, t, temperature=tau)
    assert torch.isfinite(run(x, t, temperature=tau.detach()).logprobs).all()
    with torch.no_grad():
        run(x, t, temperature=tau)


def test_double_backward_is_refused_loudly(batch):
    x, t = batch
    x = x.clone().requires_grad_(True)
    res = run(x, t, with_entropy=True)
    (g,) = torch.autograd.grad(res.logprobs.sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="its gradient cannot be differentiated again"):
        g.sum().backward()


def test_temperature_overflow_to_inf_is_reported(batch):
    x, t = batch
    y = x.clone()
    y[0, 0] = 3e38
    _raises(
        ValueError,
        r"row\[0\] has 1 NaN or \+inf value\(s\) \(after the temperature\)",
        y,
        t,
        temperature=0.5,
    )


def test_calls_without_a_gradient_share_nothing_they_return():
    """A call without a gradient may keep its gradient statistics in per-thread scratch
    (the CPU backend's small-call path): what it returns, and a gradient taken across
    such calls, stay as they were."""
    x1, t1 = llm_like_logits(3, 200, torch.bfloat16, seed=41)
    x2, t2 = llm_like_logits(3, 200, torch.bfloat16, seed=42)
    first = selected_logprobs(x1, t1, with_entropy=True, backend="cpu")
    kept = [v.clone() for v in first]
    xg = x1.clone().requires_grad_(True)
    res = selected_logprobs(xg, t1, with_entropy=True, backend="cpu")  # statistics kept
    selected_logprobs(x2, t2, with_entropy=True, backend="cpu")  # scratch rewritten
    (res.logprobs.sum() + res.entropy.sum()).backward()
    for got, want in zip(first, kept, strict=True):
        assert_bitwise_equal(got, want, "an earlier call's outputs")
    ref = x1.clone().requires_grad_(True)
    want = selected_logprobs(ref, t1, with_entropy=True, backend="reference")
    (want.logprobs.sum() + want.entropy.sum()).backward()
    assert_bitwise_equal(xg.grad, ref.grad, "a gradient across a call without one")
