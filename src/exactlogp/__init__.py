"""exactlogp: bitwise-reproducible, correctly rounded logprobs from vocab-sharded logits."""

from .api import KeptLogprobs, LogprobResult, SelectedLogprobs, selected_logprobs
from .contract import CONTRACT
from .cut.api import ProcessedLogprobs, SamplingMask, processed_logprobs, sample, sampling_mask
from .linear import (
    LOGITS_CONTRACT,
    gather_sequence_parallel,
    linear_logits,
    linear_selected_logprobs,
)
from .prepared import PreparedLMHead, prepare_lm_head
from .replay import linear_replay_logprobs, replay_logprobs
from .warmup import warmup

__version__ = "0.1.0"

__all__ = [
    "CONTRACT",
    "KeptLogprobs",
    "LOGITS_CONTRACT",
    "LogprobResult",
    "PreparedLMHead",
    "ProcessedLogprobs",
    "SamplingMask",
    "SelectedLogprobs",
    "__version__",
    "gather_sequence_parallel",
    "linear_logits",
    "linear_replay_logprobs",
    "linear_selected_logprobs",
    "prepare_lm_head",
    "processed_logprobs",
    "replay_logprobs",
    "sample",
    "sampling_mask",
    "selected_logprobs",
    "warmup",
]
