"""vllm/v1/worker/gpu/sample/logprob.py: compute_topk_scores looks compute_token_logprobs
up as a module global at call time (the host runs a Triton kernel: an fp32 max, an fp32
sum of exp(x - max) in blocks of 1024, then x[id] - max - log(sum))."""

import torch

from vllm.v1.outputs import LogprobsTensors


def compute_token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    x = logits.float()
    m = x.max(dim=-1, keepdim=True).values
    lse = torch.log(torch.exp(x - m).sum(-1, keepdim=True))
    return x.gather(-1, token_ids.to(torch.int64)) - m - lse


def compute_topk_scores(logits, num_logprobs: int, sampled_token_ids, cu_num_logits=None,
                        logprob_token_ids_state=None, expanded_idx_mapping=None,
                        max_per_req_token_ids=0, logits_mode=False) -> LogprobsTensors:  # fmt: skip
    sampled = sampled_token_ids.to(torch.int64).view(-1, 1)
    ids = sampled
    if num_logprobs > 0:
        ids = torch.cat([sampled, torch.topk(logits, num_logprobs, dim=-1).indices], dim=1)
    if logits_mode:
        scores = logits.gather(-1, ids).to(torch.float32)
    else:
        scores = compute_token_logprobs(logits, ids)
    chosen = logits.gather(-1, sampled)
    ranks = (logits >= chosen).sum(-1)
    return LogprobsTensors(ids, scores, ranks)
