"""Candidates at TP1 in this process, as the bench and the GPU check time them.

Each candidate is built through the same `ShardContext` as in the report's worlds, on a
process group of this process alone (`worlds.single_rank`), over the whole vocabulary
padded its own way. `Steps` gives its forward and, where it supports one, its
forward+backward: the logits as a fresh leaf, `cand.loss(out).backward()` inside
`cand.scope()`. Both return what the step produced, so nothing is freed before a clock
stops.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .. import worlds
from . import candidates
from .candidates.base import WORKLOADS
from .workload import cut_shard


@dataclass(frozen=True)
class Steps:
    name: str
    cols: int  # the columns the candidate gets, its padding included
    forward: Callable[[], object]
    forward_backward: Callable[[], object] | None  # None: the candidate has no backward


@contextlib.contextmanager
def tp1_steps(names, logits: torch.Tensor, target: torch.Tensor, *, skip_unavailable=False):
    """({name: Steps}, {name: why unavailable}) on (N, V) `logits` and (N,) `target`.

    A candidate that cannot run here raises Unavailable, or with `skip_unavailable` is
    left out with the reason. Every built candidate is torn down on exit.
    """
    device, vocab = logits.device, logits.shape[1]
    steps, skipped, built, padded_inputs = {}, {}, [], {}
    with worlds.single_rank(device) as group:
        try:
            for name in names:
                cand = candidates.create(name)
                try:
                    if cand.kind != "logits":
                        raise candidates.Unavailable(
                            f"{name} takes {WORKLOADS[cand.kind]}; TP1 steps give logits"
                        )
                    cand.check_available(device)
                except candidates.Unavailable as exc:
                    if not skip_unavailable:
                        raise
                    skipped[name] = str(exc)
                    continue
                padded = cand.padded_vocab(vocab, 1)
                if padded not in padded_inputs:
                    padded_inputs[padded] = (
                        logits if padded == vocab else cut_shard(logits, 0, padded, vocab)
                    )
                ctx = candidates.ShardContext(0, 1, group, device, vocab, padded, 0)
                built.append(cand)
                steps[name] = _steps(name, cand, cand.build(ctx), padded_inputs[padded], target)
            yield steps, skipped
        finally:
            for cand in built:
                cand.teardown()


def _steps(name: str, cand, fn, x: torch.Tensor, target: torch.Tensor) -> Steps:
    def forward():
        return fn(x, target)

    def forward_backward():
        leaf = x.detach().requires_grad_(True)
        with cand.scope():
            cand.loss(fn(leaf, target)).backward()
        return leaf.grad

    return Steps(name, x.shape[1], forward, forward_backward if cand.supports_backward else None)
