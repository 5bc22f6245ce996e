"""The exact fused LM head over real gloo worlds: every TP layout gives the TP=1 bits.

Each rank holds a shard of the weight rows (even and padded as Megatron pads, or uneven
with a width-1 and an empty shard). Outputs, the weight and bias gradient rows of the
shard, and the whole hidden gradient -- which the op sums over the shards itself, with one
int64 all_reduce -- must equal TP=1's bitwise on every rank. (Equal bits also mean the
hidden gradient is not TP times too large: the op does the sum once, and a host must not
all-reduce it again.) The fail-closed checks of the agreement apply too.

One world of 4 ranks runs every case, each in a process group of its first ranks, so
process start-up is paid once.
"""

import pytest
import torch
import torch.distributed as dist

import exactlogp
from exactlogp.testing import (
    assert_bitwise_equal,
    grad_keep_bytes,
    lm_head_inputs,
    run_gloo_world,
)

VOCAB = 301
ROWS, HIDDEN = 20, 48


def make_inputs():
    h, w, t = lm_head_inputs(ROWS, HIDDEN, VOCAB, torch.bfloat16, seed=12)
    # outlier channels in some rows: contract v2's correction and column split take part
    h[1::4, 7] *= 300
    h[2::4, 11] *= 1000
    t[4] = -100
    bias = (0.3 * torch.randn(VOCAB, generator=torch.Generator().manual_seed(3))).bfloat16()
    return h, w, bias, t


def run(h, w, bias, t, **kw):
    hh, ww, bb = (x.clone().requires_grad_(True) for x in (h, w, bias))
    res = exactlogp.linear_selected_logprobs(
        hh, ww, t, bias=bb, with_entropy=True, temperature=0.9, logit_scale=1.5, **kw
    )
    weights = torch.linspace(-1.0, 1.0, ROWS)
    (weights * res.logprobs + 0.2 * res.entropy - 0.1 * res.lse).sum().backward()
    return (res.logprobs, res.entropy, res.lse), hh.grad, ww.grad, bb.grad


