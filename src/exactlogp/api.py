"""Public entry point: selected-token log-probabilities, entropy and log-sum-exp.

Same call with and without tensor parallelism; a TP group of one is the whole vocab.
Every output is bitwise identical for any TP degree, shard layout, padding, collective
algorithm, batch composition, repeat and backend (exactlogp.CONTRACT).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from . import agreement, autograd, contract, distributed, validation
from .autograd import Options
from .backends import ShardPlan, get_backend
from .backends.base import row_view


class LogprobResult(NamedTuple):
    logprobs: torch.Tensor  # shape of target, fp32
    entropy: torch.Tensor | None  # shape of target, fp32; None unless with_entropy
    lse: torch.Tensor  # shape of target, fp32: log-sum-exp of y over the real, kept vocab


@torch.compiler.disable
def selected_logprobs(
    vocab_parallel_logits: torch.Tensor,
    target: torch.Tensor,
    *,
    tp_group=None,
    vocab_start: int | None = None,
    vocab_size: int | None = None,
    temperature: float | torch.Tensor = 1.0,
    keep_mask: torch.Tensor | None = None,
    ignore_index: int = -100,
    with_entropy: bool = False,
    validate: bool = True,
    backend: str = "auto",
) -> LogprobResult:
    """log softmax(y)[target], entropy and logsumexp of y = fp32(logits) / temperature.

    Args:
        vocab_parallel_logits: (..., V_local) bf16/fp16/fp32, this rank's vocabulary
            columns; never mutated. Columns may be strided (e.g. `logits[:, :-1]`).
        target: (...) signed integer global token ids; `ignore_index` rows give 0
            everywhere.
        tp_group: the tensor-parallel process group the vocabulary is split over (or any
            object with rank() and size() methods); None means this tensor holds the
            whole vocabulary.
        vocab_start: global id of this shard's first column; default rank * V_local,
            which only holds for shards of equal width (uneven shards are detected).
        vocab_size: the real vocabulary; columns >= vocab_size are padding and never
            take part. Default: no padding (the end of the last shard).
        temperature: a float, or a tensor shaped like target (one per row, not
            differentiated); rounded to fp32, then y = fp32(x) / tau by IEEE division.
        keep_mask: (..., V_local) bool; False columns are dropped (top-k / top-p).
        with_entropy: also return the entropy of softmax(y).
        validate: True: raise ValueError naming the first bad row, and with a TP group
            make every rank raise when the ranks' arguments disagree (one small all_gather
            and host syncs). False: a bad row gives NaN in that row only, a disagreement
            between ranks NaN in every output, and nothing is synced with the host.
        backend: "auto", or a name from `exactlogp.backends.backend_names()`.

    Every rank of `tp_group` must call with the same rows, targets, temperatures and
    options (docs/failure_modes.md lists what is checked and what the user sees).
    Under torch.compile this function is a graph break: it runs eagerly, with its eager
    bits, inside compiled code.
    """
    group = distributed.resolve(tp_group)

    def prepare() -> Call:
        validation.check_logits(vocab_parallel_logits)
        validation.check_keep_mask(keep_mask, vocab_parallel_logits)
        return prepare_call(
            vocab_parallel_logits, vocab_parallel_logits.shape[-1], target, group, vocab_start,
            vocab_size, temperature, keep_mask is not None, ignore_index, with_entropy,
            validate, backend,
        )  # fmt: skip

    with distributed.serialized(group):
        device = device_of(vocab_parallel_logits, group)
        call = agreement.checked(group, validate, device, prepare)
        # rows without a copy, also of strided views such as logits[:, :-1, :]
        rows = row_view(vocab_parallel_logits)
        logprobs, entropy, lse = autograd.selected_logprobs_rows(
            rows,
            target.reshape(-1).to(torch.int64),
            call.temperature if isinstance(call.temperature, torch.Tensor) else None,
            None if keep_mask is None else keep_mask.reshape(rows.shape),
            call.temperature if not isinstance(call.temperature, torch.Tensor) else 1.0,
            call.options,
        )
    shape = call.options.target_shape
    return LogprobResult(
        logprobs.view(shape),
        entropy.view(shape) if with_entropy else None,
        lse.view(shape),
    )


@dataclass(frozen=True)
class Call:
    """A call whose arguments passed this rank's checks."""

    options: Options
    fields: agreement.CallFields
    layout: agreement.Layout
    temperature: float | torch.Tensor  # fp32-rounded float, or (N,) fp32
    num_rows: int
    num_cols: int


def device_of(source, group: distributed.Group) -> torch.device:
    """Where the agreement's tensor goes: the input's device, else the group's."""
    if isinstance(source, torch.Tensor):
        return source.device
    return distributed.collective_device(group)


def prepare_call(
    source, num_cols, target, group: distributed.Group, vocab_start, vocab_size, temperature,
    has_keep_mask: bool, ignore_index, with_entropy, validate, backend,
    kind: int = agreement.KIND_LOGITS, extra_fields: dict | None = None,
    source_name: str = "vocab_parallel_logits",
) -> Call:  # fmt: skip
    """This rank's checks of the options every call shares, in the order a user fixes
    them. `source` is the logits (or the hidden states) whose shape without its last
    dimension is the rows'; `num_cols` this rank's vocabulary columns."""
    validation.check_target(target, source, source_name)
    tau = validation.check_temperature(temperature, target)
    with_entropy = validation.check_bool("with_entropy", with_entropy)
    validate = validation.check_bool("validate", validate)
    ignore_index = validation.check_int("ignore_index", ignore_index)
    vocab_start = validation.check_int("vocab_start", vocab_start, 0, validation.MAX_COLUMN)
    vocab_size = validation.check_int("vocab_size", vocab_size, 1, contract.MAX_VOCAB)
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a str, got {type(backend).__name__}")
    start, given = validation.check_shard(num_cols, vocab_start, vocab_size, group.rank, group.size)
    impl = get_backend(backend, source.device)

    shape = tuple(target.shape)
    extra = {"contract": agreement.contract_key(contract.CONTRACT), **(extra_fields or {})}
    fields = agreement.CallFields(
        kind=kind,
        rows=target.numel(),
        vocab_size=-1 if vocab_size is None else vocab_size,
        with_entropy=int(with_entropy),
        ignore_index=ignore_index,
        keep_mask=int(has_keep_mask),
        temperature=-1 if isinstance(tau, torch.Tensor) else agreement.fp32_bits(tau),
        validate=int(validate),
        **extra,
    )
    layout = agreement.Layout(start, num_cols, given)
    options = Options(
        plan=ShardPlan(start, vocab_size, ignore_index, with_entropy),
        group=group,
        layout=layout,
        call_key=fields.key() if group.distributed else 0,  # rides the MAX only with a group
        validate=validate,
        backend=impl,
        target_shape=shape,
        num_cols=num_cols,
    )
    return Call(options, fields, layout, tau, target.numel(), num_cols)


class SelectedLogprobs(torch.nn.Module):
    """Module form of `selected_logprobs` with the sharding options fixed at construction."""

    def __init__(self, *, tp_group=None, vocab_start=None, vocab_size=None, **options):
        super().__init__()
        self.tp_group = tp_group
        self.options = dict(vocab_start=vocab_start, vocab_size=vocab_size, **options)

    def forward(self, vocab_parallel_logits, target, **overrides) -> LogprobResult:
        kwargs = {**self.options, **overrides}
        return selected_logprobs(vocab_parallel_logits, target, tp_group=self.tp_group, **kwargs)
