"""One 2-rank gloo world for the slime adapter's tests (starting a world costs seconds):
each rank scores its half of the vocabulary with slime's function (the stand-in) and ours;
the tests compare with the same functions at TP = 1 in the test process
(`slime_scores(case(), 0, 1, None)`).
"""

from __future__ import annotations

import functools
import sys

import torch

from exactlogp.testing import llm_like_logits, run_gloo_world
from integration_stubs import STUB_ROOT

VOCAB, ROWS, HIDDEN = 500, 6, 16


def case(seed: int = 3) -> dict:
    logits, target = llm_like_logits(ROWS, VOCAB, torch.float32, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    mask = torch.rand(ROWS, VOCAB, generator=gen) < 0.3
    mask[0, target[0]] = False  # a target the mask drops: slime keeps it anyway
    return dict(
        logits=logits, target=target, mask=mask,
        hidden=torch.randn(ROWS, HIDDEN, generator=gen),
        weight=torch.randn(VOCAB, HIDDEN, generator=gen) / 2,
        bias=torch.randn(VOCAB, generator=gen),
        temperature=torch.rand(ROWS, generator=gen) + 0.5,
    )  # fmt: skip


def slime_scores(c: dict, rank: int, size: int, group) -> dict:
    """{(kind, who): (logp, entropy, grad of this shard)} for who in ours / slime."""
    from slime.utils import ppo_utils

    from exactlogp.integrations import slime

    cols = _cols(rank, size)
    out = {}
    for kind, keep in (("plain", None), ("masked", c["mask"][:, cols])):
        for who, fn in (("ours", slime.calculate_log_probs_and_entropy),
                        ("slime", ppo_utils.calculate_log_probs_and_entropy)):  # fmt: skip
            x = c["logits"][:, cols].clone().requires_grad_()
            logp, entropy = fn(x, c["target"], group, True, -1, keep)
            (logp.sum() + entropy.sum()).backward()
            out[(kind, who)] = (logp.detach(), entropy.detach(), x.grad)
    return out


def _cols(rank: int, size: int) -> slice:
    width = VOCAB // size
    return slice(rank * width, (rank + 1) * width)


def _world(rank, world_size, group, c, stubs):
    sys.path.insert(0, stubs)
    return slime_scores(c, rank, world_size, group), None


@functools.cache
def tp2_results() -> list:
    """[(slime_scores, None)] per rank of a 2-rank world, on case()."""
    return run_gloo_world(2, _world, case(), str(STUB_ROOT))
