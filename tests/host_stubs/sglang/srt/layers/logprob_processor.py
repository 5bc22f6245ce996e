"""sglang/srt/layers/logprob_processor.py (0.5.23): the decode-side logprob outputs and
the speculative-decoding logprobs.

`OutputLogprobProcessor.compute_logprobs(logprobs, top_logprobs_nums, token_ids_logprobs,
batch_next_token_ids)` clamps the (B, V) logprobs in place to the dtype's minimum, then
fills a `LogprobResult`: the top-k lists (per row, the `k` largest values and their ids,
as device tensors), the requested token ids' values (a device tensor per row; an empty
one and [] where a row asked for none) and the sampled tokens' values.
`LogprobResult.write_output_to` copies them to the `LogitsProcessorOutput` fields
next_token_logprobs, next_token_top_logprobs_val / _idx and
next_token_token_ids_logprobs_val / _idx."""

from dataclasses import dataclass

import torch


@dataclass
class LogprobResult:
    token_logprobs: torch.Tensor | None = None
    top_logprobs_val: list | None = None
    top_logprobs_idx: list | None = None
    token_ids_logprobs_val: list | None = None
    token_ids_logprobs_idx: list | None = None

    def write_output_to(self, logits_output) -> None:
        if self.token_logprobs is not None:
            logits_output.next_token_logprobs = self.token_logprobs
        if self.top_logprobs_val is not None:
            logits_output.next_token_top_logprobs_val = self.top_logprobs_val
            logits_output.next_token_top_logprobs_idx = self.top_logprobs_idx
        if self.token_ids_logprobs_val is not None:
            logits_output.next_token_token_ids_logprobs_val = self.token_ids_logprobs_val
            logits_output.next_token_token_ids_logprobs_idx = self.token_ids_logprobs_idx


class OutputLogprobProcessor:
    def compute_logprobs(self, logprobs, top_logprobs_nums, token_ids_logprobs, next_token_ids):
        logprobs.clamp_(min=torch.finfo(logprobs.dtype).min)
        result = LogprobResult()
        if any(k > 0 for k in top_logprobs_nums):
            values, indices = logprobs.topk(max(top_logprobs_nums), dim=-1)
            result.top_logprobs_val = [values[i][:k] for i, k in enumerate(top_logprobs_nums)]
            result.top_logprobs_idx = [indices[i][:k] for i, k in enumerate(top_logprobs_nums)]
        if any(ids is not None for ids in token_ids_logprobs):
            vals, idxs = [], []
            for i, ids in enumerate(token_ids_logprobs):
                if ids is None:
                    vals.append(logprobs.new_empty((0,)))
                    idxs.append([])
                else:
                    vals.append(logprobs[i, torch.tensor(ids, dtype=torch.long)])
                    idxs.append(ids)
            result.token_ids_logprobs_val, result.token_ids_logprobs_idx = vals, idxs
        rows = torch.arange(len(next_token_ids), device=logprobs.device)
        result.token_logprobs = logprobs[rows, next_token_ids]
        return result


def compute_spec_logprobs(batch, logits_output, predict, *, accept_index=None, chain_stride=None):
    logprobs = torch.log_softmax(logits_output.next_token_logits, dim=-1)
    return logprobs.gather(-1, predict.view(-1, 1)).view(-1)
