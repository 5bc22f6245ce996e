"""sglang/srt/layers/sampler.py (0.5.23): `Sampler.forward` samples the next tokens and,
with return_logprob, writes their logprobs (and the top-k / token-id lists) to
`logits_output`. Its logits are fp32 and already carry penalties, the grammar mask and
logit_bias. In SGLang's order:

- `_preprocess_logits`: the batch's custom logit processors, in place (NaN sanitising
  is off by default and not reproduced);
- all-greedy batches: argmax (int64) and log_softmax of the logits;
- otherwise: RL mode (`rl_on_policy_target`) scores bf16(bf16(logits) / T); with
  deterministic inference and no top-k / top-p / min-p in the batch it samples from
  those bf16 logprobs with the seeded Gumbel race; else the logits are divided by the
  (B, 1) temperatures in place, replaced in place by their softmax, and sampled on the
  PyTorch backend (`top_k_top_p_min_p_sampling_from_probs_torch`; SGLang's default on
  CUDA is FlashInfer's fused sampler) or, without any cut, by `sampling_from_probs_torch`
  -- torch.multinomial, or with a `sampling_seed` the Gumbel race on SGLang's
  `murmur_hash32(seed, position, token id)`; sampled ids are int32. The logprobs are
  log_softmax(logits / T) under deterministic inference, else log(probs);
- SGLANG_RETURN_ORIGINAL_LOGPROB: log_softmax of the logits (T = 1);
  `logprob_logits` (the pre-watermark logits): their log_softmax at T (1 if greedy);
- `_sync_token_ids_across_tp`: a MIN all-reduce of the ids over the TP group when
  SYNC_TOKEN_IDS_ACROSS_TP is set or the batch has grammars.

The sampling-mask output (`sampling_mask_batch_indices`) is not reproduced."""

import os

import torch
import torch.distributed as dist
from torch import nn

from sglang.kernels.ops.sampling.murmur_hash import murmur_hash32
from sglang.srt.layers.logprob_processor import OutputLogprobProcessor

SYNC_TOKEN_IDS_ACROSS_TP = os.environ.get("SYNC_TOKEN_IDS_ACROSS_TP", "0") in ("1", "true")
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

    def _preprocess_logits(self, logits, sampling_info):
        if sampling_info.has_custom_logit_processor:
            apply_custom_logit_processor(logits, sampling_info)
        return logits

    def forward(self, logits_output, sampling_info, return_logprob, top_logprobs_nums,
                token_ids_logprobs, positions, *, logprob_logits=None):  # fmt: skip
        logits = self._preprocess_logits(logits_output.next_token_logits, sampling_info)
        target = None
        if logprob_logits is not None:
            logprob_logits = self._preprocess_logits(logprob_logits, sampling_info)
            if sampling_info.is_all_greedy or SGLANG_RETURN_ORIGINAL_LOGPROB:
                target = torch.log_softmax(logprob_logits, dim=-1)
            else:
                target = torch.log_softmax(logprob_logits / sampling_info.temperatures, dim=-1)
        original = logprobs = None
        if sampling_info.is_all_greedy:
            token_ids = torch.argmax(logits, -1)
            if return_logprob:
                original = logprobs = torch.log_softmax(logits, dim=-1)
        else:
            simple = not (
                sampling_info.need_top_p_sampling
                or sampling_info.need_top_k_sampling
                or sampling_info.need_min_p_sampling
            )
            if return_logprob and SGLANG_RETURN_ORIGINAL_LOGPROB and target is None:
                original = torch.log_softmax(logits, dim=-1)
            rl = None
            if self.rl_on_policy_target is not None:
                scaled = logits.bfloat16().div(sampling_info.temperatures).bfloat16()
                rl = torch.log_softmax(scaled, dim=-1)
            if self.rl_on_policy_target is not None and self.enable_deterministic and simple:
                token_ids = _seeded_race(rl, sampling_info.sampling_seed, positions)
                if return_logprob and not SGLANG_RETURN_ORIGINAL_LOGPROB:
                    logprobs = rl
            else:
                logits.div_(sampling_info.temperatures)
                if (return_logprob and self.enable_deterministic and rl is None
                        and not SGLANG_RETURN_ORIGINAL_LOGPROB and target is None):  # fmt: skip
                    rl = torch.log_softmax(logits, dim=-1)
                logits[:] = torch.softmax(logits, dim=-1)
                probs = logits
                token_ids = _sample_from_probs(probs, sampling_info, positions, simple)
                if return_logprob and not SGLANG_RETURN_ORIGINAL_LOGPROB and target is None:
                    logprobs = rl if rl is not None else torch.log(probs)
        if return_logprob:
            if target is not None:
                logprobs = target
            elif SGLANG_RETURN_ORIGINAL_LOGPROB:
                logprobs = original
            result = self.output_logprob_processor.compute_logprobs(
                logprobs, top_logprobs_nums, token_ids_logprobs, token_ids
            )
            result.write_output_to(logits_output)
        self._sync_token_ids_across_tp(token_ids, sampling_info)
        if sampling_info.sampling_mask_batch_indices is not None:
            raise NotImplementedError("the stand-in does not reproduce the sampling mask")
        return token_ids

    def _sync_token_ids_across_tp(self, token_ids, sampling_info):
        if (SYNC_TOKEN_IDS_ACROSS_TP or sampling_info.grammars) and dist.is_initialized():
            dist.all_reduce(token_ids, op=dist.ReduceOp.MIN)


def _sample_from_probs(probs, sampling_info, positions, simple):
    seed = sampling_info.sampling_seed
    if simple:
        if seed is None:
            return torch.multinomial(probs, 1).view(-1).to(torch.int32)
        return _seeded_race(torch.log(probs), seed, positions)
    # the PyTorch backend: one descending sort, then top-k, top-p and min-p on the sorted probs
    ordered, order = probs.sort(dim=-1, descending=True)
    before = ordered.cumsum(dim=-1) - ordered  # mass strictly before each rank
    ranks = torch.arange(ordered.shape[-1], device=probs.device).view(1, -1)
    ordered[ranks >= sampling_info.top_ks.view(-1, 1)] = 0.0
    ordered[before > sampling_info.top_ps.view(-1, 1)] = 0.0
    if sampling_info.need_min_p_sampling:
        if seed is not None:
            raise AssertionError("SGLang's PyTorch backend refuses min-p with a sampling seed")
        ordered[ordered < (ordered[:, 0] * sampling_info.min_ps).view(-1, 1)] = 0.0
    if seed is None:
        picked = torch.multinomial(ordered, 1)
    else:
        picked = _seeded_race(ordered.to(torch.float64).log(), seed, positions).view(-1, 1)
    return order.to(torch.int32).gather(1, picked.long()).view(-1)


def _seeded_race(logprobs, seed, positions):
    """The Gumbel race on murmur_hash32(seed, position, token id) (multinomial_with_seed)."""
    cols = torch.arange(logprobs.shape[-1], device=logprobs.device)
    u = murmur_hash32(seed.to(torch.uint64), positions, cols).to(torch.float64) / (2**32 - 1)
    g = -torch.log(-torch.log(u).clamp(min=torch.finfo(torch.float64).min, max=-(2.0**-32)))
    return (logprobs.to(torch.float64) + g).argmax(dim=-1).to(torch.int32)


def apply_custom_logit_processor(logits, sampling_info):
    """Each processor entry edits its rows of the logits in place."""
    for entry in sampling_info.custom_logit_processor.values():
        params = [sampling_info.custom_params[i] for i in entry.rows]
        logits[entry.indices] = entry.processor(logits[entry.indices], params).to(logits.dtype)