def layouts(world: int):
    """name -> (per-rank [start, end) weight rows, padded width)."""
    per = -(-VOCAB // world)
    even = [(r * per, (r + 1) * per) for r in range(world)]
    # uneven: an empty shard and a width-1 shard first (world >= 3), the rest split
    bounds = {2: [0, 100, VOCAB], 3: [0, 0, 1, VOCAB], 4: [0, 0, 1, 200, VOCAB]}[world]
    uneven = [(bounds[r], bounds[r + 1]) for r in range(world)]
    return {"even": (even, per * world), "uneven": (uneven, VOCAB)}


def world_worker(rank, world, group, inputs):
    """Each layout; the uneven one also with the backward on a predicted grid (dL/dz past
    GRAD_KEEP_BYTES: one more all_reduce(MAX), every rank slicing on the same grid), on
    every rank or only on the wider shards."""
    h, w, bias, t = inputs
    out = {}
    for name, (ranges, padded) in layouts(world).items():
        lo, hi = ranges[rank]
        pad = padded - VOCAB
        wp = torch.cat([w, torch.zeros(pad, HIDDEN, dtype=w.dtype)])
        bp = torch.cat([bias, torch.zeros(pad, dtype=bias.dtype)])
        start = None if name == "even" else lo
        args = (h, wp[lo:hi], bp[lo:hi], t)
        kw = dict(tp_group=group, vocab_start=start, vocab_size=VOCAB)
        out[name] = run(*args, **kw)
        # the uneven layout again: every rank on a predicted grid, then the ranks of at
        # most 101 columns keeping dL/dz while the wider ones predict
        for tail, budget in (("predicted", 0), ("mixed", 4 * ROWS * 101)):
            if name != "uneven":
                break
            with grad_keep_bytes(budget):
                out[f"uneven-{tail}"] = run(*args, **kw)
    return out


def every_case_worker(rank, world, group, inputs):
    """{case: this rank's result}: each worker in a process group of its first ranks (every
    rank creates every group, in the same order); the fail-closed case last."""
    cases = [(("layouts", size), world_worker, size) for size in (2, 3, 4)]
    cases += [("sequence_parallel", sequence_parallel_worker, 2), ("disagree", disagree_worker, 2)]
    out = {}
    for case, fn, size in cases:
        sub = group if size == world else dist.new_group(list(range(size)))
        if rank < size:
            out[case] = fn(rank, size, sub, inputs)
    return out


@pytest.fixture(scope="module")
def results():
    """{case: [each rank's result]}, from one spawned world of 4 ranks."""
    per_rank = run_gloo_world(4, every_case_worker, make_inputs(), timeout=240)
    cases = {case for out in per_rank for case in out}
    return {case: [out[case] for out in per_rank if case in out] for case in cases}


@pytest.fixture(scope="module")
def expected():
    return run(*make_inputs())


@pytest.mark.parametrize("world", [2, 3, 4])
def test_every_tp_layout_gives_the_tp1_bits_forward_and_backward(world, expected, results):
    outs, dh, dw, db = expected
    assert len(results["layouts", world]) == world
    for rank, per_layout in enumerate(results["layouts", world]):
        assert set(per_layout) == {"even", "uneven", "uneven-predicted", "uneven-mixed"}
        for name, (got_outs, got_dh, got_dw, got_db) in per_layout.items():
            lo, hi = layouts(world)[name.split("-")[0]][0][rank]
            what = f"world {world} rank {rank} {name}"
            for a, b in zip(got_outs, outs, strict=True):
                assert_bitwise_equal(a, b, what)
            assert_bitwise_equal(got_dh, dh, what + " hidden gradient")
            real = slice(lo, min(hi, VOCAB))
            assert_bitwise_equal(got_dw[: real.stop - real.start], dw[real], what + " dW")
            assert_bitwise_equal(got_db[: real.stop - real.start], db[real], what + " db")


def disagree_worker(rank, world, group, inputs):
    h, w, bias, t = inputs
    per = -(-VOCAB // world)
    wp = torch.cat([w, torch.zeros(per * world - VOCAB, HIDDEN, dtype=w.dtype)])
    shard = wp[rank * per : (rank + 1) * per]
    out = {}
    other = h.clone()
    if rank == 1:
        other[7, 5] += 1.0  # one rank got other hidden states
    for name, hidden, validate in (("hidden", other, True), ("hidden_nan", other, False)):
        try:
            res = exactlogp.linear_selected_logprobs(
                hidden, shard, t, tp_group=group, vocab_size=VOCAB, validate=validate
            )
            out[name] = ("returned", res.logprobs)
        except ValueError as exc:
            out[name] = ("raised", str(exc))
    try:
        exactlogp.linear_selected_logprobs(
            h[:, : HIDDEN - rank], shard[:, : HIDDEN - rank], t, tp_group=group, vocab_size=VOCAB
        )
        out["hidden_size"] = ("returned", None)
    except ValueError as exc:
        out["hidden_size"] = ("raised", str(exc))
    return out


def test_ranks_with_other_hidden_states_or_sizes_fail_closed(results):
    assert len(results["disagree"]) == 2
    for out in results["disagree"]:
        kind, text = out["hidden"]
        assert kind == "raised" and "disagree on the hidden states of row[7]" in text, text
        kind, value = out["hidden_nan"]
        assert kind == "returned" and torch.isnan(value).all()
        kind, text = out["hidden_size"]
        assert kind == "raised" and "disagree on the hidden size (rank 0: 48, rank 1: 47)" in text
        assert "every rank must pass the same hidden size" in text, text


def sequence_parallel_worker(rank, world, group, inputs):
    from exactlogp.linear import gather_sequence_parallel

    h, w, bias, t = inputs
    per = ROWS // world
    shard = h[rank * per : (rank + 1) * per].clone().requires_grad_(True)
    vper = -(-VOCAB // world)
    wp = torch.cat([w, torch.zeros(vper * world - VOCAB, HIDDEN, dtype=w.dtype)])
    full = gather_sequence_parallel(shard, group)
    res = exactlogp.linear_selected_logprobs(
        full, wp[rank * vper : (rank + 1) * vper], t, tp_group=group, vocab_size=VOCAB
    )
    res.logprobs.sum().backward()
    return res.logprobs, shard.grad


def test_sequence_parallel_hidden_gets_its_slice_of_the_gradient_once(results):
    h, w, bias, t = make_inputs()
    hh = h.clone().requires_grad_(True)
    want = exactlogp.linear_selected_logprobs(hh, w, t)
    want.logprobs.sum().backward()
    per = ROWS // 2
    assert len(results["sequence_parallel"]) == 2
    for rank, (lp, grad) in enumerate(results["sequence_parallel"]):
        assert_bitwise_equal(lp, want.logprobs)
        assert_bitwise_equal(grad, hh.grad[rank * per : (rank + 1) * per])
