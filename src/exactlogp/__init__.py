"""exactlogp: bitwise-reproducible, correctly rounded logprobs from vocab-sharded logits."""

from .api import LogprobResult, SelectedLogprobs, selected_logprobs
from .contract import CONTRACT
from .linear import (
    LOGITS_CONTRACT,
    gather_sequence_parallel,
    linear_logits,
    linear_selected_logprobs,
)
from .warmup import warmup

__version__ = "0.1.0"

__all__ = [
    "CONTRACT",
    "LOGITS_CONTRACT",
    "LogprobResult",
    "SelectedLogprobs",
    "__version__",
    "gather_sequence_parallel",
    "linear_logits",
    "linear_selected_logprobs",
    "selected_logprobs",
    "warmup",
]
