"""The call object: one call's checked arguments, built once and read by every layer below.

    api.selected_logprobs / linear.linear_selected_logprobs
      -> make_call(...)          this rank's argument checks, keyword-only, in the order a
                                 user fixes them (inside agreement.checked, so that with a
                                 TP group every rank raises when one rank's checks fail)
      -> Call                    frozen: shapes, the shard, the Temperature, the options,
                                 the resolved backend object, the agreement fields
      -> autograd -> backends    take the call (or the parts of it a pass needs: the
                                 ShardPlan, the Temperature) instead of parameter lists

A function with options of its own extends the call (`replace(call, linear=...)`,
`replace(call, cut=...)`) rather than carrying them beside it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import agreement, contract, distributed, validation
from .backends import Backend, ShardPlan, get_backend
from .cut.options import CutOptions
from .temperature import Temperature


@dataclass(frozen=True)
class LinearOptions:
    """What the exact LM head adds to a call (linear.py)."""

    logit_scale: float  # rounded to fp32
    has_bias: bool


@dataclass(frozen=True, eq=False)
class Call:
    """A call whose arguments passed this rank's checks."""

    target_shape: tuple[int, ...]  # the caller's target shape; rows are its product
    num_cols: int  # this rank's vocabulary columns
    plan: ShardPlan  # what a backend pass needs of the shard and the options
    temperature: Temperature  # scalar or (N,) fp32
    has_keep_mask: bool
    validate: bool
    backend: Backend  # resolved for the input's device
    group: distributed.Group
    layout: agreement.Layout  # this rank's shard, for the agreement
    fields: agreement.CallFields  # what every rank must pass alike
    call_key: int  # fields.key() with a TP group (it rides the MAX), else 0
    linear: LinearOptions | None = None  # linear_selected_logprobs
    cut: CutOptions | None = None  # processed_logprobs, sample, sampling_mask
    kept: object = None  # replay_logprobs: its replay.KeptSet
    logits_name: str = "vocab_parallel_logits"  # what the messages call the logits

    @property
    def num_rows(self) -> int:
        return self.fields.rows

    @property
    def with_entropy(self) -> bool:
        return self.plan.with_entropy


def make_call(
    *,
    source: torch.Tensor,
    num_cols: int,
    target,
    group: distributed.Group,
    vocab_start,
    vocab_size,
    temperature,
    has_keep_mask: bool,
    ignore_index,
    with_entropy,
    validate,
    backend,
    grads: int = 0,
    kind: int = agreement.KIND_LOGITS,
    extra_fields: dict | None = None,
    source_name: str = "vocab_parallel_logits",
    logits_name: str = "vocab_parallel_logits",
    greedy: bool = False,
) -> Call:
    """This rank's checks of the options every call shares, in the order a user fixes them.
    `source` is the logits (or the hidden states) whose shape without its last dimension is
    the rows'; `num_cols` this rank's vocabulary columns; `backend` a name or a Backend;
    `grads` which inputs require a gradient (agreement.grads_field); `source_name` and
    `logits_name` what the messages call the source and the logits; `greedy`: a
    temperature of 0 is a greedy row (the exact cut's convention)."""
    validation.check_target(target, source, source_name)
    tau = validation.check_temperature(temperature, target, greedy)
    with_entropy = validation.check_bool("with_entropy", with_entropy)
    validate = validation.check_bool("validate", validate)
    ignore_index = validation.check_int("ignore_index", ignore_index)
    vocab_start = validation.check_int("vocab_start", vocab_start, 0, validation.MAX_COLUMN)
    vocab_size = validation.check_int("vocab_size", vocab_size, 1, contract.MAX_VOCAB)
    start, given = validation.check_shard(
        num_cols, vocab_start, vocab_size, group.rank, group.size, logits_name
    )
    impl = get_backend(backend, source.device)

    extra = {"contract": agreement.contract_key(contract.CONTRACT), **(extra_fields or {})}
    fields = agreement.CallFields(
        kind=kind,
        rows=target.numel(),
        vocab_size=-1 if vocab_size is None else vocab_size,
        with_entropy=int(with_entropy),
        ignore_index=ignore_index,
        keep_mask=int(has_keep_mask),
        temperature=tau.field(),
        validate=int(validate),
        grads=grads,
        **extra,
    )
    return Call(
        target_shape=tuple(target.shape),
        num_cols=num_cols,
        plan=ShardPlan(start, vocab_size, ignore_index, with_entropy),
        temperature=tau,
        has_keep_mask=has_keep_mask,
        validate=validate,
        backend=impl,
        group=group,
        layout=agreement.Layout(start, num_cols, given),
        fields=fields,
        call_key=fields.key() if group.distributed else 0,
        logits_name=logits_name,
    )


# --- calls whose static arguments repeat: checked once ---
#
# A training or decode loop calls with the same shapes, dtypes and options every step.
# Every check of make_call reads only those, so the Call built for them is built again
# from them alone: it is kept, keyed by exactly what the checks read (types included, so
# that True and 1 stay apart), and only when they passed. Tensors are keyed by type, shape,
# dtype, device and requires_grad, never by identity or values; per-row temperatures are
# tensors, so such calls are not kept. The key holds the group and backend objects, so a
# kept call never outlives them.
CALL_CACHE_SIZE = 64
_calls: dict = {}


_NOT_PLAIN = object()


def tensor_key(t):
    """What the checks read of a tensor argument (None stays None); a marker that keeps
    the call out of the cache for anything but a plain tensor."""
    if t is None:
        return None
    if type(t) is not torch.Tensor:
        return _NOT_PLAIN
    return ("tensor", t.shape, t.dtype, t.device, t.requires_grad)


_PLAIN = frozenset((type(None), bool, int, float, str, tuple, distributed.Group))
_keyable: set[type] = set(_PLAIN)  # and each Backend class met so far


def static_key(*parts) -> tuple | None:
    """The cache key of a call's static arguments and grad mode, or None when one of them
    is not plain: a tensor that is no plain tensor, or a value of another type than None,
    bool, int, float, str, a tensor key, a Backend or a Group (a tensor temperature, say)."""
    kinds = tuple(map(type, parts))  # the types too: True and 1 stay apart
    if not _keyable.issuperset(kinds):  # one set test on the usual call
        for part, kind in zip(parts, kinds, strict=True):
            if kind in _keyable:
                continue
            if part is _NOT_PLAIN or not isinstance(part, Backend):
                return None
            _keyable.add(kind)
    return (torch.is_grad_enabled(), contract.CONTRACT, kinds, parts)


def cached(key: tuple | None, build):
    """The kept Call for `key`, else build() (kept when key is not None)."""
    if key is None:
        return build()
    try:
        found = _calls.get(key)
    except TypeError:  # an unhashable group handle
        return build()
    if found is None:
        found = build()
        if len(_calls) >= CALL_CACHE_SIZE:
            _calls.pop(next(iter(_calls)), None)  # the oldest
        _calls[key] = found
    return found


def device_of(source, group: distributed.Group) -> torch.device:
    """Where the agreement's tensor goes: the input's device, else the group's."""
    if isinstance(source, torch.Tensor):
        return source.device
    return distributed.collective_device(group)
