"""Processed logprobs: the exact min-p / top-k / top-p cut (docs/numerics.md section 13).

Checked against a brute-force implementation of the definition (Python integers and
fractions, one row at a time), bitwise across TP degrees 1..8 with uneven shards in one
gloo world, across batches, repeats and backends; gradients, bad input and ranks that
disagree.
"""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch
import torch.distributed as dist

from exactlogp import (
    contract,
    processed_logprobs,
    sample,
    sampling_mask,
    selected_logprobs,
)
from exactlogp.cut import blocks, integers
from exactlogp.testing import assert_bitwise_equal, llm_like_logits, run_gloo_world

# --- the definition, one row at a time ---


def _fp32(v: float) -> float:
    return contract.fp32_temperature(v)


def _row_param(value, i):
    if isinstance(value, torch.Tensor):
        return value.reshape(-1)[i].item()
    return value


def brute_keep(x, temperature=1.0, top_k=None, top_p=None, min_p=None, vocab_size=None):
    """(N, V) bool: the kept set of section 13, from its text."""
    n, v = x.shape
    real = v if vocab_size is None else min(v, vocab_size)
    keep = torch.zeros(n, v, dtype=torch.bool)
    for i in range(n):
        tau = _fp32(_row_param(temperature, i))
        greedy = tau == 0
        y = contract.scaled_logits(x[i : i + 1, :real], 1.0 if greedy else tau)[0]
        vals = y.tolist()
        bad = [j for j, a in enumerate(vals) if math.isnan(a) or a == math.inf]
        finite = [a for a in vals if math.isfinite(a)]
        if greedy or not finite:
            keep[i, :real] = True
            continue
        big_m = max(finite)
        d = torch.tensor([a - big_m for a in vals], dtype=torch.float64)  # fl64(y - M)
        term = (d >= -64) & (d <= 0)
        e = torch.where(term, contract.exp_c(torch.where(term, d, 0.0)), 0.0)
        hi, lo = contract.quantize(e)
        q = [h * 2**42 + low for h, low in zip(hi.tolist(), lo.tolist(), strict=True)]
        cand = [j for j in range(real) if j not in bad]
        m, k, p = (_row_param(a, i) for a in (min_p, top_k, top_p))
        if m is not None and m != 0:
            cand = [j for j in cand if q[j] >= Fraction(_fp32(m)) * 2**84]
        if k is not None and k > 0 and len(cand) > k:
            kth = sorted((vals[j] for j in cand), reverse=True)[k - 1]
            cand = [j for j in cand if vals[j] >= kth]
        if p is not None and _fp32(p) != 1:
            need = Fraction(_fp32(p)) * sum(q[j] for j in cand)
            total = 0
            for value in sorted({vals[j] for j in cand}, reverse=True):
                total += sum(q[j] for j in cand if vals[j] == value)
                if total >= need:
                    break
            cand = [j for j in cand if vals[j] >= value]
        for j in cand + bad:
            keep[i, j] = True
    return keep


