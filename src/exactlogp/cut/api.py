"""The exact cut's public functions: processed_logprobs, sampling_mask, sample.

    processed_logprobs / sampling_mask / sample
      -> _cut_call       this rank's checks (agreement.checked: with a TP group every rank
                         raises when one rank's fail): the Call with its CutOptions
      -> driver.cut      the cut across the ranks (docs/numerics.md section 13)
      -> processed.forward / draw.draw / the keep mask

Every function reports the rows it cannot serve -- a bad temperature, a NaN / +inf value,
no valid column -- as processed_logprobs does: a ValueError naming the first (validate=
True), else NaN / -1 / an empty keep mask in that row.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch

from .. import agreement, distributed, validation
from ..api import KeptLogprobs, eager_only
from ..backends.base import row_view
from ..call import Call, device_of, make_call
from . import driver, processed
from .blocks import keep_mask
from .draw import draw
from .options import check_cut, check_uniforms


class SamplingMask(NamedTuple):
    """This rank's kept columns and the cut's compact per-row form (the rows' shape): a
    real column j is kept when `y_j >= threshold` and, with `min_p > 0`, its mass
    `q_j >= min_p 2^84` (NaN / +inf columns are kept so that the row is reported bad). A
    row the cut cannot serve (validate=False: ranks that disagree, a bad temperature, a
    NaN / +inf value, no valid column) keeps nothing and has a NaN threshold."""

    keep_mask: torch.Tensor  # (..., V_local) bool
    threshold: torch.Tensor  # (...) fp32: y threshold (-inf: no top-k / top-p cut)
    min_p: torch.Tensor  # (...) fp32: the min-p applied (0: none)
    row_max: torch.Tensor  # (...) fp32: M, the exact global max of y (a zero as +0)
    greedy: torch.Tensor  # (...) bool: temperature-0 rows (no cut, y at temperature 1)


@dataclass(frozen=True, eq=False)
class ProcessedLogprobs(KeptLogprobs):
    """processed_logprobs' result: a KeptLogprobs (three values when unpacked, the targets
    outside the kept set) and `mask`, the cut's SamplingMask, built on first read."""

    _build_mask: object = None  # () -> SamplingMask

    @functools.cached_property
    def mask(self) -> SamplingMask:
        """The cut's SamplingMask (its keep mask is (..., V_local))."""
        return self._build_mask()


# --- the call ---


def _cut_call(kind: int, logits, target, *, temperature, top_k, top_p, min_p, group,
              vocab_start, vocab_size, ignore_index, with_entropy, validate, backend,
              uniforms=None, generator=None) -> Call:  # fmt: skip
    """This rank's checks of a cut function's arguments (`group`: the resolved tp_group),
    made collective: the Call with its CutOptions (call.cut) and the temperature whose
    greedy rows read 1."""

    def build() -> Call:
        validation.check_logits(logits)
        validation.check_target(target, logits)
        u = uniforms
        if kind == agreement.KIND_SAMPLE:
            u = check_uniforms(uniforms, generator, tuple(target.shape), logits.device)
        cut = check_cut(top_k, top_p, min_p, target, u)
        grads = agreement.grads_field(logits) if kind == agreement.KIND_PROCESSED else 0
        call = make_call(
            source=logits, num_cols=logits.shape[-1], target=target, group=group,
            vocab_start=vocab_start, vocab_size=vocab_size, temperature=temperature,
            has_keep_mask=False, ignore_index=ignore_index, with_entropy=with_entropy,
            validate=validate, backend=backend, grads=grads, kind=kind,
            extra_fields=cut.fields(), greedy=True,
        )  # fmt: skip
        return replace(call, cut=cut)

    return agreement.checked(group, validate, device_of(logits, group), build)


def _no_target(logits) -> torch.Tensor:
    """The rows of sample / sampling_mask as targets that ask for nothing (ignored)."""
    return torch.full(logits.shape[:-1], -1, dtype=torch.int64, device=logits.device)


