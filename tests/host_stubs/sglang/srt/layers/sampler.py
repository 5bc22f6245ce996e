"""sglang/srt/layers/sampler.py: `Sampler.forward` samples and writes the sampled tokens'
logprobs to `logits_output.next_token_logprobs`. Its logits are fp32 and already carry
penalties, the grammar mask and logit_bias. All-greedy: argmax and raw log_softmax. RL
mode: bf16(bf16(logits) / T) then log_softmax (bf16). Otherwise the logits are divided
by T in place, replaced in place by their softmax, sampled after top-k / top-p on a
copy, and the logprobs are log_softmax(logits / T) (deterministic) or log(probs)."""

import os

import torch
from torch import nn

from sglang.srt.layers.logprob_processor import OutputLogprobProcessor

SGLANG_RETURN_ORIGINAL_LOGPROB = os.environ.get("SGLANG_RETURN_ORIGINAL_LOGPROB", "0") in (
    "1",
    "true",
)


class Sampler(nn.Module):
    def __init__(self, rl_on_policy_target=None, enable_deterministic=False):
        super().__init__()
        self.rl_on_policy_target = rl_on_policy_target
        self.enable_deterministic = enable_deterministic
        self.output_logprob_processor = OutputLogprobProcessor()

    def forward(self, logits_output, sampling_info, return_logprob, top_logprobs_nums,
                token_ids_logprobs, positions, *, logprob_logits=None):  # fmt: skip
        logits = logits_output.next_token_logits
        logprobs = None
        if sampling_info.is_all_greedy:
            token_ids = torch.argmax(logits, -1)
            if return_logprob:
                logprobs = torch.log_softmax(logits, dim=-1)
        else:
            temperatures = sampling_info.temperatures  # (B, 1) fp32
            if return_logprob and self.rl_on_policy_target is not None:
                logprobs = torch.log_softmax(logits.bfloat16().div(temperatures).bfloat16(), dim=-1)
            logits.div_(temperatures)
            if return_logprob and logprobs is None and self.enable_deterministic:
                logprobs = torch.log_softmax(logits, dim=-1)
            logits[:] = torch.softmax(logits, dim=-1)
            probs = logits
            kept = probs.clone()
            k = sampling_info.top_ks.view(-1, 1)
            kth = kept.sort(dim=-1, descending=True).values.gather(-1, (k - 1).clamp(min=0))
            kept[kept < kth] = 0
            token_ids = torch.multinomial(kept, 1, generator=sampling_info.generator).view(-1)
            if return_logprob and logprobs is None:
                logprobs = torch.log(probs)
        if return_logprob:
            result = self.output_logprob_processor.compute_logprobs(
                logprobs, top_logprobs_nums, token_ids_logprobs, token_ids
            )
            result.write_output_to(logits_output)
        return token_ids
