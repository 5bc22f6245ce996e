"""Bitwise invariance in one process: padding, batch composition, repeats, and any split
of the vocabulary into shards (stages combined exactly as the two collectives would).

Real multi-process gloo worlds are in test_distributed.py.
"""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from exactlogp import contract, selected_logprobs
from exactlogp.backends import ShardPlan, get_backend
from exactlogp.temperature import Temperature
from exactlogp.testing import assert_bitwise_equal, llm_like_logits, simulate_shards

QWEN3_NEXT_VOCAB = 151936


def outputs(x, t, **kw):
    return selected_logprobs(x, t, with_entropy=True, **kw)


def assert_results_equal(a, b, what=""):
    for name, u, v in zip(("logprobs", "entropy", "lse"), a, b, strict=True):
        assert_bitwise_equal(u, v, f"{what} {name}")


def test_megatron_and_vllm_paddings_give_the_same_bits():
    x, t = llm_like_logits(2, QWEN3_NEXT_VOCAB, torch.bfloat16, seed=1)
    garbage = torch.full((2, 152064 - QWEN3_NEXT_VOCAB), 3.0e4, dtype=torch.bfloat16)
    garbage[:, ::7] = float("nan")
    megatron = outputs(torch.cat([x, garbage], 1), t, vocab_size=QWEN3_NEXT_VOCAB)
    vllm = outputs(torch.cat([x, garbage[:, :64]], 1), t, vocab_size=QWEN3_NEXT_VOCAB)
    unpadded = outputs(x, t)
    assert_results_equal(megatron, unpadded, "128*TP padding")
    assert_results_equal(vllm, unpadded, "64 padding")


def test_batch_composition_and_repeats_do_not_change_a_bit():
    x, t = llm_like_logits(24, 3001, torch.bfloat16, seed=2)
    full = outputs(x, t)
    for _ in range(3):
        assert_results_equal(outputs(x, t), full, "repeat")
    for i in (0, 7, 23):
        alone = outputs(x[i : i + 1], t[i : i + 1])
        assert_results_equal([o[i : i + 1] for o in full], alone, f"row {i} alone")
    perm = torch.randperm(24, generator=torch.Generator().manual_seed(0))
    assert_results_equal([o[perm] for o in full], outputs(x[perm], t[perm]), "permuted")
    extra, et = llm_like_logits(40, 3001, torch.bfloat16, seed=3)
    among = outputs(torch.cat([extra[:9], x, extra[9:]]), torch.cat([et[:9], t, et[9:]]))
    assert_results_equal([o[9:33] for o in among], full, "among extra rows")
    nested = outputs(x.view(4, 6, -1), t.view(4, 6))
    assert_results_equal([o.reshape(-1) for o in nested], full, "leading dims")


# --- any split of the vocabulary: the stage functions combined in one process ---


@st.composite
def sharded_cases(draw):
    vocab = draw(st.integers(1, 300))
    padding = draw(st.integers(0, 20))
    num_shards = draw(st.integers(1, 8))
    cuts = sorted(draw(st.lists(st.integers(0, vocab + padding), min_size=num_shards - 1,
                                max_size=num_shards - 1)))  # fmt: skip
    rows = draw(st.integers(1, 6))
    seed = draw(st.integers(0, 2**31 - 1))
    return dict(
        vocab=vocab, padding=padding, boundaries=[0, *cuts, vocab + padding], rows=rows,
        seed=seed, dtype=draw(st.sampled_from([torch.bfloat16, torch.float16, torch.float32])),
        use_mask=draw(st.booleans()), per_row_tau=draw(st.booleans()),
        permute=draw(st.booleans()),
    )  # fmt: skip


def make_inputs(case):
    gen = torch.Generator().manual_seed(case["seed"])
    rows, vocab, total = case["rows"], case["vocab"], case["vocab"] + case["padding"]
    x = (torch.randn(rows, total, generator=gen) * 4).to(case["dtype"])
    x[:, vocab:] = float("nan")  # padding must never be read into a result
    t = torch.randint(0, vocab, (rows,), generator=gen)
    t[0] = -100 if rows > 1 else t[0]
    mask = None
    if case["use_mask"]:
        mask = torch.rand(rows, total, generator=gen) > 0.3
        mask[torch.arange(rows), t.clamp(min=0)] = True
    tau = 0.6 + torch.rand(rows, generator=gen) if case["per_row_tau"] else 0.9
    return x, t, mask, tau


@settings(max_examples=60, deadline=None)
@given(sharded_cases())
def test_any_shard_split_and_row_order_gives_the_tp1_bits(case):
    x, t, mask, tau = make_inputs(case)
    whole = outputs(x, t, vocab_size=case["vocab"], keep_mask=mask, temperature=tau)
    orders = None
    if case["permute"]:
        gen = torch.Generator().manual_seed(case["seed"] + 1)
        orders = [torch.randperm(case["rows"], generator=gen) for _ in case["boundaries"][1:]]
    split = simulate_shards(
        x, t, case["boundaries"], vocab_size=case["vocab"], temperature=tau,
        keep_mask=mask, row_order=orders,
    )  # fmt: skip
    assert_results_equal((split.logprobs, split.entropy, split.lse), whole, str(case))


@settings(max_examples=30, deadline=None)
@given(sharded_cases())
def test_each_gradient_shard_is_the_slice_of_the_tp1_gradient(case):
    x, t, mask, tau = make_inputs(case)
    xg = x.clone().requires_grad_(True)
    res = outputs(xg, t, vocab_size=case["vocab"], keep_mask=mask, temperature=tau)
    (res.logprobs.sum() - 0.5 * res.entropy.sum() + 0.25 * res.lse.sum()).backward()

    split = simulate_shards(
        x, t, case["boundaries"], vocab_size=case["vocab"], temperature=tau, keep_mask=mask
    )
    one = torch.ones(case["rows"], dtype=torch.float64)
    row_max = torch.full((case["rows"],), float("-inf"))
    backend = get_backend("reference", x.device)
    plans = [ShardPlan(lo, case["vocab"], -100, True) for lo in case["boundaries"][:-1]]
    tau_t = Temperature.of(tau)
    for plan, hi in zip(plans, case["boundaries"][1:], strict=True):
        m = None if mask is None else mask[:, plan.vocab_start : hi]
        row_max = torch.maximum(
            row_max, backend.row_max(x[:, plan.vocab_start : hi], tau_t, m, plan)
        )
    stats = contract.grad_stats(row_max, split, one, -0.5 * one, 0.25 * one)
    tau_t = tau_t.gradient_divisor(stats)
    for plan, hi in zip(plans, case["boundaries"][1:], strict=True):
        lo = plan.vocab_start
        m = None if mask is None else mask[:, lo:hi]
        shard_grad = backend.grad(x[:, lo:hi], t, tau_t, m, stats, plan)
        assert_bitwise_equal(shard_grad, xg.grad[:, lo:hi], f"grad shard [{lo}, {hi})")


def test_record_layout_is_the_documented_one():
    assert contract.NUM_COLS == 8
    assert (contract.COL_E_HI, contract.COL_E_LO, contract.COL_W_HI, contract.COL_W_LO) == (
        0,
        1,
        2,
        3,
    )
    assert (contract.COL_TARGET_BITS, contract.COL_OWNERS) == (4, 5)
    assert (contract.COL_TARGET_MASKED, contract.COL_NONFINITE) == (6, 7)