def _raise_for_bad_rows(cut: driver.Cut, call: Call) -> None:
    """validate=True: sample / sampling_mask raise for the first row they cannot serve,
    on every rank (the flags are alike on every rank)."""
    if call.validate and bool((cut.bad != 0).any()):
        validation.raise_for_bad_cut_rows(cut.bad, call)


def _mask(cut: driver.Cut, call: Call, logits) -> SamplingMask:
    """The SamplingMask of a cut, in the rows' shape; rows it cannot serve keep nothing."""
    shape, v_local = call.target_shape, logits.shape[-1]
    n, device = cut.argmax.shape[0], cut.argmax.device
    bad = cut.bad != 0
    greedy = call.temperature.greedy
    greedy = torch.zeros(n, dtype=torch.bool, device=device) if greedy is None else greedy
    if cut.poisoned:
        keep = torch.zeros(n, v_local, dtype=torch.bool, device=device)
    else:
        keep = keep_mask(cut.blocks, n, cut.shard) & ~bad.unsqueeze(-1)
    m = call.cut.min_p.block(slice(0, n), device)
    m = torch.where(greedy, 0.0, m)
    threshold = torch.where(bad, float("nan"), cut.threshold)
    return SamplingMask(
        keep.view(*shape, v_local), threshold.view(shape), m.view(shape),
        (cut.row_max + 0.0).view(shape), greedy.view(shape),
    )  # fmt: skip


# --- the public functions ---


@eager_only
def sampling_mask(
    vocab_parallel_logits: torch.Tensor,
    *,
    temperature: float | torch.Tensor = 1.0,
    top_k: int | torch.Tensor | None = None,
    top_p: float | torch.Tensor | None = None,
    min_p: float | torch.Tensor | None = None,
    tp_group=None,
    vocab_start: int | None = None,
    vocab_size: int | None = None,
    validate: bool = True,
    backend="auto",
) -> SamplingMask:
    """This rank's columns of the exact min-p / top-k / top-p cut (docs/numerics.md §13).

    Parameters as `processed_logprobs`; each sampling parameter a scalar or one per row
    (a tensor shaped like the logits without their last dimension). Returns a
    SamplingMask: the keep mask and the per-row compact form. A row with a bad
    temperature, a NaN / +inf value or no valid column raises (validate=True), else keeps
    nothing."""
    logits = vocab_parallel_logits
    target = _no_target(logits)
    group = distributed.resolve(tp_group)
    with distributed.serialized(group):
        call = _cut_call(
            agreement.KIND_SAMPLING_MASK, logits, target, temperature=temperature,
            top_k=top_k, top_p=top_p, min_p=min_p, group=group, vocab_start=vocab_start,
            vocab_size=vocab_size, ignore_index=-1, with_entropy=False, validate=validate,
            backend=backend,
        )  # fmt: skip
        cut = driver.cut(call, logits, target)
    _raise_for_bad_rows(cut, call)
    return _mask(cut, call, logits)


