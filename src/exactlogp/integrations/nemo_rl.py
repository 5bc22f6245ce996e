"""NeMo-RL drop-ins: the vocab-parallel log-probs of `nemo_rl.distributed.model_utils`
computed by exactlogp, with NeMo-RL's names, argument orders, shift and fp32 output.

- `from_parallel_logits_to_logprobs(vocab_parallel_logits [B, S_local, V_local], target
  [B, S] (unshifted), vocab_start_index, vocab_end_index, tp_group, inference_only=False,
  cp_group=None, chunk_size=None, sampling_params=None)` -> fp32 [B, S-1]: column t is the
  log-probability of target[:, t + 1] under the logits of position t (NeMo-RL rolls the
  target by -1, scores every position and drops the last, wrapped one).
- The autograd entries the module's other paths call as `<Class>.apply(...)` (DTensor,
  packed sequences), on an already shifted target, fp32 shaped like the target:
  `DistributedLogprob`, `ChunkedDistributedLogprob`, `DistributedLogprobWithSampling`,
  `ChunkedDistributedLogprobWithSampling`.

SkyRL's Megatron backend copied this convention (without `sampling_params`):
`exactlogp.integrations.skyrl` calls `shifted_logprobs` and the same classes.

Temperature: NeMo-RL's callers divide the logits in place before these functions
(`apply_temperature_scaling`); they take the logits as given and never read
`TrainingSamplingParams.temperature`, as NeMo-RL. Top-k / top-p (`sampling_params`, or the
`*WithSampling` classes): NeMo-RL recomputes the cut from the trainer's own logits with a
float algorithm (sort, softmax, cumulative sum); here it is `exactlogp.processed_logprobs`'
exact cut (docs/numerics.md section 13), the log-softmax over the kept set. The two agree
except where a float sum decides a boundary token; a target outside the kept set is -inf
in both (here with a zero gradient).

Deliberate differences: a target outside [0, vocabulary) raises ValueError naming it
(NeMo-RL scores it 0: every rank masks it), except -100, which gives 0; a context-parallel
group of more than one rank is refused (NotImplementedError); `chunk_size` and
`inference_only` are memory knobs that change no bit (`inference_only=True` computes
without autograd); the logits are never written to. `tp_group=None` is
torch.distributed's default group when one is initialised (NeMo-RL's collectives then
use it), else the whole vocabulary on this rank.
"""

from __future__ import annotations

import functools
from contextlib import nullcontext

import torch

from ..api import selected_logprobs
from ..cut.api import processed_logprobs
from ..validation import MAX_COLUMN, check_int
from . import _patching, _rows

PATCH_KEY = "patch_nemo_rl"
MODEL_UTILS = "nemo_rl.distributed.model_utils"
_TRAIN = "nemo_rl.models.megatron.train"  # binds from_parallel_logits_to_logprobs by name

# The parameters of the host objects replaced, as NVIDIA-NeMo/RL@7ea279abfbeb has them
# (an autograd Function: its forward's).
_LOGITS = ("vocab_parallel_logits", "target")
_RANGE = (*_LOGITS, "vocab_start_index", "vocab_end_index")
SHIFTED = (*_RANGE, "tp_group", "inference_only", "cp_group", "chunk_size")
DISTRIBUTED = {
    "DistributedLogprob": ("ctx", *_RANGE, "group", "inference_only"),
    "ChunkedDistributedLogprob": ("ctx", *_RANGE, "chunk_size", "tp_group", "inference_only"),
}
KNOWN = "NeMo-RL at NVIDIA-NeMo/RL@7ea279abfbeb (0.6.0)"
SIGNATURES = {
    "from_parallel_logits_to_logprobs": (*SHIFTED, "sampling_params"),
    **DISTRIBUTED,
    "DistributedLogprobWithSampling": ("ctx", *_LOGITS, "tp_group", "top_k", "top_p",
                                       "inference_only"),
    "ChunkedDistributedLogprobWithSampling": ("ctx", *_LOGITS, "tp_group", "top_k", "top_p",
                                              "chunk_size", "inference_only"),
}  # fmt: skip


# --- the shared convention (NeMo-RL, SkyRL's Megatron backend) ---


