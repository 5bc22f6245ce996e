"""verl drop-ins: log-probs and entropy from vocab-parallel logits (Megatron layout).

Names, arguments and shapes follow `verl.utils.megatron.tensor_parallel`: logits
(total_nnz, V_local) or any (..., V_local), labels (...) global ids, results (...) fp32,
split over Megatron's tensor-model-parallel group unless `tp_group` is given. The results
have the same bits for every TP degree, and log-prob and entropy can come from one pass.

verl's own `vocab_parallel_log_probs_from_logits` calls
`megatron.core.tensor_parallel.vocab_parallel_cross_entropy`, so `patch_megatron()` alone
already makes verl's log-probs exact; its entropy needs `vocab_parallel_entropy` below.
"""

from __future__ import annotations

import torch

from ..api import LogprobResult, selected_logprobs
from .megatron import resolve_tp_group


def vocab_parallel_log_probs_from_logits(
    logits: torch.Tensor, labels: torch.Tensor, *, tp_group=None, vocab_size: int | None = None
) -> torch.Tensor:
    """log softmax(logits)[labels] over the whole (sharded) vocabulary; shape of labels."""
    return _run(logits, labels, tp_group, vocab_size, with_entropy=False).logprobs


def vocab_parallel_entropy(
    vocab_parallel_logits: torch.Tensor, *, tp_group=None, vocab_size: int | None = None
) -> torch.Tensor:
    """Entropy of softmax(logits) over the whole (sharded) vocabulary; shape logits[..., 0]."""
    # Any id inside the vocabulary serves as the (unused) target; id 0 is always real.
    labels = torch.zeros(
        vocab_parallel_logits.shape[:-1], dtype=torch.int64, device=vocab_parallel_logits.device
    )
    return _run(vocab_parallel_logits, labels, tp_group, vocab_size, with_entropy=True).entropy


def vocab_parallel_log_probs_and_entropy(
    logits: torch.Tensor, labels: torch.Tensor, *, tp_group=None, vocab_size: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs, entropy) from one pass over the logits and one pair of collectives."""
    result = _run(logits, labels, tp_group, vocab_size, with_entropy=True)
    return result.logprobs, result.entropy


def _run(logits, labels, tp_group, vocab_size, with_entropy: bool) -> LogprobResult:
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"logits must be a torch.Tensor, got {type(logits).__name__}")
    group, vocab_start = resolve_tp_group(tp_group, logits)
    return selected_logprobs(
        logits,
        labels,
        tp_group=group,
        vocab_start=vocab_start,
        vocab_size=vocab_size,
        with_entropy=with_entropy,
    )
