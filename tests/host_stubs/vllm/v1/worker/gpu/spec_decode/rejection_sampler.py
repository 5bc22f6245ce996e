"""Spec decoding reuses the sampler's processing (top-k / top-p included) and binds
compute_topk_scores by name, as vLLM 0.34's rejection_sampler.py does."""

from vllm.config.model import PROCESSED_LOGPROBS_MODES
from vllm.v1.worker.gpu.sample.logprob import compute_topk_scores


class RejectionSampler:
    def __init__(self, sampler):
        self.sampler = sampler

    def draft_logprobs(self, logits, batch, draft_token_ids):
        processed = self.sampler.apply_sampling_params(logits, batch)
        scored = processed if self.sampler.logprobs_mode in PROCESSED_LOGPROBS_MODES else logits
        return compute_topk_scores(scored, 0, draft_token_ids)
