"""What a candidate is: a named way to turn vocab-sharded logits into selected logprobs.

The harness gives every candidate the same shared logits, cut into the shards its own
framework would hold (each framework pads the vocabulary its own way; padding columns
are -inf so they never change a softmax), and calls `build(ctx)` once inside a real
torch.distributed world. The returned function maps one shard of rows to fp32 logprobs
of the global targets; it must issue the same collectives on every rank.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

LogprobFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (N, V_local), (N,) -> (N,)


class Unavailable(Exception):
    """The candidate cannot run here; the message is what the report shows."""


@dataclass(frozen=True)
class ShardContext:
    rank: int  # rank inside the TP group
    tp: int  # TP degree
    group: object  # the TP process group (real, gloo or NCCL)
    device: torch.device
    vocab_size: int  # real vocabulary
    padded_vocab: int  # columns over all shards, padding included
    vocab_start: int  # global id of this shard's first column

    @property
    def shard_width(self) -> int:
        return self.padded_vocab // self.tp


class Candidate:
    """Base class; subclasses set the class attributes and implement `build`."""

    name = "base"
    summary = ""  # one sentence: exactly what runs
    implementation = "real"  # "ours", "real" (third-party code) or "re-implementation"
    tp1_only = False
    max_timed_runs: int | None = None  # None: the report's --repeats

    def check_available(self, device: torch.device) -> None:
        """Raise Unavailable (cheaply, before any world is started) if this cannot run."""

    def padded_vocab(self, vocab_size: int, tp: int) -> int:
        """The vocabulary width this framework shards at this TP degree."""
        return round_up(vocab_size, tp)

    def third_party(self) -> list[dict]:
        """[{name, version}] of every real third-party package this candidate calls."""
        return []

    def describe(self) -> dict:
        return {"summary": self.summary, "implementation": self.implementation}

    def build(self, ctx: ShardContext) -> LogprobFn:
        raise NotImplementedError

    def teardown(self) -> None:
        """Undo global state set by `build` (parallel state, compiled graphs)."""


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def import_or_unavailable(module: str):
    """Import `module`, turning any import failure into Unavailable with its exact text."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # optional-dependency notices at import time
            return importlib.import_module(module)
    except Exception as exc:  # a broken install can raise anything at import time
        raise Unavailable(f"{type(exc).__name__}: {exc}") from exc


def package_version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def owned_target(target: torch.Tensor, ctx: ShardContext) -> tuple[torch.Tensor, torch.Tensor]:
    """(owned (N,) bool, local column (N,) int64, 0 where not owned) of the global targets."""
    local = target - ctx.vocab_start
    owned = (local >= 0) & (local < ctx.shard_width)
    return owned, torch.where(owned, local, torch.zeros_like(local))


def all_gather_cat(tensor: torch.Tensor, ctx: ShardContext, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's `tensor` in rank order along `dim` (moves bytes, no math)."""
    if ctx.tp == 1:
        return tensor
    import torch.distributed as dist

    parts = [torch.empty_like(tensor) for _ in range(ctx.tp)]
    dist.all_gather(parts, tensor.contiguous(), group=ctx.group)
    return torch.cat(parts, dim=dim)


def in_row_blocks(fn: LogprobFn, block_rows: int) -> LogprobFn:
    """Apply a row-wise fn in blocks of rows, so full-vocabulary fp32 copies stay bounded.

    Every rank runs the same number of blocks, so collectives inside fn stay matched.
    """

    def run(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        outs = [
            fn(logits[i : i + block_rows], target[i : i + block_rows])
            for i in range(0, logits.shape[0], block_rows)
        ]
        return torch.cat(outs) if outs else logits.new_empty(0, dtype=torch.float32)

    return run