def shifted_logprobs(
    vocab_parallel_logits: torch.Tensor,
    target: torch.Tensor,
    vocab_start_index: int,
    vocab_end_index: int,
    tp_group,
    inference_only: bool = False,
    cp_group=None,
    chunk_size: int | None = None,
    *,
    cut: dict | None = None,
    vocab_size: int | None = None,
) -> torch.Tensor:
    """fp32 [B, S-1]: logits [B, S_local, V_local] (S_local >= S: NeMo-RL pads the target)
    at the unshifted target [B, S] shifted by one, i.e. `shard_logprobs(logits[:, :S-1],
    target[:, 1:], ...)` -- what NeMo-RL's roll, padding and `[:, :-1]` keep."""
    logits = _rows.check_tensor("vocab_parallel_logits", vocab_parallel_logits)
    target = _rows.check_tensor("target", target)
    if chunk_size is not None:
        _rows.check_chunk_size(chunk_size)
    _refuse_context_parallel(cp_group)
    if logits.dim() != 3 or target.dim() != 2:
        raise ValueError(
            f"vocab_parallel_logits must be [B, S, V_local] and target [B, S], got shapes "
            f"{tuple(logits.shape)} and {tuple(target.shape)}"
        )
    batch, length = target.shape
    if logits.shape[0] != batch or logits.shape[1] < length:
        raise ValueError(
            f"target {tuple(target.shape)} must have the logits' batch ({logits.shape[0]}) and "
            f"at most their {logits.shape[1]} positions"
        )
    keep = max(length - 1, 0)
    try:
        return shard_logprobs(
            logits[:, :keep],
            target[:, 1:],
            vocab_start_index,
            vocab_end_index,
            tp_group,
            inference_only,
            cut=cut,
            vocab_size=vocab_size,
        )
    except ValueError as exc:
        if not str(exc).startswith("target["):
            raise
        raise ValueError(  # the row named is one of the shifted target
            f"{exc} (the target here is target[:, 1:], shifted as NeMo-RL shifts it)"
        ) from exc


def shard_logprobs(
    vocab_parallel_logits: torch.Tensor,
    target: torch.Tensor,
    vocab_start_index: int | None,
    vocab_end_index: int | None,
    group,
    inference_only: bool = False,
    *,
    cut: dict | None = None,
    vocab_size: int | None = None,
) -> torch.Tensor:
    """fp32 shaped like `target` (already shifted): log softmax over the vocabulary split
    over `group`, this rank holding [vocab_start_index, vocab_end_index) (None: rank *
    V_local); with `cut` ({"top_k", "top_p"}) the processed logprobs of the exact cut."""
    logits = _rows.check_tensor("vocab_parallel_logits", vocab_parallel_logits)
    start = _vocab_start(vocab_start_index, vocab_end_index, logits)
    group = _tp_group(group)
    with torch.no_grad() if inference_only else nullcontext():
        if cut:
            return processed_logprobs(
                logits, target, tp_group=group, vocab_start=start, vocab_size=vocab_size, **cut
            ).logprobs
        return selected_logprobs(
            logits, target, tp_group=group, vocab_start=start, vocab_size=vocab_size
        ).logprobs


def sampling_cut(top_k, top_p) -> dict | None:
    """NeMo-RL's `need_top_k_or_top_p_filtering` as exactlogp's cut: top-k is on for an
    int > 0, top-p for a value other than 1.0; None when neither is."""
    k_on = top_k is not None and not isinstance(top_k, bool) and top_k > 0
    p_on = top_p is not None and top_p != 1.0
    if not (k_on or p_on):
        return None
    return {"top_k": top_k if k_on else None, "top_p": top_p if p_on else None}


def _vocab_start(vocab_start_index, vocab_end_index, logits: torch.Tensor) -> int | None:
    if vocab_start_index is None and vocab_end_index is None:
        return None
    start = check_int("vocab_start_index", vocab_start_index, 0, MAX_COLUMN)
    end = check_int("vocab_end_index", vocab_end_index, 0, MAX_COLUMN)
    width = logits.shape[-1] if logits.dim() else 0
    if start is None or end is None or end - start != width:
        raise ValueError(
            f"vocab_start_index={vocab_start_index!r} and vocab_end_index={vocab_end_index!r} "
            f"must span this rank's {width} vocabulary columns (vocab_parallel_logits.shape[-1])"
        )
    return start


