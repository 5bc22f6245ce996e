"""SkyRL drop-ins, with SkyRL 0.3.0's names, arguments and output dtypes.

FSDP backend (`skyrl.backends.skyrl_train.utils.torch_utils`, full logits; the worker's
`model_wrapper` binds both by name):
- `logprobs_from_logits(logits, labels, inplace_backward=True)`: log softmax(logits)[labels]
  shaped like labels, labels already shifted by the caller. Output dtype as SkyRL's: fp32
  where its flash-attn cross-entropy runs (flash-attn importable), else the logits' dtype
  (its `logprobs_from_logits_v2`: fp32 in, fp32 out; bf16 in, bf16 out).
- `chunked_entropy_from_logits(logits, requires_grad=False, attention_mask=None,
  chunk_size=1024)`: the entropy [B, S] of logits [B, S, V] in the logits' dtype, 0 where
  `attention_mask` is 0, computed without autograd unless `requires_grad`.

Megatron backend (`skyrl.backends.skyrl_train.distributed.megatron.model_utils`, copied
from NeMo-RL): `from_parallel_logits_to_logprobs(vocab_parallel_logits, target,
vocab_start_index, vocab_end_index, tp_group, inference_only=False, cp_group=None,
chunk_size=None)` -> fp32 [B, S-1] from the unshifted target, and the autograd entries
`DistributedLogprob` / `ChunkedDistributedLogprob`: the NeMo-RL convention, one
implementation with `exactlogp.integrations.nemo_rl` (its differences apply: context
parallelism > 1 is refused).

SkyRL divides the logits by the temperature in place before these functions (the FSDP
`model_wrapper`, the Megatron wrapper); they take the logits as given. Deliberate
differences: `inplace_backward` is accepted and ignored (SkyRL's flash-attn path writes
the gradient into the logits' storage; exactlogp never writes into the logits); a label of
-100 gives 0 with a zero gradient (SkyRL's flash-attn path gives 0, its v2 path raises).
fp64 logits are computed in fp64 with plain torch (outside the contract).
"""

from __future__ import annotations

import importlib.util
import sys
from contextlib import nullcontext

import torch

from . import _patching, _rows
from .nemo_rl import (
    DISTRIBUTED,
    SHIFTED,
    ChunkedDistributedLogprob,
    DistributedLogprob,
    drop_ins,
    shifted_logprobs,
)

PATCH_KEY = "patch_skyrl"
TORCH_UTILS = "skyrl.backends.skyrl_train.utils.torch_utils"
_MODEL_WRAPPER = "skyrl.backends.skyrl_train.workers.model_wrapper"
MEGATRON_UTILS = "skyrl.backends.skyrl_train.distributed.megatron.model_utils"

# The parameters of the host functions replaced, as SkyRL 0.3.0 has them.
KNOWN = "SkyRL 0.3.0"
FSDP_SIGNATURES = {
    "logprobs_from_logits": ("logits", "labels", "inplace_backward"),
    "chunked_entropy_from_logits": ("logits", "requires_grad", "attention_mask", "chunk_size"),
}
MEGATRON_SIGNATURES = {"from_parallel_logits_to_logprobs": SHIFTED, **DISTRIBUTED}

__all__ = [
    "ChunkedDistributedLogprob",
    "DistributedLogprob",
    "chunked_entropy_from_logits",
    "from_parallel_logits_to_logprobs",
    "logprobs_from_logits",
    "patch_from_env",
    "patch_skyrl",
    "unpatch_skyrl",
]


# --- FSDP backend: full logits ---


def logprobs_from_logits(
    logits: torch.Tensor, labels: torch.Tensor, inplace_backward: bool = True
) -> torch.Tensor:
    """log_softmax(logits, -1) at `labels`, shaped like labels; SkyRL's output dtype.
    `inplace_backward` is accepted for SkyRL's signature: exactlogp never writes into the
    logits."""
    del inplace_backward
    logprobs, _ = _rows.one_id_per_row(_rows.check_tensor("logits", logits), labels)
    return _rows.cast(logprobs, torch.float32 if _skyrl_uses_flash_ce() else logits.dtype)


def chunked_entropy_from_logits(
    logits: torch.Tensor,
    requires_grad: bool = False,
    attention_mask: torch.Tensor | None = None,
    chunk_size: int = 1024,
) -> torch.Tensor:
    """Entropy of softmax(logits) per position, [B, S] in the logits' dtype; positions
    where `attention_mask` is 0 give 0 (and a zero gradient). `chunk_size` is SkyRL's
    memory knob and changes no bit."""
    logits = _rows.check_tensor("logits", logits)
    if logits.dim() != 3:
        raise ValueError(f"logits must be [B, S, V], got shape {tuple(logits.shape)}")
    rows = tuple(logits.shape[:2])
    if attention_mask is not None and tuple(attention_mask.shape) != rows:
        raise ValueError(
            f"attention_mask shape {tuple(attention_mask.shape)} does not match the logits' "
            f"(batch_size, seqlen) {rows}"
        )
    _rows.check_chunk_size(chunk_size)
    with nullcontext() if requires_grad else torch.no_grad():
        index = torch.zeros(rows, dtype=torch.int64, device=logits.device)
        _, entropy = _rows.one_id_per_row(logits, index, row_mask=attention_mask, with_entropy=True)
        if attention_mask is not None and attention_mask.dtype != torch.bool:
            entropy = entropy * attention_mask.to(entropy.device)  # SkyRL multiplies by it
    return _rows.cast(entropy, logits.dtype)


