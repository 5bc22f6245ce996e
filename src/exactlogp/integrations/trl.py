"""TRL drop-ins on full (unsharded) logits: `selective_log_softmax`, `entropy_from_logits`.

Same names and arguments as `trl.trainer.utils`. Each value is bitwise the one
`exactlogp.selected_logprobs` gives for the same row (and so the one a TP-sharded trainer
or a rollout engine gets from exactlogp), correctly rounded, differentiable. Results are
fp32 whatever the logits' dtype; fp64 logits are refused (contract exactlogp-v1 takes
bf16, fp16 and fp32).
"""

from __future__ import annotations

import numbers

import torch

from ..api import selected_logprobs


def selective_log_softmax(logits: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """log_softmax(logits, -1) gathered at `index`, without the (..., V) log-softmax.

    Args:
        logits: (..., V).
        index: (...) one token id per row, or (..., K) K ids per row; ids equal to -100
            give 0.
    Returns:
        fp32 shaped like `index`. With K ids per row the row is read K times.
    """
    if not isinstance(logits, torch.Tensor) or not isinstance(index, torch.Tensor):
        raise TypeError(
            "logits and index must be torch.Tensors, got "
            f"{type(logits).__name__} and {type(index).__name__}"
        )
    rows = tuple(logits.shape[:-1])
    if tuple(index.shape) == rows:
        return selected_logprobs(logits, index).logprobs
    if index.dim() == logits.dim() and tuple(index.shape[:-1]) == rows:
        columns = [
            selected_logprobs(logits, index[..., k]).logprobs for k in range(index.shape[-1])
        ]
        if not columns:
            return torch.empty(index.shape, dtype=torch.float32, device=logits.device)
        return torch.stack(columns, dim=-1)
    raise ValueError(
        f"index shape {tuple(index.shape)} must be logits shape without its last dimension, "
        f"{rows}, optionally followed by K"
    )


def entropy_from_logits(logits: torch.Tensor, chunk_size: int = 128) -> torch.Tensor:
    """Entropy (nats) of softmax(logits) for each row; fp32 shaped logits.shape[:-1].

    `chunk_size` is accepted for TRL's signature; exactlogp already works through the
    rows in blocks of bounded memory, and no choice of chunk changes a bit.
    """
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, numbers.Integral):
        raise TypeError(f"chunk_size must be an int, got {type(chunk_size).__name__}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"logits must be a torch.Tensor, got {type(logits).__name__}")
    # Any id inside the vocabulary serves as the (unused) target.
    target = torch.zeros(logits.shape[:-1], dtype=torch.int64, device=logits.device)
    return selected_logprobs(logits, target, with_entropy=True).entropy