def _tp_group(group):
    if group is not None:
        return group
    import torch.distributed as dist

    return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None


def _refuse_context_parallel(cp_group) -> None:
    if cp_group is None:
        return
    if callable(getattr(cp_group, "size", None)):
        size = int(cp_group.size())
    else:
        import torch.distributed as dist

        size = dist.get_world_size(cp_group)
    if size > 1:
        raise NotImplementedError(
            f"cp_group has {size} ranks: context parallelism is not supported here. Each "
            "rank holds its tokens in the host's load-balanced layout (chunks r and "
            "2 CP - 1 - r of 2 CP) and the rows are gathered back over the CP group; that "
            "layout is not reproduced, so nothing is computed rather than misplaced. Use a "
            "CP group of one rank, or the host's own function"
        )


# --- NeMo-RL's functions ---


def from_parallel_logits_to_logprobs(
    vocab_parallel_logits: torch.Tensor,
    target: torch.Tensor,
    vocab_start_index: int,
    vocab_end_index: int,
    tp_group,
    inference_only: bool = False,
    cp_group=None,
    chunk_size: int | None = None,
    sampling_params=None,
    *,
    vocab_size: int | None = None,
) -> torch.Tensor:
    """NeMo-RL's `from_parallel_logits_to_logprobs`: fp32 [B, S-1] from the logits
    [B, S_local, V_local] and the unshifted target [B, S]. `sampling_params`
    (`TrainingSamplingParams`, or anything with `top_k` and `top_p`): the processed
    logprobs of the exact cut; its `temperature` is not read (the caller has divided).
    `vocab_size` (keyword only): columns >= it are padding and never take part."""
    cut = None
    if sampling_params is not None:
        cut = sampling_cut(
            getattr(sampling_params, "top_k", None), getattr(sampling_params, "top_p", 1.0)
        )
    return shifted_logprobs(
        vocab_parallel_logits,
        target,
        vocab_start_index,
        vocab_end_index,
        tp_group,
        inference_only,
        cp_group,
        chunk_size,
        cut=cut,
        vocab_size=vocab_size,
    )


class DistributedLogprob:
    """NeMo-RL's `DistributedLogprob.apply(vocab_parallel_logits, target,
    vocab_start_index, vocab_end_index, group, inference_only=False)`: fp32 shaped like the
    (already shifted) target; differentiable through exactlogp's own autograd."""

    vocab_size: int | None = None  # set on the subclass patch_nemo_rl(vocab_size=) installs

    @classmethod
    def apply(
        cls,
        vocab_parallel_logits,
        target,
        vocab_start_index,
        vocab_end_index,
        group,
        inference_only=False,
    ):
        return shard_logprobs(
            vocab_parallel_logits,
            target,
            vocab_start_index,
            vocab_end_index,
            group,
            inference_only,
            vocab_size=cls.vocab_size,
        )


class ChunkedDistributedLogprob(DistributedLogprob):
    """`ChunkedDistributedLogprob.apply(..., vocab_end_index, chunk_size, tp_group,
    inference_only=False)`: the same bits; `chunk_size` is a memory knob."""

    @classmethod
    def apply(
        cls,
        vocab_parallel_logits,
        target,
        vocab_start_index,
        vocab_end_index,
        chunk_size,
        tp_group,
        inference_only=False,
    ):
        _rows.check_chunk_size(chunk_size)
        return super().apply(
            vocab_parallel_logits,
            target,
            vocab_start_index,
            vocab_end_index,
            tp_group,
            inference_only,
        )


class DistributedLogprobWithSampling(DistributedLogprob):
    """`DistributedLogprobWithSampling.apply(vocab_parallel_logits, target, tp_group, top_k,
    top_p, inference_only=False)`: processed logprobs of the exact cut (NeMo-RL's equal
    vocabulary shards, rank r from r * V_local)."""

    @classmethod
    def apply(cls, vocab_parallel_logits, target, tp_group, top_k, top_p, inference_only=False):
        return shard_logprobs(
            vocab_parallel_logits,
            target,
            None,
            None,
            tp_group,
            inference_only,
            cut=sampling_cut(top_k, top_p),
            vocab_size=cls.vocab_size,
        )


