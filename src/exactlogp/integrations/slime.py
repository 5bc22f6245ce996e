"""slime drop-in: `calculate_log_probs_and_entropy` computed by exactlogp.

slime (THUDM/slime 0.3.1, the signature since commit 2c6323b of 2026-08) scores every
packed token row of a micro-batch in `slime.backends.megatron_utils.loss` with
`slime.utils.ppo_utils.calculate_log_probs_and_entropy(logits, tokens, tp_group,
with_entropy=False, chunk_size=-1, log_prob_keep_mask=None, with_entropy_grad=True)`:
logits [T, V_local] are this rank's columns in Megatron's even layout (rank * V_local),
already divided by `--rollout-temperature` by the loss code; tokens [T] are global ids. It
returns (log_prob [T, 1] fp32, entropy [T] fp32 or None); for T = 0 slime's (0,) tensors in
the logits' dtype. The drop-in here has that signature, those shapes and dtypes, and
exactlogp's values (the same bits at every TP degree):

- `log_prob_keep_mask` (bool [T, V_local], True = kept: the replayed top-p set): the
  log-prob is normalised over the kept columns plus the target's column (slime force-keeps
  the target, as SGLang's renormalised logprob does); the entropy is the unmasked
  distribution's, as slime's is.
- `with_entropy_grad=False`: the entropy is detached (slime marks it non-differentiable).
- `chunk_size`: accepted and ignored. slime chunks rows to bound its fp32 [T, V_local]
  softmax buffers; exactlogp keeps no [T, V_local] fp32 copy, so there is nothing to bound.
- `tp_group` is read as slime reads it: a group (asked `rank()` / `size()`), or None: the
  default group when torch.distributed is initialized, else no tensor parallelism.
- Megatron's padding columns count, as in slime; keyword-only `vocab_size` leaves them out.

Deliberate differences: a target outside the vocabulary raises ValueError (slime gives
-logsumexp there); a target of -100 gives 0 with no gradient; the logits and the mask are
never written to. fp64 logits are rounded to fp32 first, as slime's `.float()` does.

`patch_slime()` swaps the drop-in into `slime.utils.ppo_utils` and every slime module that
bound it by name (`slime.backends.megatron_utils.loss`, which needs megatron-core: skipped
where it does not import). slime's top-p replay builds the dense keep mask from the rollout's
`rollout_top_p_token_ids` / `rollout_top_p_token_offsets` in that loss module
(`_build_topp_keep_mask`) and passes it here: it is replayed through this function as is.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import numbers
from contextlib import nullcontext

import torch

from ..api import selected_logprobs
from ..distributed import resolve
from . import _patching, _rows

PATCH_KEY = "patch_slime"
NAME = "calculate_log_probs_and_entropy"
PPO_UTILS = "slime.utils.ppo_utils"
LOSS = "slime.backends.megatron_utils.loss"
# slime's signature: (name, default) in order; another one is a slime this adapter does not know
SIGNATURE = (
    ("logits", inspect.Parameter.empty), ("tokens", inspect.Parameter.empty),
    ("tp_group", inspect.Parameter.empty), ("with_entropy", False), ("chunk_size", -1),
    ("log_prob_keep_mask", None), ("with_entropy_grad", True),
)  # fmt: skip


def calculate_log_probs_and_entropy(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    tp_group,
    with_entropy: bool = False,
    chunk_size: int = -1,
    log_prob_keep_mask: torch.Tensor | None = None,
    with_entropy_grad: bool = True,
    *,
    vocab_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log_prob [T, 1] fp32, entropy [T] fp32 or None), slime's signature and shapes.

    Args:
        logits: [T, V_local] bf16 / fp16 / fp32 (fp64 is rounded to fp32), this rank's
            columns [rank * V_local, (rank + 1) * V_local).
        tokens: [T] global token ids.
        tp_group: the group the vocabulary is split over, or None (see the module).
        log_prob_keep_mask: None or bool [T, V_local]: the columns the log-prob is
            normalised over (the target's is always kept); the entropy ignores it.
        vocab_size: the real vocabulary; None counts every column, as slime does.
    """
    _rows.check_tensor("logits", logits)
    _check_chunk_size(chunk_size)
    if logits.dim() != 2:
        raise ValueError(f"logits must be [T, V_local], got shape {tuple(logits.shape)}")
    if logits.size(0) == 0:  # slime's empty result: 1-D, in the logits' dtype
        return logits.new_zeros((0,)), logits.new_zeros((0,)) if with_entropy else None
    logp, entropy = logprobs_and_entropy(
        logits, tokens, slime_group(tp_group), keep_mask=log_prob_keep_mask,
        with_entropy=with_entropy, with_entropy_grad=with_entropy_grad, vocab_size=vocab_size,
    )  # fmt: skip
    return logp.unsqueeze(-1), entropy


