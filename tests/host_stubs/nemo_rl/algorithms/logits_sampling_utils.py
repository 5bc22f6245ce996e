"""Stand-in for `nemo_rl/algorithms/logits_sampling_utils.py` (NVIDIA-NeMo/RL@7ea279abfbeb),
written from that file: the trainer-side top-k / top-p cut NeMo-RL recomputes from the
trainer's own logits (vLLM's PyTorch algorithm for scalar parameters).

- `TrainingSamplingParams(top_k=None, top_p=1.0, temperature=1.0)`: a dataclass; top-k is
  active for an int > 0, top-p for a value other than 1.0 (and not None).
- `apply_top_k_top_p(logits, top_k, top_p)` -> (filtered logits, keep mask or None): with
  top-p, each row is sorted ascending, top-k keeps the sorted values >= the k-th largest,
  the softmax of the (top-k masked) sorted row is summed cumulatively and the columns whose
  running sum exceeds 1 - top_p are kept (the largest always); top-k alone keeps the
  columns >= the k-th largest value without sorting. Cut columns become -inf.

Not reproduced: NeMo-RL's row chunking of the sort (memory only: the values are per row)
and the `_ApplyTopKTopP` autograd wrapper (its backward zeroes the cut columns' gradient;
the stand-in's callers compute their own backward).
"""

from dataclasses import dataclass

import torch


@dataclass
class TrainingSamplingParams:
    top_k: int | None = None
    top_p: float = 1.0
    temperature: float = 1.0


def _top_k_on(top_k) -> bool:
    return top_k is not None and top_k > 0


def _top_p_on(top_p) -> bool:
    return top_p is not None and top_p != 1.0


def need_top_k_or_top_p_filtering(sampling_params) -> bool:
    if sampling_params is None:
        return False
    return _top_k_on(sampling_params.top_k) or _top_p_on(sampling_params.top_p)


@torch.no_grad()
def _keep_mask(logits: torch.Tensor, top_k, top_p) -> torch.Tensor:
    if not _top_p_on(top_p):
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        return logits >= kth
    rows = logits.reshape(-1, logits.shape[-1])
    ascending, order = rows.sort(dim=-1)
    keep_sorted = torch.ones_like(ascending, dtype=torch.bool)
    if _top_k_on(top_k):
        kth = ascending[:, ascending.shape[-1] - top_k].unsqueeze(-1)
        keep_sorted = ascending >= kth
        ascending = ascending.masked_fill(~keep_sorted, float("-inf"))
    running = ascending.softmax(dim=-1).cumsum(dim=-1)
    nucleus = running > 1 - top_p
    nucleus[:, -1] = True
    keep_sorted = keep_sorted & nucleus
    keep = torch.empty_like(keep_sorted).scatter_(-1, order, keep_sorted)
    return keep.view(logits.shape)


def apply_top_k_top_p(logits: torch.Tensor, top_k, top_p):
    if not _top_k_on(top_k) and not _top_p_on(top_p):
        return logits, None
    keep = _keep_mask(logits, top_k, top_p)
    return logits.masked_fill(~keep, float("-inf")), keep