@eager_only
def processed_logprobs(
    vocab_parallel_logits: torch.Tensor,
    target: torch.Tensor,
    *,
    temperature: float | torch.Tensor = 1.0,
    top_k: int | torch.Tensor | None = None,
    top_p: float | torch.Tensor | None = None,
    min_p: float | torch.Tensor | None = None,
    tp_group=None,
    vocab_start: int | None = None,
    vocab_size: int | None = None,
    ignore_index: int = -100,
    with_entropy: bool = False,
    validate: bool = True,
    backend="auto",
) -> ProcessedLogprobs:
    """The log-softmax over the kept set of the exact cut (temperature, min-p, top-k,
    top-p; docs/numerics.md §13): what a sampler with these parameters draws from.

    Args as `selected_logprobs`, plus:
        temperature: a float or one per row; 0 is a greedy row (no cut, temperature 1).
        top_k: int (None, 0, -1: no cut; k larger than the vocabulary keeps all).
        top_p: float in (0, 1] (None, 1: no cut).
        min_p: float in [0, 1] (None, 0: no cut).

    A target outside the kept set gives logprob -inf with a zero gradient and is counted
    in `result.num_dropped` (`result.dropped` per row); `validate=True` does not raise on
    it (data, not a bad call). Unpacks as (logprobs, entropy, lse).

    Sampling parameters outside their range raise ValueError (TypeError for a wrong type)
    whatever `validate` is; per-row tensors are checked with a host sync. Per-row values
    that differ between the ranks of `tp_group` raise on every rank (validate=True) or
    give NaN everywhere (validate=False), as for `selected_logprobs`.
    """
    logits = vocab_parallel_logits
    group = distributed.resolve(tp_group)
    with distributed.serialized(group):
        call = _cut_call(
            agreement.KIND_PROCESSED, logits, target, temperature=temperature, top_k=top_k,
            top_p=top_p, min_p=min_p, group=group, vocab_start=vocab_start,
            vocab_size=vocab_size, ignore_index=ignore_index, with_entropy=with_entropy,
            validate=validate, backend=backend,
        )  # fmt: skip
        cut = driver.cut(call, logits, target)
        t = target.reshape(-1).to(torch.int64)
        t_used = torch.where(cut.dropped, cut.argmax, t)  # a kept column: its gradient is 0
        if torch.is_grad_enabled() and logits.requires_grad:
            lp, entropy, lse = processed.ProcessedFunction.apply(row_view(logits), cut, t_used,
                                                                 call)  # fmt: skip
        else:
            fin = processed.forward(cut, t_used, call).fin
            lp, entropy, lse = fin.logprobs, fin.entropy, fin.lse
    shape = call.target_shape
    dropped = cut.dropped.view(shape)
    lp = torch.where(dropped & ~torch.isnan(lp.view(shape)), float("-inf"), lp.view(shape))
    return ProcessedLogprobs(
        lp, entropy.view(shape) if with_entropy else None, lse.view(shape), dropped,
        dropped.sum(), functools.partial(_mask, cut, call, logits),
    )  # fmt: skip


@eager_only
def sample(
    vocab_parallel_logits: torch.Tensor,
    *,
    generator: torch.Generator | None = None,
    uniforms: torch.Tensor | None = None,
    temperature: float | torch.Tensor = 1.0,
    top_k: int | torch.Tensor | None = None,
    top_p: float | torch.Tensor | None = None,
    min_p: float | torch.Tensor | None = None,
    tp_group=None,
    vocab_start: int | None = None,
    vocab_size: int | None = None,
    validate: bool = True,
    backend="auto",
) -> torch.Tensor:
    """Token ids (the logits' shape without the last dimension, int64, alike on every
    rank) drawn from the exact processed distribution by the inverse CDF on the exact
    masses (docs/numerics.md §13): the token is a function of the logits' bits and the
    uniform. `uniforms`: float64 in [0, 1), one per row; else drawn from `generator`
    (every rank must draw the same: seed it alike). Greedy rows (temperature 0) give the
    argmax, the lowest id on ties. A row with a bad temperature, a NaN / +inf value or
    no valid column raises (validate=True), else gives -1, as does every row where the
    ranks disagree (validate=False)."""
    logits = vocab_parallel_logits
    target = _no_target(logits)
    group = distributed.resolve(tp_group)
    with distributed.serialized(group):
        call = _cut_call(
            agreement.KIND_SAMPLE, logits, target, temperature=temperature, top_k=top_k,
            top_p=top_p, min_p=min_p, group=group, vocab_start=vocab_start,
            vocab_size=vocab_size, ignore_index=-1, with_entropy=False, validate=validate,
            backend=backend, uniforms=uniforms, generator=generator,
        )  # fmt: skip
        cut = driver.cut(call, logits, target, keep_y=True)
        if cut.poisoned:
            return cut.argmax.view(call.target_shape)
        _raise_for_bad_rows(cut, call)
        ids = draw(cut, call.cut.uniforms)
    return torch.where(cut.bad != 0, -1, ids).view(call.target_shape)