def logprobs_and_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    tp_group,
    *,
    keep_mask: torch.Tensor | None,
    with_entropy: bool,
    with_entropy_grad: bool,
    temperature: float | torch.Tensor = 1.0,
    vocab_start: int | None = None,
    vocab_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """slime's semantics on exactlogp ([T] fp32 each), for the slime drop-in and the vime
    provider: the keep mask narrows the log-prob's normaliser only, with the target's
    column force-kept; the entropy is the unmasked distribution's, detached unless
    `with_entropy_grad`."""
    if logits.dtype == torch.float64:
        logits = logits.float()
    options = dict(tp_group=tp_group, vocab_start=vocab_start, vocab_size=vocab_size,
                   temperature=temperature)  # fmt: skip
    if keep_mask is None:
        res = selected_logprobs(logits, target, with_entropy=with_entropy, **options)
        logp, entropy = res.logprobs, res.entropy
    else:
        start = (
            vocab_start if vocab_start is not None else resolve(tp_group).rank * logits.shape[-1]
        )
        keep = force_keep_target(keep_mask, target, start)
        logp = selected_logprobs(logits, target, keep_mask=keep, **options).logprobs
        entropy = None
        if with_entropy:
            with nullcontext() if with_entropy_grad else torch.no_grad():
                entropy = selected_logprobs(logits, target, with_entropy=True, **options).entropy
    if entropy is not None and not with_entropy_grad:
        entropy = entropy.detach()
    return logp, entropy


def force_keep_target(keep_mask: torch.Tensor, target: torch.Tensor, vocab_start: int):
    """A copy of the bool [T, V_local] `keep_mask` with each row's target column set where
    this shard holds it (slime restores the target logit after masking); no host sync."""
    _rows.check_tensor("log_prob_keep_mask", keep_mask)
    if keep_mask.dtype != torch.bool:
        raise TypeError(f"log_prob_keep_mask must be a torch.bool tensor, got {keep_mask.dtype}")
    if keep_mask.dim() != 2 or keep_mask.shape[0] != target.numel():
        raise ValueError(
            f"log_prob_keep_mask must be [T, V_local] with T = {target.numel()} rows, got "
            f"shape {tuple(keep_mask.shape)}"
        )
    width = keep_mask.shape[1]
    local = target.reshape(-1, 1).to(device=keep_mask.device, dtype=torch.int64) - vocab_start
    owned = (local >= 0) & (local < width)
    column = local.clamp(0, max(width - 1, 0))
    keep = keep_mask.clone()
    if width:
        keep.scatter_(1, column, keep.gather(1, column) | owned)
    return keep


def slime_group(tp_group):
    """The group slime reduces over: `tp_group`, or for None the default group where
    torch.distributed is initialized (slime's collectives take group=None as it)."""
    if tp_group is not None:
        return tp_group
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.group.WORLD
    return None


def _check_chunk_size(chunk_size) -> None:
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, numbers.Integral):
        raise TypeError(f"chunk_size must be an int, got {type(chunk_size).__name__}")


# --- the patch ---


@_patching.atomic
def patch_slime(*, vocab_size: int | None = None) -> _patching.PatchHandle:
    """Make slime's Megatron backend compute its log-probs and entropies with exactlogp.

    Replaces `slime.utils.ppo_utils.calculate_log_probs_and_entropy` and every slime
    module's by-name copy: `slime.backends.megatron_utils.loss` (skipped, and named in
    `handle.skipped`, where it does not import: it needs megatron-core). slime modules
    imported later copy the patched name. `vocab_size` leaves Megatron's padding columns
    out (slime counts them).

    Opt-in and idempotent; undo with `unpatch_slime()` or `handle.undo()`. A slime whose
    function has another signature raises RuntimeError naming its version, and a slime
    without the function ImportError / AttributeError; nothing is changed then.
    """
    vocab_size = _rows.check_vocab_size(vocab_size)
    if _patching.active(PATCH_KEY) is None:
        _check_known_slime()
    fn = calculate_log_probs_and_entropy
    if vocab_size is not None:
        fn = functools.wraps(fn)(functools.partial(fn, vocab_size=vocab_size))
    sites = [
        _patching.Site(PPO_UTILS, NAME, fn, everywhere=True),
        _patching.Site(LOSS, NAME, fn, optional=True),
    ]
    return _patching.apply(PATCH_KEY, sites, {"vocab_size": vocab_size})


def patch_from_env(vocab_size: int | None = None) -> _patching.PatchHandle:
    """EXACTLOGP_PATCH=slime (exactlogp.integrations.autopatch): `patch_slime` with
    EXACTLOGP_VOCAB_SIZE as its `vocab_size`."""
    return patch_slime(vocab_size=vocab_size)


@_patching.atomic
def unpatch_slime() -> bool:
    """Restore slime's own function everywhere; False if `patch_slime` was not applied."""
    return _patching.undo(PATCH_KEY)


def _check_known_slime() -> None:
    version = _patching.host_version("slime", PATCH_KEY)
    try:
        module = importlib.import_module(PPO_UTILS)
    except ImportError as exc:
        raise ImportError(f"{PATCH_KEY}: cannot import {PPO_UTILS} ({exc}); slime "
                          f"{version} is not THUDM/slime; nothing was patched") from exc  # fmt: skip
    original = getattr(module, NAME, None)
    if original is None:
        return  # _patching names the missing symbol
    found = tuple((p.name, p.default) for p in inspect.signature(original).parameters.values())
    if found != SIGNATURE:
        raise RuntimeError(
            f"{PATCH_KEY}: slime {version} has {NAME}{inspect.signature(original)}, not the "
            f"signature this adapter replaces ({', '.join(n for n, _ in SIGNATURE)}, slime "
            "0.3.1); nothing was patched"
        )