def _skyrl_uses_flash_ce() -> bool:
    """Whether SkyRL's own logprobs_from_logits would take its fp32 flash-attn path."""
    module = sys.modules.get(TORCH_UTILS)
    if module is not None:
        return bool(getattr(module, "FLASH_ATTN_CROSS_ENTROPY_LOSS_AVAILABLE", False))
    return importlib.util.find_spec("flash_attn") is not None


# --- Megatron backend: NeMo-RL's convention ---


def from_parallel_logits_to_logprobs(
    vocab_parallel_logits: torch.Tensor,
    target: torch.Tensor,
    vocab_start_index: int,
    vocab_end_index: int,
    tp_group,
    inference_only: bool = False,
    cp_group=None,
    chunk_size: int | None = None,
    *,
    vocab_size: int | None = None,
) -> torch.Tensor:
    """SkyRL's Megatron `from_parallel_logits_to_logprobs`: fp32 [B, S-1] from the logits
    [B, S_local, V_local] and the unshifted target [B, S] (NeMo-RL's convention).
    `vocab_size` (keyword only): columns >= it are padding and never take part."""
    return shifted_logprobs(
        vocab_parallel_logits,
        target,
        vocab_start_index,
        vocab_end_index,
        tp_group,
        inference_only,
        cp_group,
        chunk_size,
        vocab_size=vocab_size,
    )


# --- patching SkyRL ---


@_patching.atomic
def patch_skyrl(*, vocab_size: int | None = None) -> _patching.PatchHandle:
    """Make SkyRL 0.3.0's log-probs and entropy exactlogp's.

    Replaces, in SkyRL and in every SkyRL module that bound them by name:
    - `skyrl.backends.skyrl_train.utils.torch_utils`: `logprobs_from_logits`,
      `chunked_entropy_from_logits` (the FSDP worker's `model_wrapper`);
    - `skyrl.backends.skyrl_train.distributed.megatron.model_utils`:
      `from_parallel_logits_to_logprobs`, `DistributedLogprob`, `ChunkedDistributedLogprob`
      (the Megatron worker's logprobs, also of packed sequences; needs megatron-core;
      `vocab_size` leaves Megatron's padding columns out).

    Sites whose module does not import here (the FSDP `model_wrapper` needs flash-attn,
    the Megatron module megatron-core) are skipped and listed in `handle.skipped`. A
    SkyRL whose functions take other parameters is refused (RuntimeError naming the
    version), and nothing is changed. `vocab_size`: None or an int >= 1. Opt-in and
    idempotent; undo with `unpatch_skyrl()` or `handle.undo()`.
    """
    vocab_size = _rows.check_vocab_size(vocab_size)
    if _patching.active(PATCH_KEY) is None:
        _check_versions()
    fsdp = {
        "logprobs_from_logits": logprobs_from_logits,
        "chunked_entropy_from_logits": chunked_entropy_from_logits,
    }
    sites = [_patching.Site(TORCH_UTILS, name, fn, everywhere=True) for name, fn in fsdp.items()]
    sites += [_patching.Site(_MODEL_WRAPPER, name, fn, optional=True) for name, fn in fsdp.items()]
    megatron = drop_ins(from_parallel_logits_to_logprobs, MEGATRON_SIGNATURES, vocab_size)
    sites += [
        _patching.Site(MEGATRON_UTILS, name, obj, optional=True, everywhere=True)
        for name, obj in megatron.items()
    ]
    return _patching.apply(PATCH_KEY, sites, {"vocab_size": vocab_size})


def _check_versions() -> None:
    """SkyRL's functions must take the parameters of the version followed here."""
    import importlib

    _patching.check_signatures(PATCH_KEY, "skyrl", TORCH_UTILS, FSDP_SIGNATURES, KNOWN)
    try:
        importlib.import_module(MEGATRON_UTILS)
    except ImportError:
        return  # its sites are optional: skipped, and named in handle.skipped
    _patching.check_signatures(PATCH_KEY, "skyrl", MEGATRON_UTILS, MEGATRON_SIGNATURES, KNOWN)


def patch_from_env(vocab_size: int | None = None) -> _patching.PatchHandle:
    """EXACTLOGP_PATCH=skyrl (exactlogp.integrations.autopatch): `patch_skyrl` with
    EXACTLOGP_VOCAB_SIZE as its `vocab_size`."""
    return patch_skyrl(vocab_size=vocab_size)


@_patching.atomic
def unpatch_skyrl() -> bool:
    """Restore SkyRL's own functions; False if `patch_skyrl` was not applied."""
    return _patching.undo(PATCH_KEY)
