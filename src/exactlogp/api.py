"""Public entry point: selected-token log-probabilities, entropy and log-sum-exp.

Same call with and without tensor parallelism; a TP group of one is the whole vocab.
Every output is bitwise identical for any TP degree, shard layout, padding, collective
algorithm, batch composition, repeat and backend (exactlogp.CONTRACT).
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass
from typing import NamedTuple

import torch

from . import agreement, autograd, distributed, validation
from .backends import Backend
from .backends.base import row_view
from .call import Call, cached, device_of, make_call, static_key, tensor_key


def eager_only(fn):
    """`fn` as a graph break under torch.compile (torch.compiler.disable: it runs eagerly,
    with its eager bits), without importing torch._dynamo (~0.9 s, in every process that
    imports exactlogp) before something else has: until then nothing can be compiling, so
    `fn` runs as it is; from then on through torch.compiler.disable(fn). The wrapper is
    marked as disabled too, so that Dynamo does not trace into it."""
    if "torch._dynamo" in sys.modules:
        return torch.compiler.disable(fn)
    disabled = None

    @functools.wraps(fn)
    def call(*args, **kwargs):
        nonlocal disabled
        if "torch._dynamo" not in sys.modules:
            return fn(*args, **kwargs)
        if disabled is None:
            disabled = torch.compiler.disable(fn)
        return disabled(*args, **kwargs)

    call._torchdynamo_disable = True  # Dynamo's mark of a disabled function
    return call


class LogprobResult(NamedTuple):
    logprobs: torch.Tensor  # shape of target, fp32
    entropy: torch.Tensor | None  # shape of target, fp32; None unless with_entropy
    lse: torch.Tensor  # shape of target, fp32: log-sum-exp of y over the real, kept vocab


@dataclass(frozen=True, eq=False)
class KeptLogprobs:
    """A LogprobResult over a kept set (the exact cut's, or one a rollout engine returned):
    its three values, unpacked and indexed as (logprobs, entropy, lse), and the targets
    outside the kept set: `dropped` (bool, the target's shape; their logprob is -inf with a
    zero gradient) and `num_dropped` (0-d int64)."""

    logprobs: torch.Tensor
    entropy: torch.Tensor | None
    lse: torch.Tensor
    dropped: torch.Tensor
    num_dropped: torch.Tensor

    def __iter__(self):
        return iter((self.logprobs, self.entropy, self.lse))

    def __len__(self) -> int:
        return 3

    def __getitem__(self, i):
        return (self.logprobs, self.entropy, self.lse)[i]

    def as_result(self) -> LogprobResult:
        return LogprobResult(self.logprobs, self.entropy, self.lse)


@eager_only
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
    backend: str | Backend = "auto",
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
        backend: "auto", a name from `exactlogp.backends.backend_names()`, or a backend
            object with its options, e.g. `exactlogp.backends.CpuBackend(num_threads=4)`
            or `TritonBackend(value_tables="always")` (backends are immutable: one object
            may serve many threads).

    Every rank of `tp_group` must call with the same rows, targets, temperatures and
    options (docs/failure_modes.md lists what is checked and what the user sees).
    Under torch.compile this function is a graph break: it runs eagerly, with its eager
    bits, inside compiled code.
    """
    group = distributed.resolve(tp_group)
    with distributed.serialized(group):
        call = agreement.checked(
            group, validate, device_of(vocab_parallel_logits, group), _logits_call,
            logits=vocab_parallel_logits, target=target, keep_mask=keep_mask, group=group,
            vocab_start=vocab_start, vocab_size=vocab_size, temperature=temperature,
            ignore_index=ignore_index, with_entropy=with_entropy, validate=validate,
            backend=backend,
        )  # fmt: skip
        # rows without a copy, also of strided views such as logits[:, :-1, :]
        rows = row_view(vocab_parallel_logits)
        outputs = autograd.selected_logprobs_rows(
            rows,
            flat_int64(target),
            None if keep_mask is None else keep_mask.reshape(rows.shape),
            call,
        )
    return shaped_result(call, *outputs)


# the options every check reads besides the tensors: the key of a kept call
_STATIC = ("group", "vocab_start", "vocab_size", "temperature", "ignore_index",
           "with_entropy", "validate", "backend")  # fmt: skip


def _logits_call(*, logits, keep_mask, target, **options) -> Call:
    """selected_logprobs' call: the logits and the keep mask, then the shared checks;
    kept for the next call with the same static arguments (call.cached)."""

    def build() -> Call:
        validation.check_logits(logits)
        validation.check_keep_mask(keep_mask, logits)
        return make_call(
            source=logits, num_cols=logits.shape[-1], has_keep_mask=keep_mask is not None,
            grads=agreement.grads_field(logits), target=target, **options,
        )  # fmt: skip

    key = static_key(
        "selected_logprobs", tensor_key(logits), tensor_key(target), tensor_key(keep_mask),
        *(options[k] for k in _STATIC),
    )  # fmt: skip
    return cached(key, build)


def flat_int64(target: torch.Tensor) -> torch.Tensor:
    """(N,) int64 target ids (a view, or the same tensor, where they already are)."""
    flat = target if target.dim() == 1 else target.reshape(-1)
    return flat if flat.dtype == torch.int64 else flat.to(torch.int64)


def shaped_result(call: Call, logprobs, entropy, lse) -> LogprobResult:
    """The (N,) outputs in the caller's target shape; entropy None unless asked for."""
    shape = call.target_shape
    if logprobs.shape == shape:  # (N,) targets: nothing to reshape
        return LogprobResult(logprobs, entropy if call.with_entropy else None, lse)
    return LogprobResult(
        logprobs.view(shape),
        entropy.view(shape) if call.with_entropy else None,
        lse.view(shape),
    )


class SelectedLogprobs(torch.nn.Module):
    """Module form of `selected_logprobs` with the sharding options fixed at construction."""

    def __init__(self, *, tp_group=None, vocab_start=None, vocab_size=None, **options):
        super().__init__()
        self.tp_group = tp_group
        self.options = dict(vocab_start=vocab_start, vocab_size=vocab_size, **options)

    def forward(self, vocab_parallel_logits, target, **overrides) -> LogprobResult:
        kwargs = {**self.options, **overrides}
        return selected_logprobs(vocab_parallel_logits, target, tp_group=self.tp_group, **kwargs)
