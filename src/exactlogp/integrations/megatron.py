"""megatron-core drop-in: `vocab_parallel_cross_entropy` computed by exactlogp.

Same signature and return as `megatron.core.tensor_parallel.vocab_parallel_cross_entropy`:
the per-token loss -log softmax(logits)[target] (fp32, shaped like target), with the
vocabulary split over Megatron's tensor-model-parallel group in Megatron's layout (rank r
holds columns [r * V_local, (r + 1) * V_local)). Unlike Megatron's, the loss has the same
bits for every TP degree and is correctly rounded; the gradient is softmax - one_hot.

Differences, all deliberate: `target == ignore_index` (-100) gives loss 0 and gradient 0;
an out-of-range target raises instead of giving log-sum-exp; `label_smoothing != 0` raises
(its mean over the vocabulary is not part of the contract); the input is never
modified in place. `vocab_size` (keyword only) leaves Megatron's padding columns out;
Megatron itself includes them.

`patch_megatron()` swaps the function into megatron-core where its models call it, and
Megatron-LM's RL log-probs (`megatron.rl.rl_utils.selective_log_softmax`) where the
Megatron-LM source tree is importable. An explicit `tp_group` is asked for its rank and
size with `group.rank()` / `group.size()`, as megatron-core's `get_pg_rank` does.
"""

from __future__ import annotations

import functools
import importlib
import logging
import numbers
from typing import NamedTuple

import torch

from ..api import selected_logprobs
from ..cut import api as cut
from . import _patching, _rows, kept

logger = logging.getLogger(__name__)

PATCH_KEY = "patch_megatron"
MAKE_VOCAB_SIZE_DIVISIBLE_BY = 128  # Megatron-LM's default --make-vocab-size-divisible-by


