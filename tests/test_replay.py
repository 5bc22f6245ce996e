"""Replay of a kept set given as CSR (exactlogp.replay_logprobs, linear_replay_logprobs).

Bitwise claims: the forward and the gradients equal selected_logprobs with the same set as
a dense keep_mask (and, for the fused head, replay_logprobs of linear_logits) on every row
whose target is kept -- at TP 1, 2 and 3 with uneven shards, on every backend (Triton in
its interpreter). Targets outside their set: -inf, zero gradient, counted. Malformed CSR:
a clear error naming the argument and the row, or NaN in that row alone.
"""

from __future__ import annotations

import pytest
import torch

import exactlogp
from exactlogp import linear_replay_logprobs, replay_logprobs, selected_logprobs
from exactlogp.testing import (
    assert_bitwise_equal,
    llm_like_logits,
    lm_head_inputs,
    run_gloo_world,
)

VOCAB, ROWS = 509, 7


def kept_sets(t: torch.Tensor, vocab: int, seed: int, drop=(2,), empty=()):
    """Per row a random sorted set of ids holding the row's target (not for rows `drop`;
    `empty` rows keep nothing), as lists, the CSR and the dense mask (rows, vocab)."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for r, target in enumerate(t.reshape(-1).tolist()):
        if r in empty:
            rows.append([])
            continue
        size = int(torch.randint(1, 60, (1,), generator=gen))
        ids = set(torch.randint(0, vocab, (size,), generator=gen).tolist())
        ids.discard(target)
        if r not in drop and target >= 0:
            ids.add(target)
        rows.append(sorted(ids))
    ids = torch.tensor([i for row in rows for i in row], dtype=torch.int64)
    offsets = torch.tensor([0, *torch.tensor([len(r) for r in rows]).cumsum(0).tolist()])
    mask = torch.zeros(len(rows), vocab, dtype=torch.bool)
    for r, row in enumerate(rows):
        mask[r, row] = True
    return rows, ids, offsets, mask


def loss(res, weights=(1.0, 0.5, -0.25)):
    lp = torch.where(res.dropped, 0.0, res.logprobs)
    return weights[0] * lp.sum() + weights[1] * res.entropy.sum() + weights[2] * res.lse.sum()


def inputs(dtype=torch.bfloat16, seed=5):
    x, t = llm_like_logits(ROWS, VOCAB, dtype, seed=seed)
    t[5] = -100
    return x, t


# --- TP = 1: the dense keep mask's bits ---


@pytest.mark.parametrize("backend", ["reference", "cpu", "triton"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("per_row", [False, True], ids=["tau", "tau per row"])
def test_replay_gives_the_dense_keep_masks_bits(backend, dtype, per_row):
    x, t = inputs(dtype)
    _, ids, offsets, mask = kept_sets(t, VOCAB, seed=1)
    tau = torch.linspace(0.6, 1.4, ROWS) if per_row else 0.8
    xg = x.clone().requires_grad_(True)
    got = replay_logprobs(xg, t, ids.to(torch.int32), offsets, temperature=tau,
                          with_entropy=True, backend=backend)  # fmt: skip
    loss(got).backward()
    kept = torch.tensor([r for r in range(ROWS) if r != 2])  # row 2: its target is dropped
    ref_x = x[kept].clone().requires_grad_(True)
    tau_k = tau[kept] if per_row else tau
    want = selected_logprobs(ref_x, t[kept], keep_mask=mask[kept], temperature=tau_k,
                             with_entropy=True, backend=backend)  # fmt: skip
    lp = want.logprobs
    (lp.sum() + 0.5 * want.entropy.sum() - 0.25 * want.lse.sum()).backward()
    for name in ("logprobs", "entropy", "lse"):
        assert_bitwise_equal(getattr(got, name)[kept], getattr(want, name), name)
    assert_bitwise_equal(xg.grad[kept], ref_x.grad, "gradient")
    # the dropped target: -inf, zero logprob gradient, counted; its kept set's entropy
    assert got.dropped.tolist() == [r == 2 for r in range(ROWS)] and int(got.num_dropped) == 1
    assert got.logprobs[2] == float("-inf") and torch.isfinite(got.entropy[2])
    alone = replay_logprobs(x[2:3], t[2:3].clone().fill_(int(mask[2].nonzero()[0])),
                            ids[offsets[2] : offsets[3]], torch.tensor([0, offsets[3] - offsets[2]]),
                            temperature=tau[2:3] if per_row else tau, with_entropy=True,
                            backend=backend)  # fmt: skip
    assert_bitwise_equal(got.entropy[2:3], alone.entropy, "a dropped row's entropy")
    assert_bitwise_equal(got.lse[2:3], alone.lse, "a dropped row's lse")


def test_strided_3d_logits_padding_and_the_forward_alone():
    """(B, T, V) views with a row stride (logits[:, :-1]), padding columns past
    vocab_size, and the no-gradient path: the bits of the dense keep mask."""
    full, t_full = llm_like_logits(3 * 4, 520, torch.bfloat16, seed=8)
    x = full.view(3, 4, 520)[:, :3]  # (3, 3, 520), rows not evenly spaced
    t = t_full.view(3, 4)[:, :3].clamp(max=VOCAB - 1)
    _, ids, offsets, mask = kept_sets(t, VOCAB, seed=2, drop=())
    got = replay_logprobs(x, t, ids, offsets, vocab_size=VOCAB, with_entropy=True)
    pad = torch.cat([mask, torch.zeros(9, 520 - VOCAB, dtype=torch.bool)], 1).view(3, 3, 520)
    want = selected_logprobs(x, t, keep_mask=pad, vocab_size=VOCAB, with_entropy=True)
    for a, b, name in zip(got, want, ("logprobs", "entropy", "lse"), strict=True):
        assert_bitwise_equal(a, b, name)
    assert got.logprobs.shape == (3, 3)


# --- malformed kept sets ---


def _bad(ids, offsets, case):
    ids, offsets = ids.clone(), offsets.clone()
    a, b = int(offsets[3]), int(offsets[4])  # row 3's ids
    if case == "unsorted":
        ids[a], ids[a + 1] = ids[a + 1].clone(), ids[a].clone()
    elif case == "duplicate":
        ids[a + 1] = ids[a]
    elif case == "out of range":
        ids[b - 1] = VOCAB + 4
    elif case == "negative":
        ids[a] = -3
    elif case == "offsets decrease":
        offsets[4] = offsets[3] - 1
    elif case == "offsets do not end at len":
        offsets[-1] -= 1
    elif case == "offsets do not start at 0":
        offsets[0] = 1
    elif case == "empty":
        ids = torch.cat([ids[:a], ids[b:]])
        offsets[4:] -= b - a
    return ids, offsets


MALFORMED = {
    "unsorted": (3, r"kept_ids of row\[3\] are not strictly increasing"),
    "duplicate": (3, r"kept_ids of row\[3\] are not strictly increasing"),
    "out of range": (3, r"kept_ids of row\[3\] hold 513, outside the vocabulary \[0, 509\)"),
    "negative": (3, r"kept_ids of row\[3\] hold -3, outside"),
    "offsets decrease": (3, r"kept_offsets\[3\] = \d+, \d+ do not bound a row"),
    "offsets do not end at len": (6, r"kept_offsets\[6\] .* end at len\(kept_ids\)"),
    "offsets do not start at 0": (0, r"kept_offsets\[0\] = 1, \d+ do not bound a row"),
    "empty": (3, r"the kept set of row\[3\] is empty, and its target is not ignore_index"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_a_malformed_kept_set_is_named_or_nan_in_its_row_alone(case):
    x, t = inputs(torch.float32, seed=9)
    _, ids, offsets, _ = kept_sets(t, VOCAB, seed=3, drop=())
    good = replay_logprobs(x, t, ids, offsets)
    bad_ids, bad_offsets = _bad(ids, offsets, case)
    row, message = MALFORMED[case]
    with pytest.raises(ValueError, match=message):
        replay_logprobs(x, t, bad_ids, bad_offsets)
    got = replay_logprobs(x, t, bad_ids, bad_offsets, validate=False)
    assert bool(torch.isnan(got.logprobs[row])), case
    others = [r for r in range(ROWS) if r != row and not (case == "offsets decrease" and r == 4)]
    assert_bitwise_equal(got.logprobs[others], good.logprobs[others], "the other rows")


def test_argument_errors_name_the_argument():
    x, t = inputs(torch.float32)
    _, ids, offsets, _ = kept_sets(t, VOCAB, seed=4, drop=())
    with pytest.raises(TypeError, match=r"kept_ids must be a torch.Tensor .*kept_csr"):
        replay_logprobs(x, t, ids.tolist(), offsets)
    with pytest.raises(TypeError, match="kept_offsets must be a 1-D int32 or int64 tensor"):
        replay_logprobs(x, t, ids, offsets.float())
    with pytest.raises(ValueError, match=r"kept_offsets must hold one offset per row and one "
                                         r"more \(8 for 7 rows\), got 7"):  # fmt: skip
        replay_logprobs(x, t, ids, offsets[:-1])
    ignored = t.clone()
    ignored[3] = -100  # an ignored row may keep nothing (prompt tokens)
    empty_ids, empty_offsets = _bad(ids, offsets, "empty")
    res = replay_logprobs(x, ignored, empty_ids, empty_offsets)
    assert res.logprobs[3] == 0 and not bool(res.dropped[3])


# --- fused head ---


def test_the_fused_head_replays_the_bits_of_its_logits():
    h, w, t = lm_head_inputs(ROWS, 24, VOCAB, torch.bfloat16, seed=6)
    t[4] = -100
    _, ids, offsets, _ = kept_sets(t, VOCAB, seed=5)
    hg, wg = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    got = linear_replay_logprobs(hg, wg, t, ids, offsets, temperature=0.9, with_entropy=True)
    loss(got).backward()
    h2, w2 = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    want = replay_logprobs(exactlogp.linear_logits(h2, w2), t, ids, offsets, temperature=0.9,
                           with_entropy=True)  # fmt: skip
    loss(want).backward()
    for a, b, name in zip(got, want, ("logprobs", "entropy", "lse"), strict=True):
        assert_bitwise_equal(a, b, name)
    assert torch.equal(got.dropped, want.dropped) and bool(got.dropped[2])
    assert_bitwise_equal(hg.grad, h2.grad, "hidden gradient")
    assert_bitwise_equal(wg.grad, w2.grad, "weight gradient")


# --- across ranks ---


def _bounds(world: int) -> list[int]:
    return {1: [0, VOCAB], 2: [0, 200, VOCAB], 3: [0, 1, 260, VOCAB]}[world]


def _replay_worker(rank, world, group, data):
    x, t, ids, offsets, h, w, other = data
    lo, hi = _bounds(world)[rank : rank + 2]
    xg = x[:, lo:hi].clone().requires_grad_(True)
    res = replay_logprobs(xg, t, ids, offsets, tp_group=group, vocab_start=lo, vocab_size=VOCAB,
                          with_entropy=True, temperature=0.7)  # fmt: skip
    loss(res).backward()
    hg, wg = h.clone().requires_grad_(True), w[lo:hi].clone().requires_grad_(True)
    lin = linear_replay_logprobs(hg, wg, t, ids, offsets, tp_group=group, vocab_start=lo,
                                 vocab_size=VOCAB, with_entropy=True)  # fmt: skip
    loss(lin).backward()
    out = dict(res=tuple(res), grad=xg.grad, lin=tuple(lin), dh=hg.grad, dw=wg.grad)
    if world > 1:  # the last rank holds another kept set for row 4
        mine = other if rank == world - 1 else ids
        for validate in (True, False):
            try:
                got = replay_logprobs(x[:, lo:hi], t, mine, offsets, tp_group=group,
                                      vocab_start=lo, validate=validate).logprobs  # fmt: skip
                out[validate] = ("returned", got)
            except ValueError as exc:
                out[validate] = ("raised", str(exc))
        # another function on another rank, validate=False: NaN on every rank
        if rank == 0:
            got = exactlogp.selected_logprobs(x[:, lo:hi], t, tp_group=group, vocab_start=lo,
                                              validate=False).logprobs  # fmt: skip
        else:
            got = replay_logprobs(x[:, lo:hi], t, ids, offsets, tp_group=group, vocab_start=lo,
                                  validate=False).logprobs  # fmt: skip
        out["functions"] = got
    return out


@pytest.fixture(scope="module")
def world_data():
    x, t = inputs(torch.bfloat16, seed=12)
    _, ids, offsets, _ = kept_sets(t, VOCAB, seed=6)
    h, w, _ = lm_head_inputs(ROWS, 16, VOCAB, torch.bfloat16, seed=7)
    other = ids.clone()  # row 4 with one id, not its target, moved to a free neighbour
    row = ids[offsets[4] : offsets[5]].tolist()
    j = next(j for j, v in enumerate(row) if v != int(t[4]) and v + 1 not in row and v + 1 < VOCAB
             and (j + 1 == len(row) or row[j + 1] > v + 1))  # fmt: skip
    other[int(offsets[4]) + j] += 1
    return x, t, ids, offsets, h, w, other


@pytest.mark.parametrize("world", [1, 2, 3])
def test_every_tp_degree_gives_the_tp1_bits_and_fails_closed(world, world_data):
    per_rank = run_gloo_world(world, _replay_worker, world_data, timeout=120)
    want = _replay_worker(0, 1, None, world_data)
    for rank, got in enumerate(per_rank):
        lo, hi = _bounds(world)[rank : rank + 2]
        what = f"world {world} rank {rank}"
        for a, b in zip(got["res"] + got["lin"], want["res"] + want["lin"], strict=True):
            assert_bitwise_equal(a, b, what)
        assert_bitwise_equal(got["grad"], want["grad"][:, lo:hi], f"{what} gradient")
        assert_bitwise_equal(got["dh"], want["dh"], f"{what} hidden gradient")
        assert_bitwise_equal(got["dw"], want["dw"][lo:hi], f"{what} weight gradient")
        if world > 1:
            kind, text = got[True]
            assert kind == "raised" and "disagree on the kept set of row[4]" in text, text
            kind, value = got[False]
            assert kind == "returned" and bool(torch.isnan(value).all()), what
            assert bool(torch.isnan(got["functions"]).all()), what
