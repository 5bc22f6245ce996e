"""Real torch.distributed worlds (gloo on 127.0.0.1): every TP layout gives the TP=1 bits.

One world of 8 ranks runs every size (1, 2, 3, 4, 8 ranks) in process groups of its first
ranks, each group every layout, so process start-up is paid once. Each rank also logs every
collective it issues.
"""

import pytest
import torch
import torch.distributed as dist

from exactlogp import selected_logprobs
from exactlogp.testing import assert_bitwise_equal, llm_like_logits, run_gloo_world

WORLDS = (1, 2, 3, 4, 8)
VOCAB = 507  # odd, so even splits need padding and uneven splits are natural
ROWS = 6


def make_layouts(world: int):
    """name -> (per-rank [start, end) column ranges, vocab_size or None, padded width)."""
    padded = -(-VOCAB // world) * world + (world if world > 1 else 3)  # Megatron-like padding
    per = padded // world
    even = [(r * per, (r + 1) * per) for r in range(world)]
    gen = torch.Generator().manual_seed(world)
    cuts = sorted(torch.randint(0, VOCAB + 1, (world - 1,), generator=gen).tolist())
    if world >= 3:
        cuts[0], cuts[1] = 0, 1  # an empty shard and a shard of width 1
    bounds = [0, *cuts, VOCAB]
    uneven = [(bounds[r], bounds[r + 1]) for r in range(world)]
    return {"even": (even, VOCAB, padded), "uneven": (uneven, None, VOCAB)}


def make_inputs():
    x, t = llm_like_logits(ROWS, VOCAB, torch.bfloat16, seed=21)
    t[2] = -100
    gen = torch.Generator().manual_seed(22)
    mask = torch.rand(ROWS, VOCAB, generator=gen) > 0.25
    mask[torch.arange(ROWS), t.clamp(min=0)] = True
    tau = 0.5 + torch.rand(ROWS, generator=gen)
    return x, t, mask, tau


def pad(x, width, value=float("nan")):
    extra = torch.full((x.shape[0], width - x.shape[1]), value, dtype=x.dtype)
    return torch.cat([x, extra], dim=1)


def forward_backward(x, t, **kw):
    x = x.clone().requires_grad_(True)
    res = selected_logprobs(x, t, with_entropy=True, **kw)
    (res.logprobs.sum() + 0.5 * res.entropy.sum() - 0.25 * res.lse.sum()).backward()
    return res.logprobs, res.entropy, res.lse, x.grad


def world_worker(rank, world, group, layouts, inputs):
    x, t, mask, tau = inputs
    out = {}
    for name, (ranges, vocab_size, padded) in layouts.items():
        lo, hi = ranges[rank]
        shard, shard_mask = pad(x, padded)[:, lo:hi], pad(mask, padded, False)[:, lo:hi]
        start = None if name == "even" else lo  # "even" relies on the default rank * V_local
        variants = {"plain": {}, "masked": dict(keep_mask=shard_mask, temperature=tau)}
        for variant, kw in variants.items():
            out[name, variant] = forward_backward(
                shard, t, tp_group=group, vocab_start=start, vocab_size=vocab_size, **kw
            )
    # a NaN in one rank's shard poisons that row only, on every rank
    lo, hi = layouts["uneven"][0][rank]
    shard = x[:, lo:hi].clone()
    if lo <= 100 < hi:
        shard[4, 100 - lo] = float("nan")
    out["nan_row"] = selected_logprobs(
        shard, t, tp_group=group, vocab_start=lo, validate=False
    ).logprobs
    return out


def every_world_worker(rank, world, group, inputs):
    """world_worker in a process group of the first `size` ranks, for every size."""
    out = {}
    for size in WORLDS:
        sub = group if size == world else dist.new_group(list(range(size)))
        if rank < size:
            out[size] = world_worker(rank, size, sub, make_layouts(size), inputs)
    return out


@pytest.fixture(scope="module")
def results_by_world():
    """{size: [each rank's results]}, from one spawned world of max(WORLDS) ranks."""
    per_rank = run_gloo_world(max(WORLDS), every_world_worker, make_inputs(), timeout=240)
    return {size: [out[size] for out in per_rank[:size]] for size in WORLDS}


@pytest.fixture(scope="module")
def expected():
    x, t, mask, tau = make_inputs()
    return {
        "plain": forward_backward(x, t),
        "masked": forward_backward(x, t, keep_mask=mask, temperature=tau),
    }


@pytest.mark.parametrize("world", WORLDS)
def test_every_tp_layout_gives_the_tp1_bits(world, expected, results_by_world):
    layouts = make_layouts(world)
    results = results_by_world[world]
    assert len(results) == world
    for rank, out in enumerate(results):
        layout_results = {k: v for k, v in out.items() if isinstance(k, tuple)}
        assert len(layout_results) == 4
        for (name, variant), (lp, ent, lse, grad) in layout_results.items():
            exp = expected[variant]
            what = f"world {world} rank {rank} {name}/{variant}"
            assert_bitwise_equal(lp, exp[0], what + " logprobs")
            assert_bitwise_equal(ent, exp[1], what + " entropy")
            assert_bitwise_equal(lse, exp[2], what + " lse")
            lo, hi = layouts[name][0][rank]
            full_grad = pad(exp[3], layouts[name][2], 0.0)
            assert_bitwise_equal(grad, full_grad[:, lo:hi], what + " gradient shard")
        nan_row = out["nan_row"]
        assert torch.isnan(nan_row[4])
        keep = [0, 1, 2, 3, 5]
        assert_bitwise_equal(nan_row[keep], expected["plain"][0][keep], f"rank {rank} other rows")
