"""Full-vocabulary rows for the trainer drop-ins (TRL, verl, Megatron RL): one place for
the row mask, the K-ids-per-row index, the fp64 path and the host's output dtype.

bf16 / fp16 / fp32 logits go through `selected_logprobs` (contract `exactlogp.CONTRACT`).
fp64 logits are outside the contract (it takes bf16, fp16 and fp32): hosts accept them,
so they are computed here in fp64 with plain torch (logsumexp and a softmax-weighted sum)
-- accurate to fp64 rounding, but neither correctly rounded nor batch invariant.
"""

from __future__ import annotations

import importlib.util
import numbers

import torch

from ..api import selected_logprobs
from ..contract import MAX_VOCAB
from ..validation import check_int
from . import kept
from ._dtensor import is_dtensor, vocab_shard

IGNORE = -100  # the id that gives 0 (exactlogp's default ignore_index)


def check_tensor(name: str, value) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    return value


def check_positive_temperature(temperature) -> float:
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real):
        raise TypeError(f"temperature must be a float, got {type(temperature).__name__}")
    if not temperature > 0:  # also NaN
        raise ValueError(f"temperature must be positive, got {temperature!r}")
    return float(temperature)


def check_out_dtype(out_dtype) -> torch.dtype | None:
    """None or a floating torch.dtype: log-probabilities cast to an integer or bool dtype
    would be truncated or wrap around (uint8 249 for -7.79)."""
    if out_dtype is None:
        return None
    if not isinstance(out_dtype, torch.dtype) or not out_dtype.is_floating_point:
        raise TypeError(
            "out_dtype must be a floating torch.dtype (e.g. torch.float32) or None, got "
            f"{out_dtype!r}"
        )
    return out_dtype


def check_vocab_size(vocab_size) -> int | None:
    """None or an int in [1, MAX_VOCAB] (not a bool)."""
    return check_int("vocab_size", vocab_size, 1, MAX_VOCAB)


