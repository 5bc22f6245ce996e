"""sglang/srt/sampling/sampling_batch_info.py (0.5.23): the per-batch sampling fields
that `Sampler.forward` reads, with SGLang's names, shapes and dtypes. Built by SGLang in
`SamplingBatchInfo.from_schedule_batch` from the requests' normalised `SamplingParams`:

- temperatures (B, 1) fp32, top_ps (B,) fp32, top_ks (B,) int32, min_ps (B,) fp32;
- is_all_greedy / is_any_greedy: every / some request has top_k <= 1 (SGLang's greedy:
  temperature 0 is stored as temperature 1.0 and top_k 1);
- need_top_p_sampling (some top_p != 1.0), need_top_k_sampling (some top_k !=
  TOP_K_ALL), need_min_p_sampling (some min_p > 0);
- sampling_seed (B,) int64, only under deterministic inference (a request without a
  seed gets 42), else None;
- sampling_mask_batch_indices: the rows that asked for their sampling mask, else None;
- custom_logit_processor: {key: ProcessorEntry(processor, rows, indices)} with
  custom_params (one per request), when has_custom_logit_processor.

The fields for grammars, penalties, logit bias and watermarks are applied by SGLang before
the sampler and are not reproduced here."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch


@dataclasses.dataclass
class ProcessorEntry:
    """A custom logit processor, `processor(logits_rows, params) -> logits_rows`, and
    the batch rows (a list, and the same as a device index tensor) it applies to."""

    processor: Any
    rows: list
    indices: torch.Tensor


@dataclasses.dataclass
class SamplingBatchInfo:
    temperatures: torch.Tensor
    top_ps: torch.Tensor
    top_ks: torch.Tensor
    min_ps: torch.Tensor
    is_all_greedy: bool
    is_any_greedy: bool
    need_top_p_sampling: bool
    need_top_k_sampling: bool
    need_min_p_sampling: bool
    vocab_size: int
    grammars: list | None = None
    has_custom_logit_processor: bool = False
    custom_params: list | None = None
    custom_logit_processor: dict[int, Any] | None = None
    sampling_seed: torch.Tensor | None = None
    sampling_mask_batch_indices: torch.Tensor | None = None
    sampling_support_logprobs_capture_indices: torch.Tensor | None = None
    device: str = "cuda"
    max_top_k: int | None = None

    def __len__(self) -> int:
        return len(self.temperatures)
