"""Binds both names by `from ... import`, as vLLM 0.34's prompt_logprob.py does."""

from vllm.v1.worker.gpu.sample.logprob import compute_token_logprobs, compute_topk_scores


def compute_prompt_token_id_logprobs(logits, token_ids):
    return compute_token_logprobs(logits, token_ids)


def compute_prompt_logprobs(logits, num_logprobs, prompt_ids):
    return compute_topk_scores(logits, num_logprobs, prompt_ids)
