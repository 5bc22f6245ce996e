"""sglang/srt/layers/logprob_processor.py: the sampled-token gather (after clamping -inf
to the dtype's minimum, in place) and the speculative-decoding logprobs."""

from dataclasses import dataclass

import torch


@dataclass
class LogprobResult:
    next_token_logprobs: torch.Tensor

    def write_output_to(self, logits_output) -> None:
        logits_output.next_token_logprobs = self.next_token_logprobs


class OutputLogprobProcessor:
    def compute_logprobs(self, logprobs, top_logprobs_nums, token_ids_logprobs, next_token_ids):
        logprobs.clamp_(min=torch.finfo(logprobs.dtype).min)
        rows = torch.arange(len(next_token_ids), device=logprobs.device)
        return LogprobResult(logprobs[rows, next_token_ids])


def compute_spec_logprobs(batch, logits_output, predict, *, accept_index=None, chain_stride=None):
    logprobs = torch.log_softmax(logits_output.next_token_logits, dim=-1)
    return logprobs.gather(-1, predict.view(-1, 1)).view(-1)
