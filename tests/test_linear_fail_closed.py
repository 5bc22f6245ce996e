"""The exact fused LM head fails closed, forward and backward, in real gloo worlds.

Each case is a call (or a backward) that the two ranks make inconsistently: with
validate=True every rank raises a clear ValueError within seconds; with validate=False every
output (or gradient) is NaN on every rank. After the cases each rank makes a correct call
and backward, which must give the TP=1 bits: the group is still usable. One world runs all
the cases, so its start-up is paid once.
"""

from __future__ import annotations

import random
import threading
import time

import torch

import exactlogp
from exactlogp.testing import assert_bitwise_equal, lm_head_inputs, run_gloo_world

VOCAB, ROWS, HIDDEN = 203, 8, 16
FAST_S = 30.0  # "within seconds" on a loaded 2-core machine


def make_inputs():
    h, w, t = lm_head_inputs(ROWS, HIDDEN, VOCAB, torch.bfloat16, seed=41)
    return h, w, t


def weak_checksum(row: torch.Tensor) -> int:
    """The per-row checksum the head used before: sum of (bits mod 8191) * (k + 1)."""
    u = row.view(torch.int16).to(torch.int64) & 0xFFFF
    k = torch.arange(row.shape[-1]) % 8191 + 1
    return int(((u % 8191) * k).sum()) % 8388593


def cancelling_edit(h: torch.Tensor, row: int) -> torch.Tensor:
    """h with +1, +1 and -1 ulp at columns 0, 1 and 2 of `row`: weights 1 + 2 - 3 = 0, so the
    weak checksum cannot see it (asserted), while the logits change."""
    bits = h.clone().view(torch.int16)
    bits[row, 0] += 1
    bits[row, 1] += 1
    bits[row, 2] -= 1
    edited = bits.view(torch.bfloat16)
    assert weak_checksum(edited[row]) == weak_checksum(h[row])
    assert not torch.equal(edited[row], h[row])
    return edited


