"""What a candidate is: a named way to turn vocab-sharded logits (or the hidden states
and LM-head weight rows that make them) into selected logprobs.

One interface for every tool: the report builds candidates in spawned gloo/NCCL worlds
at every TP degree, the bench and the GPU check build them at TP1 on a process group of
one rank (`report/tp1.py`), through the same `ShardContext`.

`kind` is the workload a candidate takes (a key of WORKLOADS):

  "logits"         the shared logits, cut into the column shards its own framework would
                   hold (each framework pads the vocabulary its own way; padding columns
                   are -inf so they never change a softmax)
  "hidden_states"  the shared hidden states (N, H), the same on every rank, and the rows
                   of the LM-head weight (V, H) its framework would hold, padded the same
                   way (padding rows are zero; a candidate whose pipeline materialises
                   logits sets their columns to -inf, as the logits workload has them)

The harness calls `build(ctx)` once inside a real torch.distributed world (for a
"hidden_states" candidate, `ctx.weight` holds this rank's weight rows). The returned
function maps a batch of rows -- logits (N, V_local), or hidden states (N, H) -- and their
global targets (N,) to fp32 logprobs (or a tuple whose first item they are, when the
candidate computes more, such as the entropy); it must issue the same collectives on
every rank. Where `supports_backward` is set, the function is differentiable with
respect to the logits and `loss` gives the scalar a trainer would differentiate.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

LogprobFn = Callable[[torch.Tensor, torch.Tensor], object]  # rows, (N,) -> (N,) or tuple

# the workloads the harness gives, and what each candidate kind takes
WORKLOADS = {
    "logits": "vocab-parallel logits (N, V_local)",
    "hidden_states": "hidden states and the LM-head weight (fused LM-head candidates)",
}


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
    weight: torch.Tensor | None = None  # (shard_width, H) LM-head rows ("hidden_states")

    @property
    def shard_width(self) -> int:
        return self.padded_vocab // self.tp


class Candidate:
    """Base class; subclasses set the class attributes and implement `build`."""

    name = "base"
    summary = ""  # one sentence: exactly what runs
    implementation = "real"  # "ours", "real" (third-party code) or "re-implementation"
    kind = "logits"  # the workload it takes, a key of WORKLOADS
    tp1_only = False
    supports_backward = False  # build's function is differentiable w.r.t. the logits
    max_timed_runs: int | None = None  # the report's cap on timed runs; None: --repeats
    note: str | None = None  # shown beside the summary (why a re-implementation runs, say)

    @classmethod
    def from_params(cls, params: tuple[str, ...]) -> Candidate:
        """The candidate named "name[p1,p2,...]"; a class without parameters takes none."""
        if params:
            raise ValueError(f"candidate {cls.name!r} takes no parameters, got {list(params)}")
        return cls()

    def check_available(self, device: torch.device) -> None:
        """Raise Unavailable (cheaply, before any world is started) if this cannot run."""

    def padded_vocab(self, vocab_size: int, tp: int) -> int:
        """The vocabulary width this framework shards at this TP degree."""
        return round_up(vocab_size, tp)

    def third_party(self) -> list[dict]:
        """[{name, version}] of every real third-party package this candidate calls."""
        return []

    def describe(self) -> dict:
        info = {"summary": self.summary, "implementation": self.implementation}
        if self.note:
            info["note"] = self.note
        return info

    def build(self, ctx: ShardContext) -> LogprobFn:
        raise NotImplementedError

    def loss(self, out) -> torch.Tensor:
        """The scalar a trainer differentiates, from what build's function returned: the
        cross-entropy of the targets, -sum(logprobs)."""
        return -out.sum()

    def scope(self):
        """A context every call of this candidate runs in, its backward included (the
        bench wraps backward in it; build's function enters it itself)."""
        return contextlib.nullcontext()

    def teardown(self) -> None:
        """Undo global state set by `build` (parallel state, compiled graphs)."""


def temperature_param(param: str) -> float | None:
    """The value of a "temperature=T" parameter (T a finite float > 0), None for another."""
    if not param.startswith("temperature="):
        return None
    text = param.removeprefix("temperature=")
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not (value > 0 and value != float("inf")):
        raise ValueError(f"temperature must be a finite float > 0, got {text!r}")
    return value


def scaled_fp32(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """fp32(logits) / temperature, as the float baselines apply a sampling temperature."""
    x = logits.to(torch.float32)
    return x if temperature == 1.0 else x / temperature


def logprobs_of(out) -> torch.Tensor:
    """The (N,) logprobs from what a candidate's function returned."""
    return out[0] if isinstance(out, tuple) else out


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


def real_attribute(module: str, attr: str):
    """`module.attr` from the real package, or Unavailable saying why not."""
    found = getattr(import_or_unavailable(module), attr, None)
    if found is None:
        raise Unavailable(f"{module} has no {attr}")
    return found


def real_or_reimplementation(
    cand: Candidate, module: str, attr: str, real: str, reimplementation: str
):
    """`module.attr` where the real package provides it (`cand` then says it runs the real
    code, summary `real`); else None, and `cand` says it runs the re-implementation and why."""
    try:
        found = real_attribute(module, attr)
    except Unavailable as exc:
        cand.implementation, cand.summary = "re-implementation", reimplementation
        cand.note = f"real package not importable: {exc}"
        return None
    cand.implementation, cand.summary, cand.note = "real", real, None
    return found


def package_version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def owned_target(target: torch.Tensor, ctx: ShardContext) -> tuple[torch.Tensor, torch.Tensor]:
    """(owned (N,) bool, local column (N,) int64, 0 where not owned) of the global targets,
    by the contract's ownership rule (the report's targets are all real, none ignored)."""
    from ... import contract

    local = contract.owned_target_columns(
        target, ctx.vocab_start, ctx.shard_width, ctx.vocab_size, ignore_index=-100
    )
    return local >= 0, local.clamp(min=0)


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
