"""Stand-in: slime/utils/ppo_utils.py of THUDM/slime@624b824a898ab0ec1fcb4d373004c7f3852bf515
(lines 174-358 and 718-769), the vocab-parallel log-prob / entropy and nothing else of
that module (its PPO losses, KL estimators and advantage helpers are left out).

Written from that source, step for step in the same arithmetic so that the values are
slime's: fp32 logits; the row max all-reduced (MAX) over the group; x - max, exp, the row
sum all-reduced (SUM); the target's x - max gathered on the rank that holds it, zeroed
elsewhere and all-reduced (SUM); log_prob = that - log(sum). Entropy = max + log(sum) -
all-reduce(sum(softmax * x)), from the unmasked logits. With a keep mask the log-prob uses
a second softmax over the logits with the dropped columns set to -inf and the target's
logit put back. Backward: (one_hot - softmax) * grad_log_prob + softmax * (sum - x) *
grad_entropy, no collective. The vocabulary is split evenly: rank r holds
[r * V_local, (r + 1) * V_local). vime's `vime/utils/ppo_utils.py` has the same function.
"""

import torch
import torch.distributed as dist


def _maybe_all_reduce(tensor, op, process_group):
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(tensor, op=op, group=process_group)


def _get_vocab_parallel_rank_size(process_group):
    if (
        process_group is not None
        and hasattr(process_group, "rank")
        and hasattr(process_group, "size")
    ):
        return process_group.rank(), process_group.size()
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group=process_group), dist.get_world_size(group=process_group)
    return 0, 1


def _softmax_parts(x, group, rows, local_target):
    """(x - max at the target, sum of exp, softmax, max) over the group; x is consumed."""
    row_max = x.max(dim=-1, keepdim=True).values
    _maybe_all_reduce(row_max, dist.ReduceOp.MAX, group)
    shifted = x.sub_(row_max)
    predicted = shifted[rows, local_target]  # a copy, taken before exp_ overwrites it
    exps = shifted.exp_()
    total = exps.sum(dim=-1, keepdim=True)
    _maybe_all_reduce(total, dist.ReduceOp.SUM, group)
    return predicted, total, exps.div_(total), row_max


def _entropy(x, group, rows, local_target):
    _, total, softmax, row_max = _softmax_parts(x.clone(), group, rows, local_target)
    weighted = (softmax * x).sum(dim=-1, keepdim=True)
    _maybe_all_reduce(weighted, dist.ReduceOp.SUM, group)
    return (row_max + total.log() - weighted).squeeze(-1), softmax, weighted


class _VocabParallelLogProbEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        vocab_parallel_logits,
        target,
        log_prob_keep_mask,
        process_group,
        with_entropy,
        with_entropy_grad,
    ):
        with_entropy_grad = with_entropy and with_entropy_grad
        x = vocab_parallel_logits.float()
        rows_n, width = x.shape
        rank, _ = _get_vocab_parallel_rank_size(process_group)
        start = rank * width
        not_here = (target < start) | (target >= start + width)
        local_target = (target - start).clone()
        local_target[not_here] = 0
        rows = torch.arange(rows_n, device=x.device)

        empty = x.new_zeros((0,))
        entropy, ent_softmax, weighted = empty, empty, empty
        if with_entropy:
            entropy, ent_softmax, weighted = _entropy(x, process_group, rows, local_target)
        masked = x.clone()
        if log_prob_keep_mask is not None:
            masked = x.masked_fill(~log_prob_keep_mask, float("-inf"))
            here = (~not_here).nonzero().squeeze(-1)
            masked[here, local_target[here]] = x[here, local_target[here]]
        predicted, total, softmax, _ = _softmax_parts(masked, process_group, rows, local_target)
        predicted = predicted.masked_fill_(not_here, 0.0).unsqueeze(-1)
        _maybe_all_reduce(predicted, dist.ReduceOp.SUM, process_group)
        log_prob = predicted - total.log()

        if not with_entropy_grad:
            ctx.mark_non_differentiable(entropy)
        ctx.with_entropy_grad = with_entropy_grad
        keep = (lambda t: t) if with_entropy_grad else (lambda t: empty)
        ctx.save_for_backward(
            softmax, not_here, local_target, keep(ent_softmax), keep(weighted), keep(x)
        )
        return log_prob, entropy

    @staticmethod
    def backward(ctx, grad_log_prob, grad_entropy):
        softmax, not_here, local_target, ent_softmax, weighted, x = ctx.saved_tensors
        grad = -softmax
        rows = torch.arange(grad.size(0), device=grad.device)
        grad[rows, local_target] += (~not_here).to(grad.dtype)
        grad = grad * grad_log_prob.reshape(-1, 1)
        if ctx.with_entropy_grad and grad_entropy is not None and grad_entropy.numel() > 0:
            grad = grad + (weighted - x) * ent_softmax * grad_entropy.reshape(-1, 1)
        return grad, None, None, None, None, None


def _calculate_log_probs_and_entropy_chunk(
    logits, tokens, tp_group, *, with_entropy, with_entropy_grad=True, log_prob_keep_mask
):
    log_prob, entropy = _VocabParallelLogProbEntropy.apply(
        logits, tokens, log_prob_keep_mask, tp_group, with_entropy, with_entropy_grad
    )
    return log_prob, entropy if with_entropy else None


def calculate_log_probs_and_entropy(
    logits,
    tokens,
    tp_group,
    with_entropy: bool = False,
    chunk_size: int = -1,
    log_prob_keep_mask=None,
    with_entropy_grad: bool = True,
):
    logits = logits.contiguous()
    if logits.size(0) == 0:
        return logits.new_zeros((0,)), logits.new_zeros((0,)) if with_entropy else None
    pieces = 1 if chunk_size <= 0 else (logits.size(0) - 1) // chunk_size + 1
    masks = [None] * pieces if log_prob_keep_mask is None else log_prob_keep_mask.chunk(pieces)
    log_probs, entropies = [], []
    for part, ids, mask in zip(logits.chunk(pieces), tokens.chunk(pieces), masks, strict=True):
        log_prob, entropy = _calculate_log_probs_and_entropy_chunk(
            part,
            ids,
            tp_group,
            with_entropy=with_entropy,
            with_entropy_grad=with_entropy_grad,
            log_prob_keep_mask=mask,
        )
        log_probs.append(log_prob)
        if entropy is not None:
            entropies.append(entropy)
    return torch.cat(log_probs), torch.cat(entropies) if entropies else None
