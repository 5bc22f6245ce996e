"""Errors that name the argument, the offending value and the first bad row.

Argument checks run before any collective and depend only on shapes, dtypes and
scalars, which every rank shares, so all ranks raise together. Data checks run after
the int64 all_reduce on the combined record, which is identical on every rank, so a bad
row is reported by all ranks at once instead of hanging the group.
"""

from __future__ import annotations

import math
import numbers

import torch

from . import contract

LOGIT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def check_logits(logits) -> None:
    if not isinstance(logits, torch.Tensor):
        raise TypeError(
            f"vocab_parallel_logits must be a torch.Tensor, got {type(logits).__name__}"
        )
    if logits.dtype not in LOGIT_DTYPES:
        raise TypeError(
            f"vocab_parallel_logits must be bfloat16, float16 or float32, got {logits.dtype}"
        )
    if logits.dim() < 1:
        raise ValueError("vocab_parallel_logits must have a vocabulary dimension, got a 0-d tensor")


def check_target(target, logits: torch.Tensor) -> None:
    if not isinstance(target, torch.Tensor):
        raise TypeError(f"target must be a torch.Tensor, got {type(target).__name__}")
    if target.dtype == torch.bool or target.is_floating_point() or target.is_complex():
        raise TypeError(f"target must hold integer token ids, got dtype {target.dtype}")
    if tuple(target.shape) != tuple(logits.shape[:-1]):
        raise ValueError(
            f"target shape {tuple(target.shape)} must equal vocab_parallel_logits shape "
            f"without its last dimension, {tuple(logits.shape[:-1])}"
        )
    _same_device("target", target, logits)


def check_keep_mask(keep_mask, logits: torch.Tensor) -> None:
    if keep_mask is None:
        return
    if not isinstance(keep_mask, torch.Tensor) or keep_mask.dtype != torch.bool:
        kind = keep_mask.dtype if isinstance(keep_mask, torch.Tensor) else type(keep_mask).__name__
        raise TypeError(f"keep_mask must be a bool tensor, got {kind}")
    if keep_mask.shape != logits.shape:
        raise ValueError(
            f"keep_mask shape {tuple(keep_mask.shape)} must equal vocab_parallel_logits "
            f"shape {tuple(logits.shape)}"
        )
    _same_device("keep_mask", keep_mask, logits)


def check_temperature(temperature, target: torch.Tensor) -> float | torch.Tensor:
    """A valid float (already rounded to fp32), or the tensor flattened to fp32 (N,)."""
    if isinstance(temperature, torch.Tensor):
        if not temperature.is_floating_point():
            raise TypeError(f"temperature tensor must be floating point, got {temperature.dtype}")
        if temperature.dim() != 0 and temperature.shape != target.shape:
            raise ValueError(
                f"temperature tensor shape {tuple(temperature.shape)} must be () or equal "
                f"target shape {tuple(target.shape)}"
            )
        _same_device("temperature", temperature, target)
        return temperature.to(torch.float32).expand(target.shape).reshape(-1)
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real):
        raise TypeError(
            f"temperature must be a float or a tensor, got {type(temperature).__name__}"
        )
    tau = contract.fp32_temperature(temperature)
    if not (math.isfinite(tau) and tau > 0.0):
        raise ValueError(
            f"temperature must be finite and > 0 in float32, got {temperature!r} (float32: {tau!r})"
        )
    return tau


def check_int(name: str, value, minimum: int | None = None, maximum: int | None = None):
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int or None, got {type(value).__name__}")
    value = int(value)
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {value}")
    return value


def check_vocab_extent(vocab_size: int | None, shard_end: int) -> None:
    if vocab_size is None and shard_end > contract.MAX_VOCAB:
        raise ValueError(
            f"the vocabulary ends at column {shard_end} > 2^20 = {contract.MAX_VOCAB}; "
            "contract exactlogp-v1 supports at most 2^20 columns (int64 limb sums)"
        )


def _same_device(name: str, tensor: torch.Tensor, other: torch.Tensor) -> None:
    if tensor.device != other.device:
        raise ValueError(f"{name} is on {tensor.device} but must be on {other.device}")


# --- data checks on the combined record (one host sync) ---

_MESSAGES = (  # flag, message; the first flag set on the first bad row is reported
    (contract.BAD_TEMPERATURE, "temperature{idx} = {tau} must be finite and > 0"),
    (
        contract.BAD_TARGET_RANGE,
        "target{idx} = {t} is outside [0, vocab_size={vocab}) and is not ignore_index={ignore}",
    ),
    (
        contract.BAD_TARGET_OWNER,
        "target{idx} = {t} is held by {owners} of {world} vocab shards (must be exactly "
        "1): the shards given by vocab_start leave a gap or overlap",
    ),
    (contract.BAD_TARGET_MASKED, "target{idx} = {t} is a column that keep_mask drops"),
    (
        contract.BAD_NONFINITE,
        "vocab_parallel_logits row{idx} has {nonfinite} NaN or +inf value(s) (after the "
        "temperature) in real, kept columns",
    ),
    (
        contract.BAD_NO_VALID_COLUMN,
        "vocab_parallel_logits row{idx} has no valid column: every real, kept column is -inf",
    ),
)


def raise_for_bad_rows(
    bad: torch.Tensor,  # (N,) int64 flags
    record: torch.Tensor,  # (N, NUM_COLS) int64
    target: torch.Tensor,  # (N,)
    shape: tuple[int, ...],  # the caller's target shape
    temperature,
    vocab_size: int | None,
    ignore_index: int,
    world_size: int,
) -> None:
    if not bool((bad != 0).any()):  # the one host sync of validation
        return
    rows = torch.nonzero(bad).flatten()
    row = int(rows[0])
    flags = int(bad[row])
    idx = list(torch.unravel_index(torch.tensor(row), shape)) if shape else []
    fields = dict(
        idx="[" + ", ".join(str(int(i)) for i in idx) + "]",
        t=int(target[row]),
        tau=float(temperature[row]) if isinstance(temperature, torch.Tensor) else temperature,
        vocab="end of the last shard" if vocab_size is None else vocab_size,
        ignore=ignore_index,
        owners=int(record[row, contract.COL_OWNERS]),
        world=world_size,
        nonfinite=int(record[row, contract.COL_NONFINITE]),
    )
    for flag, message in _MESSAGES:
        if flags & flag:
            text = message.format(**fields)
            break
    more = len(rows) - 1
    if more:
        text += f" ({more} more bad row{'s' if more > 1 else ''})"
    raise ValueError(text + "; pass validate=False to get NaN in such rows instead")
