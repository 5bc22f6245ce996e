"""One 2-rank gloo world for the slime and vime adapter tests (starting a world costs
seconds): each rank scores its half of the vocabulary with slime's function (the stand-in)
and ours, and through vime's `compute_linear_logp` with our provider; the tests compare
with the same functions at TP = 1 in the test process (`slime_scores(case(), 0, 1, None)`).
"""

from __future__ import annotations

import functools
import sys
import types

import torch

from exactlogp.testing import llm_like_logits, run_gloo_world
from integration_stubs import STUB_ROOT

VOCAB, ROWS, HIDDEN = 500, 6, 16
PROVIDER = "exactlogp.integrations.vime.provider"


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


def vime_scores(c: dict, rank: int, size: int, group) -> dict:
    """{kind: (logp, entropy, grads)} from vime's compute_linear_logp, strict mode."""
    from vime.backends.megatron_utils import linear_logp_provider as vime

    cols = _cols(rank, size)
    out = {}
    for kind in ("plain", "per-row temperature", "masked", "fused"):
        x = c["logits"][:, cols].clone().requires_grad_()
        leaves, extra = [x], {}
        if kind == "fused":
            hidden = c["hidden"].clone().requires_grad_()
            weight = c["weight"][cols].clone().requires_grad_()
            leaves = [hidden, weight]
            x = (hidden @ weight.T + c["bias"][cols]).detach().requires_grad_()
            part = vime.VocabPartition(cols.start, cols.stop - cols.start, VOCAB, VOCAB)
            extra["context"] = vime.LinearLogpContext(
                hidden, vime.LinearProjection(weight, c["bias"][cols]), part
            )
        if kind == "masked":
            extra["log_prob_keep_mask"] = c["mask"][:, cols]
        tau = c["temperature"] if kind == "per-row temperature" else 0.8
        request = vime.LinearLogpRequest(
            x, c["target"], group, vime.TokenLayout(1, 0, "single"), with_entropy=True,
            with_entropy_grad=True, chunk_size=-1, temperature=tau,
            metadata={"real_vocab_size": VOCAB, "padded_vocab_size": VOCAB}, **extra,
        )  # fmt: skip
        logp, entropy = vime.compute_linear_logp(args=strict_args(), request=request,
                                                 native=_no_native)  # fmt: skip
        grads = torch.autograd.grad(logp.sum() + entropy.sum(), leaves)
        out[kind] = (logp.detach(), entropy.detach(), grads)
    return out


def strict_args(path: str = PROVIDER, mode: str = "strict"):
    return types.SimpleNamespace(linear_logp_provider=path, linear_logp_provider_mode=mode)


def _no_native(*args, **kwargs):
    raise AssertionError("strict mode with an importable provider never runs the native path")


def _cols(rank: int, size: int) -> slice:
    width = VOCAB // size
    return slice(rank * width, (rank + 1) * width)


def _world(rank, world_size, group, c, stubs):
    sys.path.insert(0, stubs)
    return slime_scores(c, rank, world_size, group), vime_scores(c, rank, world_size, group)


@functools.cache
def tp2_results() -> list:
    """[(slime_scores, vime_scores)] per rank of a 2-rank world, on case()."""
    return run_gloo_world(2, _world, case(), str(STUB_ROOT))
