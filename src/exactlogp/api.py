"""Public entry point: selected-token log-probabilities, entropy and log-sum-exp.

Same call with and without tensor parallelism; a TP group of one is the whole vocab.
Every output is bitwise identical for any TP degree, shard layout, padding, collective
algorithm, batch composition, repeat and backend (contract exactlogp-v1).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from . import contract, distributed, validation
from .autograd import Options, SelectedLogprobsFunction
from .backends import ShardPlan, get_backend


class LogprobResult(NamedTuple):
    logprobs: torch.Tensor  # shape of target, fp32
    entropy: torch.Tensor | None  # shape of target, fp32; None unless with_entropy
    lse: torch.Tensor  # shape of target, fp32: log-sum-exp of y over the real, kept vocab


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
            columns; never mutated.
        target: (...) integer global token ids; `ignore_index` rows give 0 everywhere.
        tp_group: the tensor-parallel process group the vocabulary is split over;
            None means this tensor holds the whole vocabulary.
        vocab_start: global id of this shard's first column; default rank * V_local.
        vocab_size: the real vocabulary; columns >= vocab_size are padding and never
            take part. Default: no padding (the end of the last shard).
        temperature: a float, or a tensor shaped like target (one per row); rounded to
            fp32, then y = fp32(x) / tau by IEEE division.
        keep_mask: (..., V_local) bool; False columns are dropped (top-k / top-p).
        with_entropy: also return the entropy of softmax(y).
        validate: raise ValueError naming the first bad row (one host sync). With
            False, a bad row gives NaN in that row only and nothing is synced.
        backend: "auto", or a name from `exactlogp.backends.backend_names()`.
    """
    # --- argument checks: shapes, dtypes and scalars only, identical on every rank ---
    validation.check_logits(vocab_parallel_logits)
    validation.check_target(target, vocab_parallel_logits)
    validation.check_keep_mask(keep_mask, vocab_parallel_logits)
    tau = validation.check_temperature(temperature, target)
    for name, flag in (("with_entropy", with_entropy), ("validate", validate)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
    ignore_index = validation.check_int("ignore_index", ignore_index)
    vocab_start = validation.check_int("vocab_start", vocab_start, minimum=0)
    vocab_size = validation.check_int("vocab_size", vocab_size, 1, contract.MAX_VOCAB)
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a str, got {type(backend).__name__}")

    rank, world_size = distributed.rank_and_world_size(tp_group)
    num_cols = vocab_parallel_logits.shape[-1]
    if vocab_start is None:
        vocab_start = rank * num_cols
        validation.check_vocab_extent(vocab_size, world_size * num_cols)
    else:
        validation.check_vocab_extent(vocab_size, vocab_start + num_cols)
    impl = get_backend(backend, vocab_parallel_logits.device)

    shape = tuple(target.shape)
    opts = Options(
        plan=ShardPlan(vocab_start, vocab_size, ignore_index, with_entropy),
        tp_group=tp_group,
        world_size=world_size,
        validate=validate,
        backend=impl,
        target_shape=shape,
    )
    num_rows = target.numel()
    logprobs, entropy, lse = SelectedLogprobsFunction.apply(
        vocab_parallel_logits.reshape(num_rows, num_cols),
        target.reshape(-1).to(torch.int64),
        tau if isinstance(tau, torch.Tensor) else None,
        None if keep_mask is None else keep_mask.reshape(num_rows, num_cols),
        tau if not isinstance(tau, torch.Tensor) else 1.0,
        opts,
    )
    return LogprobResult(
        logprobs.view(shape),
        entropy.view(shape) if with_entropy else None,
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