class ChunkedDistributedLogprobWithSampling(DistributedLogprobWithSampling):
    """`ChunkedDistributedLogprobWithSampling.apply(..., top_p, chunk_size,
    inference_only=False)`: the same bits; `chunk_size` is a memory knob."""

    @classmethod
    def apply(
        cls, vocab_parallel_logits, target, tp_group, top_k, top_p, chunk_size, inference_only=False
    ):
        _rows.check_chunk_size(chunk_size)
        return super().apply(vocab_parallel_logits, target, tp_group, top_k, top_p, inference_only)


_CLASSES = (
    DistributedLogprob,
    ChunkedDistributedLogprob,
    DistributedLogprobWithSampling,
    ChunkedDistributedLogprobWithSampling,
)


def drop_ins(function, names, vocab_size: int | None) -> dict:
    """{name: replacement} for the host objects `names`: `function` under the name
    `from_parallel_logits_to_logprobs` and the classes above; with `vocab_size`, copies
    that pass it (a partial, subclasses)."""
    classes = {cls.__name__: cls for cls in _CLASSES}
    out = {}
    for name in names:
        if name == "from_parallel_logits_to_logprobs":
            out[name] = (
                function
                if vocab_size is None
                else functools.wraps(function)(functools.partial(function, vocab_size=vocab_size))
            )
        elif vocab_size is None:
            out[name] = classes[name]
        else:
            cls = classes[name]
            out[name] = type(
                name,
                (cls,),
                {"vocab_size": vocab_size, "__doc__": cls.__doc__, "__module__": cls.__module__},
            )
    return out


# --- patching NeMo-RL ---


@_patching.atomic
def patch_nemo_rl(*, vocab_size: int | None = None) -> _patching.PatchHandle:
    """Make NeMo-RL's vocab-parallel log-probs exactlogp's.

    Replaces in `nemo_rl.distributed.model_utils` (and every NeMo-RL module that bound
    them by name: `nemo_rl.models.megatron.train`'s `from_parallel_logits_to_logprobs`):
    `from_parallel_logits_to_logprobs` (the Megatron policy's logprobs, and
    `get_next_token_logprobs_from_logits` with a vocab-parallel group) and the autograd
    entries `DistributedLogprob`, `ChunkedDistributedLogprob`,
    `DistributedLogprobWithSampling`, `ChunkedDistributedLogprobWithSampling` (the DTensor
    path of `get_logprobs_from_vocab_parallel_logits` and the packed-sequence path).

    Follows NeMo-RL at NVIDIA-NeMo/RL@7ea279abfbeb (0.6.0): a version whose functions take
    other parameters is refused (RuntimeError naming the version), and nothing is changed.
    `vocab_size`: None or an int >= 1, the real vocabulary (Megatron's padding columns are
    left out). Opt-in and idempotent; undo with `unpatch_nemo_rl()` or `handle.undo()`.
    """
    vocab_size = _rows.check_vocab_size(vocab_size)
    _patching.check_signatures(PATCH_KEY, "nemo_rl", MODEL_UTILS, SIGNATURES, KNOWN)
    objects = drop_ins(from_parallel_logits_to_logprobs, SIGNATURES, vocab_size)
    sites = [
        _patching.Site(MODEL_UTILS, name, obj, everywhere=True) for name, obj in objects.items()
    ]
    sites.append(
        _patching.Site(
            _TRAIN,
            "from_parallel_logits_to_logprobs",
            objects["from_parallel_logits_to_logprobs"],
            optional=True,
        )
    )
    return _patching.apply(PATCH_KEY, sites, {"vocab_size": vocab_size})


def patch_from_env(vocab_size: int | None = None) -> _patching.PatchHandle:
    """EXACTLOGP_PATCH=nemo_rl (exactlogp.integrations.autopatch): `patch_nemo_rl` with
    EXACTLOGP_VOCAB_SIZE as its `vocab_size`."""
    return patch_nemo_rl(vocab_size=vocab_size)


@_patching.atomic
def unpatch_nemo_rl() -> bool:
    """Restore NeMo-RL's own functions; False if `patch_nemo_rl` was not applied."""
    return _patching.undo(PATCH_KEY)