def check_chunk_size(chunk_size) -> int:
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, numbers.Integral):
        raise TypeError(f"chunk_size must be an int, got {type(chunk_size).__name__}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    return int(chunk_size)


def one_id_per_row(
    logits: torch.Tensor,
    index: torch.Tensor,
    *,
    temperature: float = 1.0,
    row_mask: torch.Tensor | None = None,
    with_entropy: bool = False,
    vocab_size: int | None = None,
    replay: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(logprobs, entropy) shaped like `index` (== logits.shape[:-1]); fp32, or fp64 for
    fp64 logits. Rows where `row_mask == 0` give exactly 0 and a zero gradient. A DTensor
    `logits` sharded on its last dimension is scored shard by shard over its mesh's group.
    Inside `kept.replaying` (and `replay`: a call for the labels' logprobs), over the
    rollout's kept sets."""
    vocab_size = check_vocab_size(vocab_size)
    if is_dtensor(index):
        index = index.full_tensor()
    if is_dtensor(row_mask):
        row_mask = row_mask.full_tensor()
    if row_mask is not None:
        check_tensor("row_mask", row_mask)
        if tuple(row_mask.shape) != tuple(index.shape):
            raise ValueError(
                f"row_mask shape {tuple(row_mask.shape)} must equal the index shape "
                f"{tuple(index.shape)}"
            )
        index = torch.where(row_mask.to(index.device) == 0, IGNORE, index)
    if replay and kept.active() is not None:
        return _replayed(logits, index, temperature, with_entropy, vocab_size)
    if is_dtensor(logits):
        # FSDP2 / torchtitan tensor parallel: each rank scores its own vocabulary columns
        shard = vocab_shard(logits, -1)
        if shard.local.dtype == torch.float64:
            return _fp64(logits.full_tensor(), index, temperature, with_entropy)
        result = selected_logprobs(
            shard.local,
            index,
            tp_group=shard.tp_group,
            vocab_start=shard.vocab_start,
            vocab_size=shard.vocab_size if shard.tp_group is not None else None,
            temperature=temperature,
            with_entropy=with_entropy,
        )
        return result.logprobs, result.entropy
    if logits.dtype == torch.float64:
        real = logits if vocab_size is None else logits[..., :vocab_size]
        return _fp64(real, index, temperature, with_entropy)
    result = selected_logprobs(
        logits, index, temperature=temperature, with_entropy=with_entropy, vocab_size=vocab_size
    )
    return result.logprobs, result.entropy


def _replayed(logits, index, temperature, with_entropy, vocab_size):
    """one_id_per_row inside `kept.replaying`: (logprobs, entropy) over the kept sets."""
    options = dict(temperature=temperature, with_entropy=with_entropy)
    if is_dtensor(logits):
        shard = vocab_shard(logits, -1)
        logits = shard.local
        options.update(tp_group=shard.tp_group, vocab_start=shard.vocab_start,
                       vocab_size=shard.vocab_size if shard.tp_group is not None else None)  # fmt: skip
    elif logits.dtype == torch.float64:
        raise ValueError("replaying kept sets needs bf16, fp16 or fp32 logits, got fp64")
    else:
        options["vocab_size"] = vocab_size
    result = kept.replayed(logits, index, "the log-prob drop-in", **options)
    return result.logprobs, result.entropy


def k_ids_per_row(
    logits: torch.Tensor,
    index: torch.Tensor,
    *,
    temperature: float = 1.0,
    row_mask: torch.Tensor | None = None,
    vocab_size: int | None = None,
) -> torch.Tensor:
    """Logprobs for `index` of shape (...) or (..., K); each of the K ids is its own call,
    so every value has the bits of a one-id call."""
    check_tensor("logits", logits)
    check_tensor("index", index)
    rows = tuple(logits.shape[:-1])
    if tuple(index.shape) == rows:
        logprobs, _ = one_id_per_row(
            logits, index, temperature=temperature, row_mask=row_mask, vocab_size=vocab_size
        )
        return logprobs
    if index.dim() == logits.dim() and tuple(index.shape[:-1]) == rows:
        if row_mask is not None and tuple(row_mask.shape) == rows:
            row_mask = row_mask.unsqueeze(-1).expand(index.shape)
        columns = [
            one_id_per_row(
                logits,
                index[..., k],
                temperature=temperature,
                row_mask=None if row_mask is None else row_mask[..., k],
                vocab_size=vocab_size,
            )[0]
            for k in range(index.shape[-1])
        ]
        if not columns:
            dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
            return torch.empty(index.shape, dtype=dtype, device=logits.device)
        return torch.stack(columns, dim=-1)
    raise ValueError(
        f"index shape {tuple(index.shape)} must be logits shape without its last dimension, "
        f"{rows}, optionally followed by K"
    )


def entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of softmax(logits / temperature) per row; fp32 (fp64 for fp64 logits)."""
    check_tensor("logits", logits)
    # Any id inside the vocabulary serves as the (unused) target; id 0 always is.
    target = torch.zeros(logits.shape[:-1], dtype=torch.int64, device=logits.device)
    return one_id_per_row(logits, target, temperature=temperature, with_entropy=True, replay=False)[
        1
    ]


def cast(value: torch.Tensor | None, dtype: torch.dtype | None) -> torch.Tensor | None:
    """The result in the host's dtype. Rounding exactlogp's fp32 to bf16 / fp16 is a
    function of its bits, so the rounded values are as invariant as the fp32 ones."""
    if value is None or dtype is None or value.dtype == dtype:
        return value
    return value.to(dtype)


def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def _fp64(logits, index, temperature, with_entropy):
    y = logits / temperature if temperature != 1.0 else logits
    ignored = index == IGNORE
    safe = torch.where(ignored, 0, index).to(torch.int64)
    lse = torch.logsumexp(y, dim=-1)
    logprobs = y.gather(-1, safe.unsqueeze(-1)).squeeze(-1) - lse
    logprobs = logprobs.masked_fill(ignored, 0.0)
    if not with_entropy:
        return logprobs, None
    p = torch.softmax(y, dim=-1)
    h = lse - (p * y.masked_fill(p == 0, 0.0)).sum(-1)  # a -inf column has p = 0
    return logprobs, h.masked_fill(ignored, 0.0)