def tie_logits(dtype=torch.float32):
    """Rows of few distinct values: ties at every threshold."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randint(0, 6, (6, 40), generator=gen).to(torch.float32) * 0.75
    x[1] = 2.0  # one value only
    x[2, :10] = 9.0  # ten tied maxima
    return x.to(dtype)


CASES = {
    "topk": dict(top_k=7),
    "topk_tie": dict(top_k=3),
    "k_larger_than_v": dict(top_k=10_000),
    "topp": dict(top_p=0.8),
    "topp_tiny": dict(top_p=1e-6),
    "topp_one": dict(top_p=1.0),
    "minp": dict(min_p=0.05),
    "minp_zero": dict(min_p=0.0, top_k=-1),
    "minp_one": dict(min_p=1.0),
    "all": dict(top_k=12, top_p=0.9, min_p=0.01, temperature=0.7),
    "per_row": "per_row",
}


def _per_row_kwargs(n):
    gen = torch.Generator().manual_seed(9)
    return dict(
        top_k=torch.randint(-1, 15, (n,), generator=gen),
        top_p=torch.rand(n, generator=gen).clamp(min=0.05),
        min_p=torch.rand(n, generator=gen) * 0.1,
        temperature=torch.tensor([0.0, 0.5, 1.0, 1.3, 0.0, 2.0] * (n // 6 + 1))[:n],
    )


def _kwargs(case, n):
    return _per_row_kwargs(n) if CASES[case] == "per_row" else CASES[case]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("case", list(CASES))
def test_mask_matches_the_definition(case, dtype):
    x, _ = llm_like_logits(6, 96, dtype, seed=3)
    x = torch.cat([x, tie_logits(dtype)[:, :96].repeat(1, 3)[:, :96]])
    kw = _kwargs(case, x.shape[0])
    got = sampling_mask(x, **kw)
    want = brute_keep(x, **kw)
    assert torch.equal(got.keep_mask, want), case
    # the compact form says the same
    y = contract.scaled_logits(x, 1.0)
    assert torch.equal(got.keep_mask.any(-1), torch.ones(x.shape[0], dtype=torch.bool))
    cut = got.threshold.unsqueeze(-1)
    assert bool((got.keep_mask <= (y * 0 + 1 > 0)).all())
    t = kw.get("temperature", 1.0)
    if not isinstance(t, torch.Tensor) and t != 0:
        y = contract.scaled_logits(x, _fp32(t))
        assert bool((~got.keep_mask | (y >= cut)).all())


def test_boundary_rows_ties_inf_padding_and_greedy():
    x = tie_logits()
    x[3, 5:] = float("-inf")  # -inf columns: mass 0, ranked lowest
    x[4, :] = float("-inf")
    x[4, 7] = 1.0  # one finite column
    padded = torch.cat([x, torch.full((6, 5), float("nan"))], dim=1)  # padding: never read
    tau = torch.tensor([1.0, 0.0, 0.5, 1.0, 1.0, 0.0])
    for kw in (dict(top_k=2), dict(top_p=0.5), dict(top_k=4, top_p=0.3, min_p=0.2)):
        got = sampling_mask(padded, vocab_size=40, temperature=tau, **kw)
        assert torch.equal(got.keep_mask, brute_keep(padded, tau, vocab_size=40, **kw)), kw
        assert not got.keep_mask[:, 40:].any()
        assert got.keep_mask[1, :40].all() and got.keep_mask[5, :40].all()  # greedy rows
        assert torch.equal(got.greedy, tau == 0)
    # top-p alone whose mass reaches p only below M - 16: every column is cut again
    wide = torch.full((2, 3000), -16.5)
    wide[:, 7] = 0.0
    wide[1, 100:200] = -30.0
    for top_p in (0.99999, 0.5, torch.tensor([0.99999, 0.99999])):
        got = sampling_mask(wide, top_p=top_p)
        want = brute_keep(wide, top_p=top_p)
        assert torch.equal(got.keep_mask, want)
    assert int(want[0].sum()) == 3000 and int(want[1].sum()) == 2900
    # top-k 3 on a row whose 3rd value is tied keeps every tie
    got = sampling_mask(x[2:3], top_k=3).keep_mask
    assert int(got.sum()) == 10


def test_processed_logprobs_is_the_log_softmax_over_the_kept_set():
    x, t = llm_like_logits(12, 200, torch.bfloat16, seed=4)
    kw = dict(top_k=30, top_p=0.85, min_p=0.002, temperature=0.8)
    keep = brute_keep(x, **kw)
    t[0] = int((~keep[0]).nonzero()[0])  # a target the cut drops
    t[1] = -100
    xg = x.clone().requires_grad_(True)
    res = processed_logprobs(xg, t, with_entropy=True, **kw)
    lp, ent, lse = res  # three values
    assert bool(res.dropped[0]) and int(res.num_dropped) == 1
    assert lp[0] == float("-inf") and lp[1] == 0
    t_ok = t.clone()
    t_ok[0] = int(x[0].float().argmax())
    xr = x.clone().requires_grad_(True)
    ref = selected_logprobs(xr, t_ok, keep_mask=keep, temperature=0.8, with_entropy=True)
    assert_bitwise_equal(lp[1:], ref.logprobs[1:], "logprobs")
    assert_bitwise_equal(ent, ref.entropy, "entropy")
    assert_bitwise_equal(lse, ref.lse, "lse")
    # gradients: kept columns only; the dropped target's row gets entropy / lse terms only
    (lp[1:].sum() + ent.sum() - 0.5 * lse.sum()).backward()
    (ref.logprobs[1:].sum() + ref.entropy.sum() - 0.5 * ref.lse.sum()).backward()
    assert_bitwise_equal(xg.grad, xr.grad, "gradient")
    assert bool((xg.grad[~keep] == 0).all())
    # against fp64 truth over the kept set
    y = x.double() / _fp32(0.8)
    truth = torch.log_softmax(y.masked_fill(~keep, float("-inf")), -1)
    rows = torch.arange(2, 12)
    err = (lp[rows].double() - truth[rows, t[rows]]).abs()
    assert bool((err <= 1e-6 * truth[rows, t[rows]].abs() + 1e-12).all())


def test_greedy_rows_and_batch_repeat_backend_invariance():
    x, t = llm_like_logits(10, 150, torch.bfloat16, seed=6)
    tau = torch.tensor([0.0, 0.7] * 5)
    kw = dict(top_k=torch.arange(10) * 3 - 1, top_p=0.9, temperature=tau)
    full = processed_logprobs(x, t, with_entropy=True, **kw)
    plain = selected_logprobs(x[0::2], t[0::2], with_entropy=True)  # T = 0: no cut, T = 1
    assert_bitwise_equal(full.logprobs[0::2], plain.logprobs, "greedy rows")
    again = processed_logprobs(x, t, with_entropy=True, **kw)
    assert_bitwise_equal(again.logprobs, full.logprobs, "repeat")
    perm = torch.randperm(10, generator=torch.Generator().manual_seed(1))
    kwp = dict(top_k=kw["top_k"][perm], top_p=0.9, temperature=tau[perm])
    shuffled = processed_logprobs(x[perm], t[perm], with_entropy=True, **kwp)
    assert_bitwise_equal(shuffled.logprobs, full.logprobs[perm], "batch order")
    assert_bitwise_equal(shuffled.entropy, full.entropy[perm], "batch order entropy")
    for backend in ("reference", "cpu", "triton"):
        other = processed_logprobs(x, t, with_entropy=True, backend=backend, **kw)
        assert_bitwise_equal(other.logprobs, full.logprobs, backend)
        assert_bitwise_equal(other.entropy, full.entropy, backend + " entropy")


def test_sample_is_the_inverse_cdf_on_the_exact_masses():
    x, _ = llm_like_logits(8, 120, torch.float32, seed=8)
    x[3, :] = 1.0  # all tied: greedy picks id 0
    kw = dict(top_k=40, top_p=0.95, temperature=torch.tensor([1.0, 0.5, 0.0, 0.0, 1, 1, 1, 1]))
    u = torch.rand(8, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    ids = sample(x, uniforms=u, **kw)
    keep = brute_keep(x, **kw)
    for i in range(8):
        if i in (2, 3):
            assert int(ids[i]) == int(x[i].argmax())  # lowest id among tied maxima
            continue
        y = contract.scaled_logits(x[i : i + 1], _fp32(kw["temperature"][i].item()))[0]
        d = y.double() - y.max().double()
        term = keep[i] & (d >= -64)
        hi, lo = contract.quantize(torch.where(term, contract.exp_c(torch.where(term, d, 0.0)), 0))
        q = [h * 2**42 + low for h, low in zip(hi.tolist(), lo.tolist(), strict=True)]
        num, den = float(u[i]).as_integer_ratio()
        target = (sum(q) * num) // den
        j = next(j for j in range(len(q)) if sum(q[: j + 1]) > target)
        assert int(ids[i]) == j and keep[i, j]
    assert torch.equal(sample(x, uniforms=u, **kw), ids)
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    assert torch.equal(sample(x, generator=g1, top_p=0.5), sample(x, generator=g2, top_p=0.5))


@pytest.mark.parametrize(
    "kw, error, text",
    [
        (dict(top_k=2.5), TypeError, "top_k"),
        (dict(top_k=-2), ValueError, "top_k"),
        (dict(top_k=torch.tensor([1.0] * 4)), TypeError, "top_k"),
        (dict(top_k=torch.tensor([1, -3, 1, 1])), ValueError, "top_k"),
        (dict(top_p=0.0), ValueError, "top_p"),
        (dict(top_p=1.5), ValueError, "top_p"),
        (dict(top_p=float("nan")), ValueError, "top_p"),
        (dict(top_p=torch.tensor([0.5, 0.0, 1.0, 1.0])), ValueError, "top_p"),
        (dict(min_p=-0.1), ValueError, "min_p"),
        (dict(min_p=1.01), ValueError, "min_p"),
        (dict(min_p=torch.tensor([0.5, 0.1])), ValueError, "min_p"),
        (dict(top_k=torch.tensor([[1, 2]])), ValueError, "top_k"),
        (dict(temperature=-1.0), ValueError, "temperature"),
        (dict(temperature=1e-50), ValueError, r"temperature .*\(0: a greedy row\), got 1e-50"),
        (dict(top_p=torch.full((4,), 0.5, requires_grad=True)), ValueError,
         "top_p is a tensor that requires grad"),
        (dict(min_p=torch.full((4,), 0.1, requires_grad=True)), ValueError,
         "min_p is a tensor that requires grad"),
        (dict(temperature=torch.tensor([1.0, -1.0, 1.0, 1.0])), ValueError,
         r"temperature\[1\] = -1.0 must be finite and > 0"),
        (dict(temperature=torch.tensor([1.0, 1.0, 1e-50, 1.0], dtype=torch.float64)),
         ValueError, r"temperature\[2\] = 0.0 must be finite and > 0"),
    ],
)  # fmt: skip
def test_bad_input_is_a_clear_error(kw, error, text):
    """Every function of the cut raises the same error for the same bad argument (a
    per-row temperature that is not 0 and not > 0 in fp32 included: a float64 1e-50 is no
    greedy row)."""
    x, t = llm_like_logits(4, 50, torch.float32, seed=1)
    with pytest.raises(error, match=text):
        processed_logprobs(x, t, **kw)
    with pytest.raises(error, match=text):
        sampling_mask(x, **kw)
    with pytest.raises(error, match=text):
        sample(x, **kw)


@pytest.mark.parametrize(
    "bad", ["tau -1", "tau inf", "tau nan", "tau 1e-50", "nan", "inf", "-inf row"]
)
def test_a_row_the_cut_cannot_serve_is_never_a_silent_token(bad):
    """sample and sampling_mask report the rows processed_logprobs reports -- a bad
    per-row temperature, a NaN or +inf value, no valid column -- as an error (validate=
    True) or as -1 / an empty keep row with a NaN threshold in that row alone."""
    x, t = llm_like_logits(4, 300, torch.float32, seed=2)
    tau = torch.full((4,), 0.9, dtype=torch.float64)
    if bad.startswith("tau"):
        tau[1] = float(bad.split()[1])
    elif bad == "-inf row":
        x[1] = float("-inf")
    else:
        x[1, 7] = float(bad)
    kw = dict(temperature=tau, top_k=20, top_p=0.9)
    for fn in (sample, sampling_mask, lambda x, **kw: processed_logprobs(x, t, **kw)):
        with pytest.raises(ValueError, match=r"\[1\]"):
            fn(x, **kw)
    ids = sample(x, validate=False, **kw)
    mask = sampling_mask(x, validate=False, **kw)
    lp = processed_logprobs(x, t, validate=False, **kw).logprobs
    assert int(ids[1]) == -1 and bool(torch.isnan(lp[1]))
    assert not bool(mask.keep_mask[1].any()) and bool(torch.isnan(mask.threshold[1]))
    good = torch.tensor([0, 2, 3])
    clean = llm_like_logits(4, 300, torch.float32, seed=2)[0]
    tau[1] = 0.9
    assert torch.equal(ids[good], sample(clean, temperature=tau, top_k=20, top_p=0.9)[good])
    assert torch.equal(
        mask.keep_mask[good], sampling_mask(clean, **dict(kw, temperature=tau)).keep_mask[good]
    )


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_a_zero_max_is_plus_zero(backend):
    """M of a row whose largest values are -0 and +0 is +0 on every backend (and, in the
    gloo world below, at every TP degree)."""
    x = torch.full((2, 300), -3.0)
    x[0, 10], x[0, 200] = -0.0, 0.0
    x[1, 5] = -0.0
    for kw in (dict(top_k=3), dict(top_p=0.5), {}):
        got = sampling_mask(x, backend=backend, **kw).row_max
        assert got.tolist() == [0.0, 0.0] and not bool(torch.signbit(got).any()), (kw, got)


# --- one gloo world: TP 1, 2, 3, 4, 8 with uneven shards ---

WORLDS = (1, 2, 3, 4, 8)
VOCAB = 509
ROWS = 7


def shard_bounds(world: int) -> list[tuple[int, int]]:
    gen = torch.Generator().manual_seed(world)
    cuts = sorted(torch.randint(0, VOCAB + 1, (world - 1,), generator=gen).tolist())
    if world >= 3:
        cuts[0], cuts[1] = 0, 1  # an empty shard and a shard of width 1
    bounds = [0, *cuts, VOCAB]
    return [(bounds[r], bounds[r + 1]) for r in range(world)]


def world_inputs():
    x, t = llm_like_logits(ROWS, VOCAB, torch.bfloat16, seed=11)
    x[5, ::3] = x[5, 0]  # ties across shards
    kw = dict(
        top_k=torch.tensor([5, 0, 40, -1, 9, 7, 3]),
        top_p=torch.tensor([0.9, 0.6, 1.0, 0.95, 0.5, 0.99, 0.3]),
        min_p=0.001,
        temperature=torch.tensor([0.9, 1.0, 0.0, 1.2, 0.7, 1.0, 0.5]),
    )
    keep = brute_keep(x, **kw)
    t[1] = int((~keep[1]).nonzero()[0])  # dropped by the cut
    t[3] = -100
    u = torch.rand(ROWS, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    x[6] = -16.5  # top-p alone, whose mass is reached only below M - 16
    x[6, 100] = 0.0
    t[6] = 100
    return x, t, kw, u


OTHER_CUTS = (
    dict(top_k=1, temperature=0.8),  # top-k alone: candidates from chunk maxima
    dict(top_p=torch.tensor([0.9, 0.5, 0.99, 0.7, 1.0, 0.8, 0.99999])),  # top-p alone
)


def run_all(x, t, kw, u, **shard):
    xg = x.clone().requires_grad_(True)
    res = processed_logprobs(xg, t, with_entropy=True, **kw, **shard)
    lp = torch.where(res.dropped, 0.0, res.logprobs)
    (lp.sum() + res.entropy.sum() - 0.5 * res.lse.sum()).backward()
    mask = sampling_mask(x, **kw, **shard)
    ids = sample(x, uniforms=u, **kw, **shard)
    fwd = processed_logprobs(x, t, with_entropy=True, **kw, **shard)  # no gradient
    out = dict(
        lp=res.logprobs.detach(), ent=res.entropy.detach(), lse=res.lse.detach(),
        grad=xg.grad, dropped=res.dropped, keep=mask.keep_mask, thr=mask.threshold, ids=ids,
        lp_fwd=fwd.logprobs, ent_fwd=fwd.entropy, lse_fwd=fwd.lse, dropped_fwd=fwd.dropped,
    )  # fmt: skip
    for i, other in enumerate(OTHER_CUTS):
        out[f"lp{i}"] = processed_logprobs(x, t, **other, **shard).logprobs
        out[f"keep{i}"] = sampling_mask(x, **other, **shard).keep_mask
        out[f"ids{i}"] = sample(x, uniforms=u, **other, **shard)
    return out


def rank_worker(rank, world, group, inputs):
    x, t, kw, u = inputs
    lo, hi = shard_bounds(world)[rank]
    out = run_all(x[:, lo:hi], t, kw, u, tp_group=group, vocab_start=lo)
    zeros = torch.full((2, VOCAB), -3.0)
    zeros[:, 0], zeros[:, -1] = -0.0, 0.0  # a -0 on the first shard, a +0 on the last
    out["zero_max"] = sampling_mask(zeros[:, lo:hi], top_k=2, tp_group=group,
                                    vocab_start=lo).row_max  # fmt: skip
    # ranks that disagree on a per-row top_p: NaN everywhere (validate=False), an error
    # on every rank (validate=True)
    if world > 1:
        bad = dict(kw, top_p=kw["top_p"].clone())
        if rank == world - 1:
            bad["top_p"][4] = 0.25
        shard = dict(tp_group=group, vocab_start=lo)
        out["nan"] = processed_logprobs(x[:, lo:hi], t, validate=False, **bad, **shard).logprobs
        try:
            processed_logprobs(x[:, lo:hi], t, **bad, **shard)
            out["error"] = None
        except ValueError as exc:
            out["error"] = str(exc)
        # ... and on the uniforms of sample: -1 everywhere
        u_bad = u.clone()
        if rank == 0:
            u_bad[2] = 0.5
        out["ids_bad"] = sample(x[:, lo:hi], uniforms=u_bad, validate=False, **kw, **shard)
    return out


def every_world(rank, world, group, inputs):
    out = {}
    for size in WORLDS:
        sub = group if size == world else dist.new_group(list(range(size)))
        if rank < size:
            out[size] = rank_worker(rank, size, sub, inputs)
    return out


@pytest.fixture(scope="module")
def world_results():
    per_rank = run_gloo_world(max(WORLDS), every_world, world_inputs(), timeout=240)
    return {size: [out[size] for out in per_rank[:size]] for size in WORLDS}


@pytest.mark.parametrize("world", WORLDS)
def test_every_tp_degree_gives_the_same_bits(world, world_results):
    x, t, kw, u = world_inputs()
    want = run_all(x, t, kw, u)
    assert torch.equal(want["keep"], brute_keep(x, **kw))
    for i, other in enumerate(OTHER_CUTS):
        assert torch.equal(want[f"keep{i}"], brute_keep(x, **other)), other
    assert bool(want["keep1"][6].all())  # row 6 is cut again from all its columns
    assert bool(want["dropped"][1]) and int(want["dropped"].sum()) == 1
    for rank, got in enumerate(world_results[world]):
        lo, hi = shard_bounds(world)[rank]
        what = f"world {world} rank {rank}"
        for name in ("lp", "ent", "lse", "thr", "ids", "dropped", "lp0", "lp1", "ids0", "ids1"):
            assert_bitwise_equal(got[name], want[name], f"{what} {name}")
        for name in ("lp", "ent", "lse", "dropped"):  # the forward alone: the kept lists
            assert_bitwise_equal(got[name + "_fwd"], want[name], f"{what} {name} forward")
        for name in ("keep", "keep0", "keep1"):
            assert torch.equal(got[name], want[name][:, lo:hi]), f"{what} {name}"
        assert_bitwise_equal(got["grad"], want["grad"][:, lo:hi], f"{what} gradient")
        assert_bitwise_equal(got["zero_max"], torch.zeros(2), f"{what} a zero max is +0")
        if world > 1:
            assert bool(torch.isnan(got["nan"]).all()), what
            assert got["error"] is not None and "top_p of row[4]" in got["error"], what
            assert bool((got["ids_bad"] == -1).all()), what


FORWARD_CASES = [
    dict(top_k=7),
    dict(top_k=7, top_p=0.8),
    dict(top_p=0.9),
    dict(min_p=0.05),
    dict(top_k=torch.tensor([3, 0, -1, 9, 1, 2]), top_p=0.95, min_p=0.01),
    dict(top_k=4, temperature=torch.tensor([0.0, 0.7, 1.3, 0.0, 1.0, 0.5])),
    dict(top_k=200, top_p=0.5, temperature=0.6),
    dict(top_p=0.999),  # wide kept sets: blocks keep a mask instead of lists
    dict(top_k=300, temperature=1.7),
]


@pytest.mark.parametrize("case", range(len(FORWARD_CASES)))
def test_the_forward_alone_gives_the_bits_of_the_masked_pass(case, monkeypatch):
    """Without a gradient, the processed logprobs come from the kept columns' list (and
    the partials pass for rows without a cut): the bits of selected_logprobs over the keep
    mask, which the gradient path runs. Wide rows (the top-k shortcut), padding, a NaN
    row, an ignored row, a dropped target, entropy, a (B, T, V) view."""
    shortcut = []
    real = blocks.top_k_candidates
    monkeypatch.setattr(
        blocks, "top_k_candidates", lambda *a: shortcut.append(real(*a)) or shortcut[-1]
    )
    kw = FORWARD_CASES[case]
    clean, t = llm_like_logits(6, 1700, torch.bfloat16, seed=20 + case)
    x = clean.clone()
    x[2, 11] = float("nan")  # its block is scanned whole
    t[3] = -100
    t[4] = int(x[4].float().argmin())  # dropped by every cut
    for logits, shard in ((x, {}), (clean, {}), (clean, dict(vocab_size=1650))):
        tt = torch.where(t >= 1650, 5, t) if shard else t
        fwd = processed_logprobs(logits, tt, with_entropy=True, validate=False, **kw, **shard)
        xg = logits.clone().requires_grad_(True)
        got = processed_logprobs(xg, tt, with_entropy=True, validate=False, **kw, **shard)
        # the definition: selected_logprobs over the keep mask (a dropped target's row
        # scores a kept column instead: its logprob is -inf, its entropy and lse stand)
        keep = fwd.mask.keep_mask
        t_kept = torch.where(fwd.dropped, keep.to(torch.int8).argmax(-1), tt)
        tau = kw.get("temperature", 1.0)
        tau = torch.where(tau == 0, 1.0, tau) if isinstance(tau, torch.Tensor) else tau
        xr = logits.clone().requires_grad_(True)
        ref = selected_logprobs(xr, t_kept, keep_mask=keep, temperature=tau, with_entropy=True,
                                validate=False, **shard)  # fmt: skip
        ref_lp = torch.where(fwd.dropped, float("-inf"), ref.logprobs)
        ref_lp = torch.where(torch.isnan(ref.logprobs), ref.logprobs, ref_lp)
        for res in (fwd, got):
            assert_bitwise_equal(res.logprobs.detach(), ref_lp.detach(), "logprobs")
            assert_bitwise_equal(res.entropy.detach(), ref.entropy.detach(), "entropy")
            assert_bitwise_equal(res.lse.detach(), ref.lse.detach(), "lse")
        assert torch.equal(fwd.dropped, got.dropped) and bool(fwd.dropped[4])
        assert torch.equal(fwd.mask.keep_mask, got.mask.keep_mask)
        assert bool(torch.isnan(fwd.logprobs[2])) == (logits is x) and fwd.logprobs[3] == 0
        # the gradient: of the kept columns alone, the bits of the masked pass's
        ok = ~fwd.dropped & ~torch.isnan(fwd.logprobs)
        (got.logprobs[ok].sum() + got.entropy[ok].sum() - 0.5 * got.lse[ok].sum()).backward()
        (ref.logprobs[ok].sum() + ref.entropy[ok].sum() - 0.5 * ref.lse[ok].sum()).backward()
        assert_bitwise_equal(xg.grad, xr.grad, "gradient")
    k = kw.get("top_k")
    wide = isinstance(k, int) and k <= 7 and "min_p" not in kw
    assert any(c is not None for c in shortcut) == wide  # the shortcut ran where it can
    view = torch.cat([x.view(2, 3, 1700), x.view(2, 3, 1700)[:, :1]], 1)[:, :-1]
    kw3 = {k: v.view(2, 3) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
    got = processed_logprobs(view, t.view(2, 3), validate=False, **kw3)
    want = processed_logprobs(x, t, validate=False, **kw)
    assert_bitwise_equal(got.logprobs.reshape(-1), want.logprobs, "(B, T, V) rows")
    with pytest.raises(ValueError, match=r"row\[2\] has 1 NaN or \+inf"):
        processed_logprobs(x, t, **kw)


def test_edge_rows_of_the_top_k_shortcut(monkeypatch):
    """A row whose only max is -0 (chunk_max gives +0: the max pass decides M), a row with
    fewer finite chunks than k (the shortcut would read every column: the block is
    scanned), a row of invalid temperature (validate=False: y is not monotonic in x) --
    each against the masked pass, and the wide kept set of a large k as a mask."""
    shortcut = []
    real = blocks.top_k_candidates
    monkeypatch.setattr(
        blocks, "top_k_candidates", lambda *a: shortcut.append(real(*a)) or shortcut[-1]
    )
    x = torch.full((3, 1300), -100.0)
    x[:, 3] = -0.0  # the only max of each row
    t = torch.tensor([3, 3, 3])
    for kw in (dict(top_k=1), dict(top_k=2, top_p=0.5)):
        got = processed_logprobs(x, t, **kw)
        keep = sampling_mask(x, **kw).keep_mask
        want = selected_logprobs(x, t, keep_mask=keep)
        assert_bitwise_equal(got.logprobs, want.logprobs, f"-0 max {kw}")
        assert_bitwise_equal(got.lse, want.lse, f"-0 max lse {kw}")
        assert bool((got.logprobs == 0).all()) and not bool(torch.signbit(got.logprobs).any())
    few = torch.full((2, 1300), float("-inf"))
    few[:, 5:8] = torch.tensor([1.0, 2.0, 3.0])  # three finite logits, k = 4
    shortcut.clear()
    assert torch.equal(sampling_mask(few, top_k=4).keep_mask, brute_keep(few, top_k=4))
    assert shortcut and not any(c is not None for c in shortcut)  # scanned
    tau = torch.tensor([-1.0, 0.5])  # a bad temperature (validate=False): the row is NaN
    x2, t2 = llm_like_logits(2, 1300, torch.float32, seed=3)
    shortcut.clear()
    res = processed_logprobs(x2, t2, top_k=2, temperature=tau, validate=False)
    assert shortcut and not any(c is not None for c in shortcut)
    assert bool(torch.isnan(res.logprobs[0]))
    good = processed_logprobs(x2[1:], t2[1:], top_k=2, temperature=0.5)
    assert_bitwise_equal(res.logprobs[1:], good.logprobs, "the other row")


def test_the_sort_and_the_radix_rounds_find_the_same_thresholds(monkeypatch):
    """Without a TP group the thresholds come from a sort, or from the radix rounds past
    SORT_MAX_ELEMENTS candidates: both against the definition, on ties and flat rows."""
    x, t = llm_like_logits(6, 1700, torch.bfloat16, seed=31)
    x[1] = torch.randint(-3, 3, (1700,)).to(torch.bfloat16)  # ties everywhere
    cases = (dict(top_k=9, top_p=0.7), dict(top_p=0.95), dict(top_k=40, min_p=0.01))
    want = {i: sampling_mask(x, **kw).keep_mask for i, kw in enumerate(cases)}
    monkeypatch.setattr(integers, "SORT_MAX_ELEMENTS", 0)
    for i, kw in enumerate(cases):
        assert torch.equal(want[i], brute_keep(x, **kw)), kw
        assert torch.equal(sampling_mask(x, **kw).keep_mask, want[i]), kw


def _shortcut_worker(rank, world, group, inputs):
    """Processed logprobs of 40 rows on two shards of 1300 columns (top-k 5, top-p 0.9),
    and whether this rank's blocks took the top-k shortcut."""
    x, t, spoil = inputs
    taken = []
    real = blocks.top_k_candidates
    blocks.top_k_candidates = lambda *a: taken.append(real(*a)) or taken[-1]
    try:
        shard = x[:, 1300 * rank : 1300 * (rank + 1)].clone()
        if spoil and rank == 1:
            shard[3, 17] = float("nan")  # this rank alone cannot take the shortcut
        res = processed_logprobs(shard, t, top_k=5, top_p=0.9, tp_group=group,
                                 vocab_start=1300 * rank, validate=False)  # fmt: skip
    finally:
        blocks.top_k_candidates = real
    return res.logprobs, [c is not None for c in taken]


