from typing import NamedTuple

import torch


class LogprobsTensors(NamedTuple):
    logprob_token_ids: torch.Tensor  # int64 [N, 1 + k]: column 0 is the sampled token
    logprobs: torch.Tensor  # fp32 [N, 1 + k]
    selected_token_ranks: torch.Tensor  # int64 [N]