def shard(w: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    per = -(-VOCAB // world)
    padded = torch.cat([w, torch.zeros(per * world - VOCAB, HIDDEN, dtype=w.dtype)])
    return padded[rank * per : (rank + 1) * per]


def forward(h, w, t, group, *, validate=True, grad=(True, True), scale=1.0):
    """(result, hidden, weight) with a loss of `scale` times the logprobs' sum."""
    hh = h.clone().requires_grad_(grad[0])
    ww = w.clone().requires_grad_(grad[1])
    res = exactlogp.linear_selected_logprobs(
        hh, ww, t, tp_group=group, vocab_size=VOCAB, validate=validate, with_entropy=True
    )
    return res, hh, ww


def loss(res, scale=1.0):
    return scale * (res.logprobs.sum() - 0.5 * res.entropy.sum())


# --- the cases; each returns what the caller checks ---


def cancelling_hidden(rank, world, group, inputs, validate):
    h, w, t = inputs
    hidden = cancelling_edit(h, 3) if rank == 1 else h
    res, _, _ = forward(hidden, shard(w, rank, world), t, group, validate=validate)
    return res.logprobs


def swapped_hidden(rank, world, group, inputs):
    h, w, t = inputs
    hidden = h.clone()
    if rank == 1:
        hidden[5, [0, 7]] = hidden[5, [7, 0]]
    res, _, _ = forward(hidden, shard(w, rank, world), t, group)
    return res.logprobs


def another_function_on_one_rank(rank, world, group, inputs):
    """Rank 1 computes the same logprobs as selected_logprobs(linear_logits(...))."""
    h, w, t = inputs
    if rank == 0:
        res, _, _ = forward(h, shard(w, rank, world), t, group)
        return res.logprobs
    logits = exactlogp.linear_logits(h, shard(w, rank, world))
    return exactlogp.selected_logprobs(logits, t, tp_group=group, vocab_size=VOCAB).logprobs


def another_function_unvalidated(rank, world, group, inputs, cut=False):
    """validate=False: rank 1 runs selected_logprobs (or, cut=True, processed_logprobs) of
    linear_logits(...). With at most ROW_BLOCK rows the fused head's first MAX has the
    layout of theirs: every output NaN on every rank, nothing waits."""
    h, w, t = inputs
    if rank == 0:
        res, _, _ = forward(h, shard(w, rank, world), t, group, validate=False)
        return res.logprobs
    logits = exactlogp.linear_logits(h, shard(w, rank, world))
    fn = exactlogp.processed_logprobs if cut else exactlogp.selected_logprobs
    kw = dict(top_k=5) if cut else {}
    return fn(logits, t, tp_group=group, vocab_size=VOCAB, validate=False, **kw).logprobs


def requires_grad_on_one_rank(rank, world, group, inputs, validate):
    h, w, t = inputs
    res, hh, ww = forward(h, shard(w, rank, world), t, group, validate=validate,
                          grad=(rank == 0, True))  # fmt: skip
    loss(res).backward()  # rank 0 runs the hidden gradient alone: no collective may wait
    return res.logprobs, hh.grad, ww.grad


def scaled_loss_on_one_rank(rank, world, group, inputs, validate):
    h, w, t = inputs
    res, hh, ww = forward(h, shard(w, rank, world), t, group, validate=validate)
    loss(res, 2.0 if rank == 1 else 1.0).backward()
    return hh.grad, ww.grad


def backwards_in_another_order(rank, world, group, inputs):
    h, w, t = inputs
    first, _, _ = forward(h, shard(w, rank, world), t, group)
    second, _, _ = forward(h, shard(w, rank, world), t.roll(1), group)
    order = [first, second] if rank == 0 else [second, first]
    errors = []
    for res in order:  # both backwards pair with the other call's on the other rank
        try:
            loss(res).backward()
        except ValueError as exc:
            errors.append(str(exc))
    return errors


def threads_forward_and_backward(rank, world, group, inputs):
    """Two threads share the group, each running forward + backward of its own call three
    times, with small random pauses: each step either gives its call's TP=1 bits or raises
    a clear ValueError; nothing aborts or hangs."""
    h, w, t = inputs
    targets = [t, t.roll(3)]
    outcomes: list = []
    rng = random.Random(rank)

    def work(i):
        for _ in range(3):
            time.sleep(rng.random() * 0.02)
            try:
                res, hh, _ = forward(h, shard(w, rank, world), targets[i], group)
                time.sleep(rng.random() * 0.02)
                loss(res).backward()
                outcomes.append((i, "ok", res.logprobs.detach(), hh.grad))
            except ValueError as exc:
                outcomes.append((i, "raised", str(exc), None))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=120)
    return [th.is_alive() for th in threads], outcomes


def good_call(rank, world, group, inputs):
    h, w, t = inputs
    res, hh, _ = forward(h, shard(w, rank, world), t, group)
    loss(res).backward()
    return res.logprobs.detach(), hh.grad


def predicted(case):
    """`case` with the backward on a predicted grid (GRAD_KEEP_BYTES 0): its check rides
    the prediction's all_reduce(MAX), before any pass over the vocabulary."""
    from exactlogp.testing import grad_keep_bytes

    def run(*args):
        with grad_keep_bytes(0):
            return case(*args)

    return run


CASES = {
    "cancelling_hidden": lambda *a: cancelling_hidden(*a, validate=True),
    "cancelling_hidden_unvalidated": lambda *a: cancelling_hidden(*a, validate=False),
    "swapped_hidden": swapped_hidden,
    "another_function": another_function_on_one_rank,
    "another_function_unvalidated": another_function_unvalidated,
    "the_cut_unvalidated": lambda *a: another_function_unvalidated(*a, cut=True),
    "requires_grad": lambda *a: requires_grad_on_one_rank(*a, validate=True),
    "requires_grad_unvalidated": lambda *a: requires_grad_on_one_rank(*a, validate=False),
    "scaled_loss": lambda *a: scaled_loss_on_one_rank(*a, validate=True),
    "scaled_loss_unvalidated": lambda *a: scaled_loss_on_one_rank(*a, validate=False),
    "backward_order": backwards_in_another_order,
    "threads": threads_forward_and_backward,
    "scaled_loss_predicted": predicted(lambda *a: scaled_loss_on_one_rank(*a, validate=True)),
    "scaled_loss_predicted_unvalidated": predicted(
        lambda *a: scaled_loss_on_one_rank(*a, validate=False)
    ),
    "requires_grad_predicted_unvalidated": predicted(
        lambda *a: requires_grad_on_one_rank(*a, validate=False)
    ),
    "backward_order_predicted": predicted(backwards_in_another_order),
    "threads_predicted": predicted(threads_forward_and_backward),
}


def worker(rank, world, group, inputs):
    out = {}
    for name, case in CASES.items():
        start = time.monotonic()
        try:
            value = ("returned", case(rank, world, group, inputs))
        except ValueError as exc:
            value = ("raised", str(exc))
        out[name] = (*value, time.monotonic() - start, good_call(rank, world, group, inputs))
    return out


def _check(out, rank, name, kind, want, *needles):
    """Case `name` on `rank` returned or raised (`kind`) with `needles` in its message,
    within seconds, and the correct call after it gave the TP=1 bits `want`."""
    got_kind, value, seconds, (lp, dh) = out[name]
    what = f"{name}, rank {rank}"
    assert got_kind == kind, f"{what}: {got_kind} {value}"
    for needle in needles:
        assert needle in value, f"{what}: {value}"
    assert seconds < FAST_S, f"{what} took {seconds:.1f} s"
    assert_bitwise_equal(lp, want[0], f"{what}: the call after it")
    assert_bitwise_equal(dh, want[1], f"{what}: the gradient after it")
    return value


def test_the_fused_head_fails_closed_forward_and_backward():
    inputs = make_inputs()
    h, w, t = inputs
    want = good_call(0, 1, None, inputs)
    results = run_gloo_world(2, worker, inputs, timeout=300)
    for rank, out in enumerate(results):
        case = lambda name, kind, *needles: _check(out, rank, name, kind, want, *needles)  # noqa: B023, E731
        case("cancelling_hidden", "raised", "disagree on the hidden states of row[3]")
        assert torch.isnan(case("cancelling_hidden_unvalidated", "returned")).all()
        case("swapped_hidden", "raised", "disagree on the hidden states of row[5]")
        case("another_function", "raised", "disagree on the function called (rank 0: "
             "linear_selected_logprobs, rank 1: selected_logprobs)")  # fmt: skip
        assert torch.isnan(case("another_function_unvalidated", "returned")).all()
        assert torch.isnan(case("the_cut_unvalidated", "returned")).all()
        case("requires_grad", "raised", "disagree on which inputs require a gradient",
             "rank 0: hidden, weight, rank 1: weight")  # fmt: skip
        lp, dh, dw = case("requires_grad_unvalidated", "returned")
        assert torch.isnan(lp).all() and torch.isnan(dw).all()
        assert (dh is None) if rank == 1 else torch.isnan(dh).all()
        case("scaled_loss", "raised", "disagree in the backward of linear_selected_logprobs",
             "the upstream gradient of row 0")  # fmt: skip
        dh, dw = case("scaled_loss_unvalidated", "returned")
        assert torch.isnan(dh).all() and torch.isnan(dw).all()
        for tail in ("", "_predicted"):  # the backward after pass 1, or on a predicted grid
            if tail:
                case("scaled_loss" + tail, "raised", "disagree in the backward of "
                     "linear_selected_logprobs", "the upstream gradient of row 0")  # fmt: skip
                dh, dw = case("scaled_loss_predicted_unvalidated", "returned")
                assert torch.isnan(dh).all() and torch.isnan(dw).all()
                lp, dh, dw = case("requires_grad_predicted_unvalidated", "returned")
                assert torch.isnan(lp).all() and torch.isnan(dw).all()
                assert (dh is None) if rank == 1 else torch.isnan(dh).all()
            errors = case("backward_order" + tail, "returned")
            assert len(errors) == 2 and all("the target of row 0" in e for e in errors), errors
            alive, outcomes = case("threads" + tail, "returned")
            assert not any(alive), "a thread did not finish"
            assert len(outcomes) == 6
            for i, kind, value, dh in outcomes:
                if kind == "ok":  # its call paired with the same call on the other rank
                    mine = good_call(0, 1, None, (h, w, [t, t.roll(3)][i]))
                    assert_bitwise_equal(value, mine[0], f"thread {i}")
                    assert_bitwise_equal(dh, mine[1], f"thread {i}")
                else:
                    assert "the ranks of tp_group disagree" in value, value