@pytest.mark.parametrize("spoil", [False, True], ids=["shortcut", "one-rank-scans"])
def test_a_tp_group_takes_the_shortcut_together_or_not_at_all(spoil):
    """With a TP group a block of 512 rows takes the top-k shortcut only where every rank
    can (one all_reduce(MAX) of a flag), else every rank cuts its blocks of 32: the same
    collectives on every rank, the bits of one rank holding the whole vocabulary."""
    x, t = llm_like_logits(40, 2600, torch.bfloat16, seed=41)
    want = x.clone()
    if spoil:
        want[3, 1300 + 17] = float("nan")
    want = processed_logprobs(want, t, top_k=5, top_p=0.9, validate=False).logprobs
    per_rank = run_gloo_world(2, _shortcut_worker, (x, t, spoil), timeout=120)
    for rank, (lp, taken) in enumerate(per_rank):
        assert_bitwise_equal(lp, want, f"TP 2 rank {rank}")
        if not spoil:
            assert taken == [True], taken  # one block of 40 rows, by the shortcut
        else:  # the large block, then its blocks of 32 and 8 rows on both ranks
            assert taken == ([True, True, True] if rank == 0 else [False, False, True]), taken
            assert bool(torch.isnan(lp[3])) and not bool(torch.isnan(lp[[0, 4]]).any())