def megatron_padded_vocab_size(
    vocab_size: int, tp_size: int, divisible_by: int = MAKE_VOCAB_SIZE_DIVISIBLE_BY
) -> int:
    """The LM-head width Megatron uses: vocab_size rounded up to divisible_by * tp_size."""
    multiple = divisible_by * tp_size
    return -(-vocab_size // multiple) * multiple


def vocab_parallel_cross_entropy(
    vocab_parallel_logits: torch.Tensor,
    target: torch.Tensor,
    label_smoothing: float = 0.0,
    tp_group=None,
    *,
    vocab_size: int | None = None,
) -> torch.Tensor:
    """Per-token cross-entropy loss from vocab-parallel logits (Megatron's signature).

    Args:
        vocab_parallel_logits: [s, b, V_local] (any leading shape) this rank's columns.
        target: [s, b] global token ids.
        label_smoothing: must be 0.0.
        tp_group: the process group the vocabulary is split over; None means Megatron's
            tensor-model-parallel group from `megatron.core.parallel_state`.
        vocab_size: the real vocabulary; columns >= vocab_size (Megatron's padding) are
            left out. None keeps every column, as Megatron does.
    """
    _check_label_smoothing(label_smoothing)
    group, vocab_start = resolve_tp_group(tp_group, vocab_parallel_logits)
    options = dict(tp_group=group, vocab_start=vocab_start, vocab_size=vocab_size)
    # inside exactlogp.integrations.replaying: over the rollout's kept sets
    result = kept.replayed(vocab_parallel_logits, target, "vocab_parallel_cross_entropy",
                           **options)  # fmt: skip
    if result is None:
        result = selected_logprobs(vocab_parallel_logits, target, **options)
    return -result.logprobs  # negation is exact: loss and logprob carry the same bits


def fused_vocab_parallel_cross_entropy(
    vocab_parallel_logits: torch.Tensor, target: torch.Tensor, tp_group
) -> torch.Tensor:
    """The signature of megatron-core's `fused_vocab_parallel_cross_entropy`."""
    return vocab_parallel_cross_entropy(vocab_parallel_logits, target, 0.0, tp_group)


class ProcessedReplay(NamedTuple):
    """What `processed_logprobs` gives a policy loss."""

    logprobs: torch.Tensor  # fp32, the target's shape; 0 where the target was cut
    loss_mask: torch.Tensor  # bool: False where the target was cut (and where loss_mask was)
    num_dropped: torch.Tensor  # 0-d int64: targets outside the kept set


def processed_logprobs(
    vocab_parallel_logits: torch.Tensor,
    target: torch.Tensor,
    *,
    temperature: float | torch.Tensor = 1.0,
    top_k: int | torch.Tensor | None = None,
    top_p: float | torch.Tensor | None = None,
    min_p: float | torch.Tensor | None = None,
    tp_group=None,
    vocab_size: int | None = None,
    loss_mask: torch.Tensor | None = None,
    ignore_index: int = -100,
) -> ProcessedReplay:
    """The rollout's processed logprobs (the exact top-k / top-p / min-p cut of
    `exactlogp.processed_logprobs`, docs/numerics.md section 13) on Megatron's vocab
    shards: the group and vocabulary range as for `vocab_parallel_cross_entropy`.

    A target outside the kept set (the trainer's logits differ from the rollout's) is
    never a NaN or -inf in the loss: its logprob is 0 with a zero gradient, it is
    masked out of `loss_mask`, and the count is returned and logged (a host sync)."""
    group, vocab_start = resolve_tp_group(tp_group, vocab_parallel_logits)
    res = cut.processed_logprobs(
        vocab_parallel_logits, target, temperature=temperature, top_k=top_k, top_p=top_p,
        min_p=min_p, tp_group=group, vocab_start=vocab_start, vocab_size=vocab_size,
        ignore_index=ignore_index,
    )  # fmt: skip
    kept = ~res.dropped
    logprobs = torch.where(kept, res.logprobs, torch.zeros_like(res.logprobs))
    mask = kept if loss_mask is None else kept & loss_mask.to(torch.bool)
    dropped = int(res.num_dropped)
    if dropped:
        logger.warning(
            "%d of %d target tokens lie outside the top-k / top-p / min-p kept set; they "
            "are masked out of the loss",
            dropped,
            target.numel(),
        )
    return ProcessedReplay(logprobs, mask, res.num_dropped)


def resolve_tp_group(tp_group, vocab_parallel_logits: torch.Tensor):
    """(group, vocab_start) to pass to `selected_logprobs` for Megatron-layout shards.

    An explicit group keeps the default layout (rank * V_local). None reads Megatron's
    parallel state and its vocabulary-range rule; a tensor-parallel world of one needs no
    group at all (the shard is the whole vocabulary).
    """
    if tp_group is not None:
        return tp_group, None
    state = _import("megatron.core.parallel_state")
    group = state.get_tensor_model_parallel_group(check_initialized=False)
    if group is None:
        raise RuntimeError(
            "tp_group=None means Megatron's tensor-model-parallel group, which is not "
            "initialized: call megatron.core.parallel_state.initialize_model_parallel() "
            "first or pass tp_group"
        )
    rank = state.get_tensor_model_parallel_rank()
    world_size = state.get_tensor_model_parallel_world_size()
    utils = _import("megatron.core.tensor_parallel.utils")
    num_cols = vocab_parallel_logits.shape[-1] if vocab_parallel_logits.dim() else 0
    start, _ = utils.VocabUtility.vocab_range_from_per_partition_vocab_size(
        num_cols, rank, world_size
    )
    if world_size == 1:
        return None, start
    return group, start


def selective_log_softmax(
    logits: torch.Tensor, index: torch.Tensor, *, vocab_size: int | None = None
) -> torch.Tensor:
    """Megatron-LM RL's `selective_log_softmax(logits, index)` (megatron/rl/rl_utils.py):
    log_softmax over the gathered, padded vocabulary at `index` ((...) or (..., K)),
    computed by exactlogp. Output dtype: Megatron's -- fp32 when its batch-invariant mode
    upcasts rows, else the logits' dtype. `vocab_size` leaves the padding columns out
    (Megatron keeps them in the normaliser)."""
    logprobs = _rows.k_ids_per_row(logits, index, vocab_size=vocab_size)
    return _rows.cast(logprobs, torch.float32 if _batch_invariant_mode() else logits.dtype)


def _batch_invariant_mode() -> bool:
    import sys

    rl_utils = sys.modules.get(_RL_UTILS)
    enabled = getattr(rl_utils, "is_batch_invariant_mode_enabled", None)
    return bool(enabled()) if callable(enabled) else False


_RL_UTILS = "megatron.rl.rl_utils"


@_patching.atomic
def patch_megatron(*, vocab_size: int | None = None) -> _patching.PatchHandle:
    """Make megatron-core's models (and Megatron-LM's RL loop) use exactlogp.

    Replaces, in megatron-core 0.16 to 0.19 (HEAD):
    `megatron.core.tensor_parallel.cross_entropy.vocab_parallel_cross_entropy`, its
    re-export `megatron.core.tensor_parallel.vocab_parallel_cross_entropy` (what
    `LanguageModule.compute_language_model_loss` and verl call), and the native fused
    variant in `megatron.core.fusions.fused_cross_entropy` plus its by-name import in
    `megatron.core.models.common.language_module.language_module`. Transformer Engine's
    cross-entropy (`cross_entropy_fusion_impl="te"`) is not replaced.

    Megatron-LM's RL path (`megatron/rl`, in no wheel: a source checkout on PYTHONPATH):
    `megatron.rl.rl_utils.selective_log_softmax`, which `get_logprobs` calls for the
    policy, old and reference log-probs (also under context parallelism). Where
    `megatron.rl.rl_utils` does not import, that site is skipped and named in
    `handle.skipped`.

    Opt-in and idempotent (a second call returns the live handle); undo with
    `unpatch_megatron()` or `handle.undo()`. Raises ImportError / AttributeError naming the
    symbol if this megatron-core version moved it, and then changes nothing. `vocab_size`:
    None or an int >= 1 (TypeError / ValueError otherwise).
    """
    vocab_size = _rows.check_vocab_size(vocab_size)
    if vocab_size is None:
        plain, fused = vocab_parallel_cross_entropy, fused_vocab_parallel_cross_entropy
        rl = selective_log_softmax
    else:
        plain, fused = _bind_vocab_size(vocab_size)
        rl = functools.wraps(selective_log_softmax)(
            functools.partial(selective_log_softmax, vocab_size=vocab_size)
        )
    sites = [
        _patching.Site("megatron.core.tensor_parallel.cross_entropy", "vocab_parallel_cross_entropy", plain),
        _patching.Site("megatron.core.tensor_parallel", "vocab_parallel_cross_entropy", plain),
        _patching.Site("megatron.core.fusions.fused_cross_entropy", "fused_vocab_parallel_cross_entropy", fused),
        _patching.Site(
            "megatron.core.models.common.language_module.language_module",
            "fused_vocab_parallel_cross_entropy",
            fused,
        ),
        _patching.Site(_RL_UTILS, "selective_log_softmax", rl, optional=True),
    ]  # fmt: skip
    return _patching.apply(PATCH_KEY, sites, {"vocab_size": vocab_size})


def patch_from_env(vocab_size: int | None = None) -> _patching.PatchHandle:
    """EXACTLOGP_PATCH=megatron (exactlogp.integrations.autopatch): `patch_megatron` with
    EXACTLOGP_VOCAB_SIZE as its `vocab_size`."""
    return patch_megatron(vocab_size=vocab_size)


@_patching.atomic
def unpatch_megatron() -> bool:
    """Restore megatron-core's own functions; False if `patch_megatron` was not applied."""
    return _patching.undo(PATCH_KEY)


def _bind_vocab_size(vocab_size: int):
    def plain(vocab_parallel_logits, target, label_smoothing=0.0, tp_group=None):
        return vocab_parallel_cross_entropy(
            vocab_parallel_logits, target, label_smoothing, tp_group, vocab_size=vocab_size
        )

    def fused(vocab_parallel_logits, target, tp_group):
        return vocab_parallel_cross_entropy(
            vocab_parallel_logits, target, 0.0, tp_group, vocab_size=vocab_size
        )

    plain.__doc__ = vocab_parallel_cross_entropy.__doc__
    fused.__doc__ = fused_vocab_parallel_cross_entropy.__doc__
    return plain, fused


def _check_label_smoothing(label_smoothing) -> None:
    if isinstance(label_smoothing, bool) or not isinstance(label_smoothing, numbers.Real):
        raise TypeError(f"label_smoothing must be a float, got {type(label_smoothing).__name__}")
    if label_smoothing != 0.0:
        raise ValueError(
            f"label_smoothing={label_smoothing!r} is not supported: the smoothed loss needs "
            "the mean log-probability over the vocabulary, which the contract "
            "does not compute; use 0.0 or megatron-core's own function"
        )


def _import(name: str):
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise ImportError(
            f"tp_group=None reads Megatron's parallel state, but {name} cannot be imported "
            f"({exc}); install megatron-core or pass tp_group"
        ) from exc
