"""Fail closed across ranks, in real gloo worlds on 127.0.0.1.

Every case runs a call that the ranks of the TP group make inconsistently; with
validate=True every rank must raise a clear ValueError (or its own argument error) within
seconds, never return numbers, hang or abort; with validate=False every output on every
rank must be NaN. After each case each rank makes a correct call, which must give the TP=1
bits: the process group is still usable. One world of 4 ranks runs every test's cases
(module fixture `results`), each test's in a process group of its own (the first 2 ranks
for the 2-rank tests), so the process start-up is paid once.
"""

from __future__ import annotations

import math
import re
import threading
import time

import pytest
import torch

import exactlogp
from exactlogp import contract
from exactlogp.testing import assert_bitwise_equal, llm_like_logits, run_gloo_world

VOCAB = 507
ROWS = 6
FAST_S = 30.0  # "within seconds" on a loaded 2-core machine


def make_inputs():
    x, t = llm_like_logits(ROWS, VOCAB, torch.bfloat16, seed=31)
    t[4] = -100
    return x, t


def even_shard(x, rank, world):
    """Megatron's layout: equal widths, the last padded past VOCAB with NaN (never read)."""
    per = -(-VOCAB // world)
    pad = torch.full((x.shape[0], per * world - VOCAB), float("nan"), dtype=x.dtype)
    return torch.cat([x, pad], dim=1)[:, rank * per : (rank + 1) * per]


def good_call(rank, world, group, inputs):
    x, t = inputs
    res = exactlogp.selected_logprobs(
        even_shard(x, rank, world), t, tp_group=group, vocab_size=VOCAB, with_entropy=True
    )
    return res.logprobs, res.entropy


def _split(x, bounds, rank):
    lo, hi = bounds[rank], bounds[rank + 1]
    return x[:, lo:hi], lo


# --- the cases: each makes one call, inconsistent across ranks ---


def overlap(rank, world, group, inputs, validate=True):
    x, t = inputs
    ranges = [(0, 300), (200, VOCAB)] + [(VOCAB, VOCAB)] * (world - 2)
    lo, hi = ranges[rank]
    return exactlogp.selected_logprobs(
        x[:, lo:hi], t, tp_group=group, vocab_start=lo, validate=validate
    ).logprobs


def gap(rank, world, group, inputs):
    x, t = inputs
    ranges = [(0, 200), (300, VOCAB)] + [(VOCAB, VOCAB)] * (world - 2)
    lo, hi = ranges[rank]
    return exactlogp.selected_logprobs(x[:, lo:hi], t, tp_group=group, vocab_start=lo).logprobs


def uneven_default_start(rank, world, group, inputs):
    x, t = inputs
    bounds = [0, 300, *range(300 + 207 // (world - 1), VOCAB, 207 // (world - 1))][:world]
    bounds.append(VOCAB)
    shard, _ = _split(x, bounds, rank)
    return exactlogp.selected_logprobs(shard, t, tp_group=group).logprobs


def _even(rank, world, group, inputs, validate=True, **kw):
    x, t = inputs
    return exactlogp.selected_logprobs(
        even_shard(x, rank, world), t, tp_group=group, validate=validate, **kw
    ).logprobs


def vocab_size_differs(rank, world, group, inputs):
    return _even(rank, world, group, inputs, vocab_size=VOCAB if rank == 0 else VOCAB - 1)


def temperature_differs(rank, world, group, inputs, validate=True):
    return _even(
        rank, world, group, inputs, validate, vocab_size=VOCAB, temperature=1.0 if rank else 0.7
    )


def temperature_kind_differs(rank, world, group, inputs):
    tau = 1.0 if rank == 0 else torch.ones(ROWS)
    return _even(rank, world, group, inputs, vocab_size=VOCAB, temperature=tau)


def row_temperature_differs(rank, world, group, inputs, validate=True):
    tau = torch.full((ROWS,), 0.8)
    if rank == world - 1:
        tau[3] = 0.9
    return _even(rank, world, group, inputs, validate, vocab_size=VOCAB, temperature=tau)


def with_entropy_differs(rank, world, group, inputs):
    return _even(rank, world, group, inputs, vocab_size=VOCAB, with_entropy=rank == 1)


def ignore_index_differs(rank, world, group, inputs):
    return _even(rank, world, group, inputs, vocab_size=VOCAB, ignore_index=-100 if rank else -1)


def keep_mask_differs(rank, world, group, inputs):
    x, t = inputs
    shard = even_shard(x, rank, world)
    mask = torch.ones_like(shard, dtype=torch.bool) if rank == 1 else None
    return _even(rank, world, group, inputs, vocab_size=VOCAB, keep_mask=mask)


def contract_differs(rank, world, group, inputs):
    before = contract.CONTRACT
    if rank == 1:
        contract.CONTRACT = "exactlogp-v0"  # as a rank running another exactlogp would
    try:
        return _even(rank, world, group, inputs, vocab_size=VOCAB)
    finally:
        contract.CONTRACT = before


def rows_differ(rank, world, group, inputs):
    x, t = inputs
    rows = ROWS - 1 if rank == 1 else ROWS
    return exactlogp.selected_logprobs(
        even_shard(x, rank, world)[:rows], t[:rows], tp_group=group, vocab_size=VOCAB
    ).logprobs


def no_rows_on_one_rank(rank, world, group, inputs):
    x, t = inputs
    rows = 0 if rank == 1 else ROWS
    return exactlogp.selected_logprobs(
        even_shard(x, rank, world)[:rows], t[:rows], tp_group=group, vocab_size=VOCAB
    ).logprobs


def targets_differ(rank, world, group, inputs, validate=True):
    x, t = inputs
    t = t.clone()
    if rank == world - 1:
        t[2] = 7
    return exactlogp.selected_logprobs(
        even_shard(x, rank, world), t, tp_group=group, vocab_size=VOCAB, validate=validate
    ).logprobs


def argument_error_on_one_rank(rank, world, group, inputs):
    x, t = inputs
    target = t.float() if rank == 1 else t
    return exactlogp.selected_logprobs(
        even_shard(x, rank, world), target, tp_group=group, vocab_size=VOCAB
    ).logprobs


def requires_grad_differs(rank, world, group, inputs):
    x, t = inputs
    shard = even_shard(x, rank, world).clone().requires_grad_(rank == 0)
    return exactlogp.selected_logprobs(shard, t, tp_group=group, vocab_size=VOCAB).logprobs


def overlap_unvalidated(rank, world, group, inputs):
    return overlap(rank, world, group, inputs, validate=False)


def temperature_differs_unvalidated(rank, world, group, inputs):
    return temperature_differs(rank, world, group, inputs, validate=False)


def row_temperature_differs_unvalidated(rank, world, group, inputs):
    return row_temperature_differs(rank, world, group, inputs, validate=False)


def targets_differ_unvalidated(rank, world, group, inputs):
    return targets_differ(rank, world, group, inputs, validate=False)


# --- the exact cut: the functions of one call differ between ranks, and rows it cannot
# serve; sample's -1 and an empty keep mask are checked as NaN ---


def _as_nan(ids: torch.Tensor) -> torch.Tensor:
    """sample's ids with -1 (no token) as NaN, for the every-output-NaN check."""
    return torch.where(ids == -1, float("nan"), ids.to(torch.float32))


def _mask_as_nan(mask) -> torch.Tensor:
    """A SamplingMask's threshold where its row keeps nothing (NaN: a row it cannot cut)."""
    return torch.where(mask.keep_mask.any(-1), 0.0, mask.threshold)


def _run_cut(fn, rank, world, group, inputs, validate, x=None, **kw):
    x_all, t = inputs
    shard = even_shard(x_all if x is None else x, rank, world)
    common = dict(tp_group=group, vocab_size=VOCAB, validate=validate, **kw)
    if fn == "processed":
        return exactlogp.processed_logprobs(shard, t, top_k=5, top_p=0.9, **common).logprobs
    if fn == "plain":
        return exactlogp.selected_logprobs(shard, t, **common).logprobs
    if fn == "sample":
        u = torch.full((ROWS,), 0.5, dtype=torch.float64)
        return _as_nan(exactlogp.sample(shard, uniforms=u, top_k=5, top_p=0.9, **common))
    return _mask_as_nan(exactlogp.sampling_mask(shard, top_k=5, top_p=0.9, **common))


def _functions_differ(first, other, validate):
    def case(rank, world, group, inputs):
        return _run_cut(first if rank == 0 else other, rank, world, group, inputs, validate)

    case.__name__ = f"{first}_vs_{other}"
    return case


def _bad_rows(fn, what, validate):
    """Row 2 cannot be cut: a per-row temperature of -1 / +inf / NaN / 1e-50 (float64,
    0 in fp32: not a greedy row), or a NaN / +inf logit on the last rank's shard only;
    validate=False: that row alone is NaN (-1, an empty keep mask)."""

    def case(rank, world, group, inputs):
        x, t = inputs
        tau = torch.full((ROWS,), 0.8, dtype=torch.float64)
        if what in ("-inf", "nan_tau", "tiny"):
            tau[2] = {"-inf": -1.0, "nan_tau": float("nan"), "tiny": 1e-50}[what]
        if what in ("nan", "inf"):
            x = x.clone()
            x[2, VOCAB - 3] = float(what)  # on the last rank's shard
        out = _run_cut(fn, rank, world, group, (x, t), validate, temperature=tau)
        return out if validate else out[2:3]

    return case


CUT_CASES = {
    "processed_vs_plain": (_functions_differ("processed", "plain", True),
                           r"disagree on the function called \(rank 0: processed_logprobs, "
                           r"rank 1: selected_logprobs\)"),
    "sample_vs_processed": (_functions_differ("sample", "processed", True),
                            r"disagree on the function called \(rank 0: sample, rank 1: "
                            r"processed_logprobs\)"),
    "mask_vs_processed": (_functions_differ("mask", "processed", True),
                          r"disagree on the function called \(rank 0: sampling_mask, rank 1: "
                          r"processed_logprobs\)"),
    "processed_vs_plain_unvalidated": (_functions_differ("processed", "plain", False), None),
    "plain_vs_processed_unvalidated": (_functions_differ("plain", "processed", False), None),
    "sample_vs_processed_unvalidated": (_functions_differ("sample", "processed", False), None),
    "mask_vs_processed_unvalidated": (_functions_differ("mask", "processed", False), None),
    "sample_vs_mask_unvalidated": (_functions_differ("sample", "mask", False), None),
    "sample_vs_plain_unvalidated": (_functions_differ("sample", "plain", False), None),
    "sample_negative_temperature": (_bad_rows("sample", "-inf", True),
                                    r"temperature\[2\] = -1.0 must be finite and > 0"),
    "mask_nan_temperature": (_bad_rows("mask", "nan_tau", True),
                             r"temperature\[2\] = nan must be finite and > 0"),
    "processed_tiny_temperature": (_bad_rows("processed", "tiny", True),
                                   r"temperature\[2\] = 0.0 must be finite and > 0"),
    "sample_nan_row": (_bad_rows("sample", "nan", True),
                       r"vocab_parallel_logits row\[2\] has NaN or \+inf values"),
    "mask_inf_row": (_bad_rows("mask", "inf", True),
                     r"vocab_parallel_logits row\[2\] has NaN or \+inf values"),
    "sample_negative_temperature_unvalidated": (_bad_rows("sample", "-inf", False), None),
    "sample_tiny_temperature_unvalidated": (_bad_rows("sample", "tiny", False), None),
    "processed_tiny_temperature_unvalidated": (_bad_rows("processed", "tiny", False), None),
    "sample_nan_row_unvalidated": (_bad_rows("sample", "nan", False), None),
    "mask_inf_row_unvalidated": (_bad_rows("mask", "inf", False), None),
}  # fmt: skip


CASES = {  # name -> (call, message every rank must raise, or None: every output NaN)
    "overlap": (overlap, r"do not tile the vocabulary: rank 0 holds \[0, 300\) and rank 1 "
                r"holds \[200, 507\): token ids \[200, 300\) are held twice"),
    "gap": (gap, r"do not tile the vocabulary: no rank holds token ids \[200, 300\)"),
    "uneven_default_start": (uneven_default_start, r"vocab_start was not passed, so each shard "
                             r"was placed at rank \* V_local, which only holds for shards of "
                             r"equal width \(here rank 0: 300, rank 1: \d+"),
    "vocab_size": (vocab_size_differs, r"disagree on vocab_size \(rank 0: 507, rank 1: 506"),
    "temperature": (temperature_differs, r"disagree on temperature \(rank 0: 0\.7, rank 1: 1\b"),
    "temperature_kind": (temperature_kind_differs, r"disagree on temperature \(rank 0: 1, "
                         r"rank 1: a per-row tensor\)"),
    "row_temperature": (row_temperature_differs, r"disagree on the temperature of row\[3\]: "
                        r"every rank must pass the same rows"),
    "requires_grad": (requires_grad_differs, r"disagree on which inputs require a gradient "
                      r"\(rank 0: vocab_parallel_logits, rank 1: none\); every rank must "
                      r"make the same inputs require a gradient"),
    "with_entropy": (with_entropy_differs, r"disagree on with_entropy \(rank 0: False, rank 1: True"),
    "ignore_index": (ignore_index_differs, r"disagree on ignore_index \(rank 0: -1, rank 1: -100"),
    "keep_mask": (keep_mask_differs, r"disagree on keep_mask \(rank 0: None, rank 1: a tensor"),
    "contract": (contract_differs, r"disagree on the contract version .*another exactlogp version"),
    "rows": (rows_differ, r"disagree on the number of rows \(rank 0: 6, rank 1: 5\)"),
    "no_rows_on_one_rank": (no_rows_on_one_rank, r"disagree on the number of rows \(rank 0: 6, rank 1: 0[,)]"),
    "targets": (targets_differ, r"disagree on target\[2\] is \d+ on some ranks and \d+ on others"),
    "argument_error": (argument_error_on_one_rank, r"rank 1 of tp_group rejected its arguments "
                       r"\(rank 1: TypeError: target must hold integer token ids, got dtype "
                       r"torch.float32\); this rank \(rank [02-9]\) raises too|^TypeError: target must"),
    "overlap_unvalidated": (overlap_unvalidated, None),
    "temperature_unvalidated": (temperature_differs_unvalidated, None),
    "row_temperature_unvalidated": (row_temperature_differs_unvalidated, None),
    "targets_unvalidated": (targets_differ_unvalidated, None),
    **CUT_CASES,
}  # fmt: skip


def cases_worker(rank, world, group, names, inputs):
    out = {}
    for name in names:
        call, _ = CASES[name]
        start = time.monotonic()
        try:
            value = ("returned", call(rank, world, group, inputs))
        except Exception as exc:
            value = ("raised", f"{type(exc).__name__}: {exc}")
        out[name] = (*value, time.monotonic() - start, good_call(rank, world, group, inputs))
    return out


@pytest.fixture(scope="module")
def expected():
    x, t = make_inputs()
    res = exactlogp.selected_logprobs(x, t, with_entropy=True)
    return res.logprobs, res.entropy


def _check(results, names, expected):
    for rank, out in enumerate(results):
        for name in names:
            kind, value, seconds, (lp, ent) = out[name]
            what = f"{name}, rank {rank}"
            message = CASES[name][1]
            if message is None:  # validate=False: every output of the call is NaN
                assert kind == "returned", f"{what}: {value}"
                assert torch.isnan(value).all(), f"{what}: {value}"
            else:
                assert kind == "raised", f"{what} returned {value}"
                assert value.startswith(("ValueError", "TypeError")), f"{what}: {value}"
                pattern = message.split("|")
                assert any(re.search(p, value) for p in pattern), f"{what}: {value}"
            assert seconds < FAST_S, f"{what} took {seconds:.1f} s"
            assert_bitwise_equal(lp, expected[0], f"{what}: the call after it")
            assert_bitwise_equal(ent, expected[1], f"{what}: the call after it")


FOUR_RANK_CASES = ["overlap", "gap", "uneven_default_start", "targets", "row_temperature",
                   "processed_vs_plain_unvalidated", "sample_vs_processed_unvalidated",
                   "mask_nan_temperature", "sample_nan_row_unvalidated",
                   "no_rows_on_one_rank", "argument_error", "targets_unvalidated"]  # fmt: skip


def test_two_ranks_fail_closed_on_every_inconsistency(expected, results):
    names = list(CASES)
    _check(results["two_ranks"], names, expected)


def test_four_ranks_fail_closed_on_layouts_and_rows(expected, results):
    _check(results["four_ranks"], FOUR_RANK_CASES, expected)


# --- a rank outside the group, and threads ---


def non_member_worker(rank, world, group, inputs):
    import torch.distributed as dist

    pair = dist.new_group([0, 1])  # every rank takes part in creating it
    if rank == 2:
        try:
            exactlogp.selected_logprobs(inputs[0], inputs[1], tp_group=pair)
        except ValueError as exc:
            return str(exc)
        return "returned"
    return good_call(rank, 2, pair, inputs)


def test_a_rank_outside_the_group_raises_clearly_and_the_members_go_on(expected, results):
    results = results["non_member"]
    assert len(results) == 3
    assert results[2].startswith("this process (global rank 2) is not a member of tp_group")
    for lp, ent in results[:2]:
        assert_bitwise_equal(lp, expected[0])
        assert_bitwise_equal(ent, expected[1])


def threads_worker(rank, world, group, inputs):
    """Two threads per rank, started in opposite orders on the two ranks, so their calls
    pair up across ranks wrongly: every call must raise or give its own TP=1 bits."""
    x, t = inputs
    targets = {"a": t, "b": t.roll(1)}
    order = ["a", "b"] if rank == 0 else ["b", "a"]
    outcome = {}

    def run(name):
        try:
            outcome[name] = ("returned", _even(rank, world, group, (x, targets[name]),
                                               vocab_size=VOCAB))  # fmt: skip
        except Exception as exc:
            outcome[name] = ("raised", f"{type(exc).__name__}: {exc}")

    threads = []
    for name in order:
        threads.append(threading.Thread(target=run, args=(name,)))
        threads[-1].start()
        time.sleep(0.5)
    for th in threads:
        th.join(120)
    return outcome, good_call(rank, world, group, inputs)


def test_threads_sharing_a_group_never_mix_their_calls(expected, results):
    x, t = make_inputs()
    own = {"a": t, "b": t.roll(1)}
    results = results["threads"]
    assert len(results) == 2
    for rank, (outcome, (lp, ent)) in enumerate(results):
        assert_bitwise_equal(ent, expected[1])
        assert set(outcome) == {"a", "b"}, outcome
        # the opposite start orders did pair different calls, and that was caught
        assert any(kind == "raised" for kind, _ in outcome.values()), outcome
        for name, (kind, value) in outcome.items():
            if kind == "returned":
                want = exactlogp.selected_logprobs(x, own[name]).logprobs
                assert_bitwise_equal(value, want, f"rank {rank} thread {name}")
            else:
                assert "disagree on target" in value, value
        assert_bitwise_equal(lp, expected[0])


# --- what the agreement costs: its collectives ---


def collectives_worker(rank, world, group, inputs, validate):
    import torch.distributed as dist

    calls = []
    real_reduce, real_gather = dist.all_reduce, dist.all_gather

    def reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        calls.append(("all_reduce", str(op), str(tensor.dtype), tuple(tensor.shape)))
        return real_reduce(tensor, op=op, group=group, async_op=async_op)

    def gather(parts, tensor, group=None, async_op=False):
        calls.append(("all_gather", str(tensor.dtype), tuple(tensor.shape)))
        return real_gather(parts, tensor, group=group, async_op=async_op)

    dist.all_reduce, dist.all_gather = reduce, gather
    try:
        x, t = inputs
        xs = even_shard(x, rank, world).clone().requires_grad_(True)
        res = exactlogp.selected_logprobs(
            xs, t, tp_group=group, vocab_size=VOCAB, with_entropy=True, validate=validate
        )
        forward_calls = list(calls)
        (res.logprobs.sum() + res.entropy.sum() + res.lse.sum()).backward()
    finally:
        dist.all_reduce, dist.all_gather = real_reduce, real_gather
    return forward_calls, calls[len(forward_calls) :]


@pytest.mark.parametrize("validate", [True, False])
def test_collectives_per_forward_and_none_in_backward(validate, results):
    from exactlogp import agreement

    results = results["collectives", validate]
    assert len(results) == 2
    for forward_calls, backward_calls in results:
        exact = [
            (
                "all_reduce",
                "RedOpType.MAX",
                "torch.float32",
                (11 * ROWS + 6 + agreement.NUM_KINDS + 2 * 2,),
            ),
            ("all_reduce", "RedOpType.SUM", "torch.int64", (ROWS, contract.NUM_COLS)),
        ]
        agree = [("all_gather", "torch.int64", (agreement.VECTOR_LEN,))]
        assert forward_calls == (agree + exact if validate else exact)
        assert backward_calls == []


# --- one world for every test above ---


def every_test_worker(rank, world, group, inputs):
    """{test case: this rank's result}. Each case gets a process group of its own, of the
    first ranks it needs (every rank creates every group, in the same order)."""
    import torch.distributed as dist

    def first(size):
        return dist.new_group(list(range(size)))

    out = {}
    for validate in (True, False):  # first: nothing else has run on these ranks yet
        pair = first(2)
        if rank < 2:
            out["collectives", validate] = collectives_worker(rank, 2, pair, inputs, validate)
    pair = first(2)
    if rank < 2:
        out["two_ranks"] = cases_worker(rank, 2, pair, list(CASES), inputs)
    out["four_ranks"] = cases_worker(rank, world, first(world), FOUR_RANK_CASES, inputs)
    if rank < 3:  # a world of 3 as the test describes it; it makes its own pair (0, 1)
        out["non_member"] = non_member_worker(rank, 3, group, inputs)
    else:
        dist.new_group([0, 1])  # that pair: every rank takes part in creating it
    pair = first(2)
    if rank < 2:
        out["threads"] = threads_worker(rank, 2, pair, inputs)
    return out


@pytest.fixture(scope="module")
def results():
    """{test case: [each rank's result]}, from one spawned world of 4 ranks."""
    per_rank = run_gloo_world(4, every_test_worker, make_inputs(), timeout=300)
    cases = {case for out in per_rank for case in out}
    return {case: [out[case] for out in per_rank if case in out] for case in cases}


def test_field_values_are_shown_as_the_user_wrote_them():
    from exactlogp import agreement

    assert agreement._show("temperature", contract.fp32_bits(0.5)) == "0.5"
    assert agreement._show("vocab_size", -1) == "None"
    assert agreement._show("kind", agreement.KIND_LINEAR) == "linear_selected_logprobs"
    assert math.isnan(float(agreement._show("temperature", contract.fp32_bits(math.nan))))


def test_the_row_hash_sees_every_small_edit():
    """agreement.row_hash (the fused head's hidden states, the backward's upstream
    gradients): every one-bit flip, the +1 +1 -1 ulp edits that cancel in a weighted
    checksum, swaps, and a row one element longer all change a row's 48 bits; rows differ
    only where they were edited."""
    from exactlogp.agreement import row_hash

    gen = torch.Generator().manual_seed(5)
    for dtype in (torch.bfloat16, torch.float32):
        rows = torch.randn(3, 24, generator=gen).to(dtype)
        base = row_hash(rows)
        bits = rows.view({2: torch.int16, 4: torch.int32}[rows.element_size()])
        edits = []
        for k in range(24):  # every single-bit flip of row 1
            for b in range(8 * rows.element_size()):
                e = bits.clone()
                e[1, k] ^= 1 << b if b < 8 * rows.element_size() - 1 else -(1 << b)
                edits.append(e)
        for i, j, m in ((0, 1, 2), (3, 5, 7), (20, 21, 22)):  # +1 +1 -1 ulp
            e = bits.clone()
            e[1, i] += 1
            e[1, j] += 1
            e[1, m] -= 1
            edits.append(e)
        for i, j in ((0, 1), (4, 19)):  # swaps
            e = bits.clone()
            e[1, [i, j]] = e[1, [j, i]]
            edits.append(e)
        for e in edits:
            got = row_hash(e.view(dtype))
            assert not torch.equal(got[:, 1], base[:, 1])
            assert torch.equal(got[:, [0, 2]], base[:, [0, 2]])
    a = torch.ones(1, 5, dtype=torch.bfloat16)
    assert not torch.equal(row_hash(a), row_hash(torch.cat([a, torch.zeros_like(a[:, :1])], 1)))
    assert row_hash(a).shape == (2, 1) and int(row_hash(a).max()) < 2**24