def test_strided_3d_logits_give_the_rows_bits():
    x, t = llm_like_logits(12, 300, torch.bfloat16, seed=1)
    full = torch.cat([x.view(3, 4, 300), x.view(3, 4, 300)[:, :1]], 1)
    view = full[:, :-1]  # (3, 4, 300) whose rows are not evenly spaced
    kw = dict(top_k=20, top_p=0.8)
    a = processed_logprobs(view, t.view(3, 4), **kw)
    b = processed_logprobs(x, t, **kw)
    assert_bitwise_equal(a.logprobs.reshape(-1), b.logprobs, "logprobs")
    assert a.dropped.shape == (3, 4) and a.mask.keep_mask.shape == (3, 4, 300)
    assert torch.equal(sampling_mask(view, **kw).keep_mask.reshape(12, 300), b.mask.keep_mask)
    u = torch.rand(3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    assert torch.equal(
        sample(view, uniforms=u, **kw).reshape(-1), sample(x, uniforms=u.view(-1), **kw)
    )


def test_megatron_drop_in_masks_cut_targets_out_of_the_loss(monkeypatch, caplog):
    from exactlogp.integrations import megatron
    from integration_stubs import install_megatron

    install_megatron(monkeypatch, rank=0, world_size=1)
    x, t = llm_like_logits(8, 120, torch.bfloat16, seed=12)
    kw = dict(top_k=10, top_p=0.9, temperature=0.9)
    keep = brute_keep(x, **kw)
    t[2] = int((~keep[2]).nonzero()[0])
    xg = x.clone().requires_grad_(True)
    with caplog.at_level("WARNING"):
        out = megatron.processed_logprobs(xg, t, **kw, loss_mask=torch.arange(8) != 5)
    cut = ~keep[torch.arange(8), t]
    assert bool(cut[2]) and f"{int(cut.sum())} of 8 target tokens" in caplog.text
    assert int(out.num_dropped) == int(cut.sum()) and bool((out.logprobs[cut] == 0).all())
    assert torch.equal(out.loss_mask, ~cut & (torch.arange(8) != 5))
    loss = -(out.logprobs * out.loss_mask).sum()
    loss.backward()
    assert torch.isfinite(loss) and bool(torch.isfinite(xg.grad).all())
    assert bool((xg.grad[cut] == 0).all()) and bool((xg.grad[~keep] == 0).all())
    ref = processed_logprobs(x, t, **kw)
    assert_bitwise_equal(out.logprobs[out.loss_mask], ref.logprobs[out.loss_mask], "drop-in")


def test_no_rows_and_a_temperature_that_requires_grad():
    x, t = torch.randn(0, 50), torch.zeros(0, dtype=torch.long)
    res = processed_logprobs(x, t, top_k=5, top_p=0.5, min_p=0.1)
    assert res.logprobs.shape == (0,) and int(res.num_dropped) == 0
    assert sampling_mask(x, top_p=0.5).keep_mask.shape == (0, 50)
    assert sample(x, top_p=0.5).shape == (0,)
    tau = torch.ones(3, requires_grad=True)
    with pytest.raises(ValueError, match="temperature"):
        processed_logprobs(torch.randn(3, 50), torch.zeros(3, dtype=torch.long), temperature=tau)


def test_a_nan_or_inf_logit_makes_only_its_row_bad():
    x, t = llm_like_logits(4, 100, torch.float32, seed=0)
    bad = x.clone()
    bad[1, 5], bad[2, 7] = float("nan"), float("inf")
    kw = dict(top_k=5, top_p=0.9)
    got = processed_logprobs(bad, t, validate=False, **kw).logprobs
    want = processed_logprobs(x, t, **kw).logprobs
    assert bool(torch.isnan(got[1:3]).all())
    assert_bitwise_equal(got[[0, 3]], want[[0, 3]], "other rows")
    with pytest.raises(ValueError, match=r"row\[1\] has 1 NaN or \+inf"):
        processed_logprobs(bad, t, **kw)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_top_k_from_chunk_maxima_matches_the_definition(dtype):
    """Rows wide enough for the shortcut (chunks of 128 columns), with ties at the k-th
    value inside and across chunks, -inf columns and a per-row temperature."""
    gen = torch.Generator().manual_seed(13)
    x = torch.randn(5, 2100, generator=gen) * 3
    x[1] = torch.randint(-2, 3, (2100,), generator=gen).float()  # ties everywhere
    x[2, ::150] = 9.0  # 14 tied maxima, one per chunk
    x[3, :1500] = float("-inf")
    x = x.to(dtype)
    tau = torch.tensor([1.0, 0.7, 1.3, 1.0, 0.3])
    for kw in (dict(top_k=3), dict(top_k=torch.tensor([1, 4, 2, 7, 3])), dict(top_k=5, top_p=0.6)):
        got = sampling_mask(x, temperature=tau, **kw).keep_mask
        assert torch.equal(got, brute_keep(x, temperature=tau, **kw)), kw
