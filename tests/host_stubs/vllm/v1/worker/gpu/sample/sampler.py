"""vllm/v1/worker/gpu/sample/sampler.py: `Sampler.__call__(logits, input_batch)`.

`apply_sampling_params` copies the logits to fp32 (only when a row needs processing) and
applies, in vLLM's order: additive logit bias, repetition / frequency / presence
penalties, bad words, temperature (an fp32 division; rows with T in {0, 1} untouched),
min-p (below max + log(min_p) -> -inf), then top-k / top-p (-inf). The processed-logprob
modes score those processed logits; the raw modes the input."""

from types import SimpleNamespace

import torch

from vllm.config.model import PROCESSED_LOGPROBS_MODES
from vllm.v1.worker.gpu.sample.logprob import compute_topk_scores


def apply_top_k_top_p(logits, k, p):
    ascending, order = logits.sort(dim=-1)
    vocab = logits.shape[-1]
    threshold = ascending.gather(1, (vocab - k.clamp(max=vocab).long()).unsqueeze(1))
    ascending = ascending.masked_fill(ascending < threshold, float("-inf"))
    running = ascending.softmax(dim=-1).cumsum(dim=-1)
    drop = running <= 1 - p.unsqueeze(1)
    drop[:, -1] = False
    ascending = ascending.masked_fill(drop, float("-inf"))
    return ascending.scatter(dim=-1, index=order, src=ascending)


class Sampler:
    def __init__(self, logprobs_mode="raw_logprobs"):
        self.logprobs_mode = logprobs_mode

    def apply_sampling_params(self, logits, batch, skip_top_k_top_p=False):
        if not batch.needs_processing:
            return logits
        x = torch.empty_like(logits, dtype=torch.float32).copy_(logits)
        if batch.logit_bias is not None:
            x += batch.logit_bias
        if batch.repetition_penalty is not None:
            seen = batch.output_counts > 0
            r = batch.repetition_penalty.unsqueeze(1)
            x = torch.where(seen, torch.where(x > 0, x / r, x * r), x)
            x -= batch.frequency_penalty.unsqueeze(1) * batch.output_counts
            x -= batch.presence_penalty.unsqueeze(1) * seen
        if batch.bad_words is not None:
            x = x.masked_fill(batch.bad_words, float("-inf"))
        t = batch.temperature.unsqueeze(1)
        x = torch.where((t == 0) | (t == 1), x, x / t)
        mp = batch.min_p.unsqueeze(1)
        threshold = x.max(dim=-1, keepdim=True).values + torch.log(mp)
        x = torch.where((mp > 0) & (x < threshold), float("-inf"), x)
        if not skip_top_k_top_p:
            x = apply_top_k_top_p(x, batch.top_k, batch.top_p)
        return x

    def sample(self, logits, batch):
        processed = self.apply_sampling_params(logits, batch, skip_top_k_top_p=True)
        if batch.needs_processing:
            processed = apply_top_k_top_p(processed, batch.top_k, batch.top_p)
        q = torch.empty(processed.shape).exponential_(generator=batch.generator)
        random = (processed.float().softmax(-1) / q).argmax(-1)
        greedy = processed.float().argmax(-1)
        return torch.where(batch.temperature == 0, greedy, random), processed

    def __call__(self, logits, batch):
        sampled, processed = self.sample(logits, batch)
        tensors = None
        if batch.num_logprobs is not None:
            scored = processed if self.logprobs_mode in PROCESSED_LOGPROBS_MODES else logits
            tensors = compute_topk_scores(
                scored, batch.num_logprobs, sampled,
                logits_mode=self.logprobs_mode in ("raw_logits", "processed_logits"),
            )  # fmt: skip
        return SimpleNamespace(sampled_token_ids=sampled.view(-1, 1), logprobs_tensors=tensors)
