"""exactlogp: bitwise-reproducible, correctly rounded logprobs from vocab-sharded logits."""

from .api import LogprobResult, SelectedLogprobs, selected_logprobs
from .contract import CONTRACT
from .warmup import warmup

__version__ = "0.1.0"

__all__ = [
    "CONTRACT",
    "LogprobResult",
    "SelectedLogprobs",
    "__version__",
    "selected_logprobs",
    "warmup",
]
