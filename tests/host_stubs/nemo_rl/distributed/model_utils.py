"""Stand-in for `nemo_rl/distributed/model_utils.py` (NVIDIA-NeMo/RL@7ea279abfbeb), written
from that file: its vocab-parallel log-probabilities with NeMo-RL's names, argument orders,
shift and arithmetic (see tests/host_stubs/README.md; NeMo-RL is not on the package index:
`nemo-rl` 0.0.0 there is an empty placeholder).

- `from_parallel_logits_to_logprobs(vocab_parallel_logits [B, S/CP, V/TP], target [B, S]
  unshifted, vocab_start_index, vocab_end_index, tp_group, inference_only=False,
  cp_group=None, chunk_size=None, sampling_params=None)` -> fp32 [B, S-1]: the target is
  rolled by -1 along the sequence, right-padded with 0 to S_local * CP, cut to this CP
  rank's tokens, scored by one of the four autograd functions below (chosen by
  `sampling_params`' top-k / top-p and by `chunk_size`), the padding is stripped and the
  last column (the wrapped target) dropped. `torch.distributed.get_rank(cp_group)` is
  called even without CP, so a process group must exist.
- `DistributedLogprob` / `ChunkedDistributedLogprob` (target already shifted): the fp32
  logits' log-softmax over the TP group (MAX all-reduce of the row maxima, SUM all-reduce
  of the summed exponentials), gathered at the targets of this rank's vocabulary range
  (0 elsewhere) and SUM all-reduced; gradient (one_hot - softmax) * grad. The chunked one
  works on sequence chunks and recomputes in its backward.
- `DistributedLogprobWithSampling` / `ChunkedDistributedLogprobWithSampling`: all-to-all
  from vocabulary shards to whole rows of B*S / TP tokens, NeMo-RL's float top-k / top-p
  cut on them (`nemo_rl.algorithms.logits_sampling_utils`), log_softmax in fp32, gather,
  all-gather; gradient masked to the kept columns and sent back by the inverse all-to-all.

Not reproduced: context parallelism > 1 (`allgather_cp_sharded_tensor` raises here), the
packed-sequence, DTensor, fused-LM-head, entropy and top-k functions of the module.
"""

from typing import Any

import torch
import torch.distributed as dist

from nemo_rl.algorithms.logits_sampling_utils import (
    TrainingSamplingParams,
    apply_top_k_top_p,
    need_top_k_or_top_p_filtering,
)


@torch.no_grad()
def _distributed_log_softmax(logits: torch.Tensor, group) -> torch.Tensor:
    row_max = torch.amax(logits, dim=-1, keepdim=True)
    dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
    shifted = logits - row_max
    total = shifted.exp().sum(-1, keepdim=True).float()
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    return shifted - total.log().to(shifted.dtype)


def _local_targets(target, vocab_start_index, vocab_end_index):
    outside = (target < vocab_start_index) | (target >= vocab_end_index)
    local = (target - vocab_start_index).masked_fill(outside, 0)
    return outside, local


def _picked(log_probs, outside, local, group):
    picked = log_probs.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
    dist.all_reduce(picked, op=dist.ReduceOp.SUM, group=group)
    return picked


def _grad(softmax, outside, local, grad_output):
    chosen = (~outside).unsqueeze(-1) * torch.nn.functional.one_hot(local, softmax.shape[-1])
    return (chosen.float() - softmax) * grad_output.unsqueeze(-1)


class DistributedLogprob(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, vocab_parallel_logits, target, vocab_start_index, vocab_end_index,
                group, inference_only=False):  # fmt: skip
        outside, local = _local_targets(target, vocab_start_index, vocab_end_index)
        log_probs = _distributed_log_softmax(vocab_parallel_logits.to(torch.float32), group)
        picked = _picked(log_probs, outside, local, group)
        if not inference_only:
            ctx.save_for_backward(log_probs.exp(), outside, local)
        return picked

    @staticmethod
    def backward(ctx: Any, grad_output):
        softmax, outside, local = ctx.saved_tensors
        return _grad(softmax, outside, local, grad_output), None, None, None, None, None


class ChunkedDistributedLogprob(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, vocab_parallel_logits, target, vocab_start_index, vocab_end_index,
                chunk_size, tp_group, inference_only=False):  # fmt: skip
        outside, local = _local_targets(target, vocab_start_index, vocab_end_index)
        pieces = []
        for s in range(0, vocab_parallel_logits.shape[1], chunk_size):
            part = slice(s, s + chunk_size)
            logits = vocab_parallel_logits[:, part].to(torch.float32)
            log_probs = _distributed_log_softmax(logits, tp_group)
            pieces.append(_picked(log_probs, outside[:, part], local[:, part], tp_group))
        if not inference_only:
            ctx.save_for_backward(vocab_parallel_logits, outside, local)
            ctx.chunk_size, ctx.tp_group = chunk_size, tp_group
        return torch.cat(pieces, dim=1)

    @staticmethod
    def backward(ctx: Any, grad_output):
        logits_all, outside, local = ctx.saved_tensors
        grad = torch.zeros_like(logits_all)
        for s in range(0, logits_all.shape[1], ctx.chunk_size):
            part = slice(s, s + ctx.chunk_size)
            softmax = _distributed_log_softmax(logits_all[:, part].float(), ctx.tp_group).exp()
            grad[:, part] = _grad(softmax, outside[:, part], local[:, part], grad_output[:, part])
        return grad, None, None, None, None, None, None


def all_to_all_vp2sq(vocab_parallel_logits: torch.Tensor, tp_group) -> torch.Tensor:
    """[BS, V_local] -> [BS / TP, V]: this rank's block of whole rows."""
    world = dist.get_world_size(tp_group)
    rows, width = vocab_parallel_logits.shape
    if rows % world:
        raise ValueError(f"BS={rows} must be divisible by tensor parallel size {world}.")
    received = torch.empty_like(vocab_parallel_logits.flatten())
    dist.all_to_all_single(received, vocab_parallel_logits.flatten(), group=tp_group)
    blocks = received.view(world, rows // world, width).permute(1, 0, 2)
    return blocks.reshape(rows // world, world * width)


def all_to_all_sq2vp(seq_parallel_logits: torch.Tensor, tp_group) -> torch.Tensor:
    """[BS / TP, V] -> [BS, V_local], the inverse of all_to_all_vp2sq."""
    world = dist.get_world_size(tp_group)
    rows, vocab = seq_parallel_logits.shape
    blocks = seq_parallel_logits.view(rows, world, vocab // world).permute(1, 0, 2).contiguous()
    received = torch.empty_like(blocks.flatten())
    dist.all_to_all_single(received, blocks.flatten(), group=tp_group)
    return received.view(world * rows, vocab // world)


def _sampled_rows(flat_logits, flat_target, tp_group, top_k, top_p):
    """(fp32 log-probs of this rank's whole rows after the cut, their targets, keep mask)."""
    world, rank = dist.get_world_size(tp_group), dist.get_rank(tp_group)
    n = flat_logits.shape[0] // world
    rows = all_to_all_vp2sq(flat_logits, tp_group)
    filtered, keep = apply_top_k_top_p(rows, top_k, top_p)
    log_probs = torch.log_softmax(filtered.to(torch.float32), dim=-1)
    return log_probs, flat_target[rank * n : (rank + 1) * n], keep


def _gather_rows(values, tp_group):
    parts = [torch.empty_like(values) for _ in range(dist.get_world_size(tp_group))]
    dist.all_gather(parts, values, group=tp_group)
    return torch.cat(parts)


def _sampled_grad(log_probs, target_local, keep, grad_local, tp_group):
    chosen = torch.nn.functional.one_hot(target_local, log_probs.shape[-1]).float()
    grad = (chosen - log_probs.exp()) * grad_local.unsqueeze(-1)
    if keep is not None:
        grad = grad * keep
    return all_to_all_sq2vp(grad, tp_group)


class DistributedLogprobWithSampling(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, vocab_parallel_logits, target, tp_group, top_k, top_p,
                inference_only=False):  # fmt: skip
        B, S, V_local = vocab_parallel_logits.shape
        flat = vocab_parallel_logits.reshape(B * S, V_local)
        log_probs, target_local, keep = _sampled_rows(flat, target.flatten(), tp_group, top_k,
                                                      top_p)  # fmt: skip
        picked = log_probs.gather(-1, target_local.unsqueeze(-1)).squeeze(-1)
        if not inference_only:
            ctx.save_for_backward(log_probs, target_local, keep)
            ctx.tp_group, ctx.shape = tp_group, (B, S, V_local)
        return _gather_rows(picked, tp_group).view(B, S)

    @staticmethod
    def backward(ctx: Any, grad_output):
        log_probs, target_local, keep = ctx.saved_tensors
        rank, n = dist.get_rank(ctx.tp_group), target_local.shape[0]
        grad_local = grad_output.flatten()[rank * n : (rank + 1) * n]
        grad = _sampled_grad(log_probs, target_local, keep, grad_local, ctx.tp_group)
        return grad.view(ctx.shape), None, None, None, None, None


class ChunkedDistributedLogprobWithSampling(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, vocab_parallel_logits, target, tp_group, top_k, top_p, chunk_size,
                inference_only=False):  # fmt: skip
        B, S, V_local = vocab_parallel_logits.shape
        step = chunk_size * B  # NeMo-RL chunks the flattened B*S rows by chunk_size * B
        if step % dist.get_world_size(tp_group):
            raise ValueError(f"Effective chunk size {step} must be divisible by the TP size.")
        flat, flat_target = vocab_parallel_logits.reshape(B * S, V_local), target.flatten()
        pieces = []
        for s in range(0, B * S, step):
            log_probs, target_local, _ = _sampled_rows(flat[s : s + step],
                                                       flat_target[s : s + step], tp_group,
                                                       top_k, top_p)  # fmt: skip
            picked = log_probs.gather(-1, target_local.unsqueeze(-1)).squeeze(-1)
            pieces.append(_gather_rows(picked, tp_group))
        if not inference_only:
            ctx.save_for_backward(vocab_parallel_logits, target)
            ctx.args = (tp_group, top_k, top_p, step)
        return torch.cat(pieces).view(B, S)

    @staticmethod
    def backward(ctx: Any, grad_output):
        logits_all, target = ctx.saved_tensors
        tp_group, top_k, top_p, step = ctx.args
        B, S, V_local = logits_all.shape
        flat, flat_target = logits_all.reshape(B * S, V_local), target.flatten()
        rank, grads = dist.get_rank(tp_group), []
        for s in range(0, B * S, step):
            log_probs, target_local, keep = _sampled_rows(flat[s : s + step],
                                                          flat_target[s : s + step], tp_group,
                                                          top_k, top_p)  # fmt: skip
            n = target_local.shape[0]
            grad_local = grad_output.flatten()[s : s + step][rank * n : (rank + 1) * n]
            grads.append(_sampled_grad(log_probs, target_local, keep, grad_local, tp_group))
        return torch.cat(grads).view(B, S, V_local), None, None, None, None, None, None


def _get_tokens_on_this_cp_rank(input_ids, cp_rank, cp_size, seq_dim=1):
    """NeMo-RL's load-balanced CP layout: rank r holds chunks r and 2 CP - 1 - r of 2 CP."""
    if cp_size == 1:
        return input_ids
    size = input_ids.shape[seq_dim] // (2 * cp_size)
    chunks = [
        input_ids.narrow(seq_dim, i * size, size) for i in (cp_rank, 2 * cp_size - cp_rank - 1)
    ]
    return torch.cat(chunks, dim=seq_dim)


def allgather_cp_sharded_tensor(tensor, cp_group, seq_dim=1):
    raise NotImplementedError("the stand-in does not reproduce NeMo-RL's CP all-gather")


def from_parallel_logits_to_logprobs(
    vocab_parallel_logits: torch.Tensor,
    target: torch.Tensor,
    vocab_start_index: int,
    vocab_end_index: int,
    tp_group,
    inference_only: bool = False,
    cp_group=None,
    chunk_size: int | None = None,
    sampling_params: TrainingSamplingParams | None = None,
) -> torch.Tensor:
    target = target.roll(shifts=-1, dims=-1)
    cp_size = 1 if cp_group is None else dist.get_world_size(cp_group)
    pad_len = vocab_parallel_logits.shape[1] * cp_size - target.shape[1]
    if pad_len > 0:
        target = torch.nn.functional.pad(target, (0, pad_len), value=0)
    target = _get_tokens_on_this_cp_rank(target, dist.get_rank(cp_group), cp_size, seq_dim=1)
    logits = vocab_parallel_logits
    if need_top_k_or_top_p_filtering(sampling_params):
        k, p = sampling_params.top_k, sampling_params.top_p
        if chunk_size is not None:
            out = ChunkedDistributedLogprobWithSampling.apply(
                logits, target, tp_group, k, p, chunk_size, inference_only
            )
        else:
            out = DistributedLogprobWithSampling.apply(logits, target, tp_group, k, p,
                                                       inference_only)  # fmt: skip
    elif chunk_size is not None:
        out = ChunkedDistributedLogprob.apply(logits, target, vocab_start_index, vocab_end_index,
                                              chunk_size, tp_group, inference_only)  # fmt: skip
    else:
        out = DistributedLogprob.apply(logits, target, vocab_start_index, vocab_end_index,
                                       tp_group, inference_only)  # fmt: skip
    out = out.contiguous()
    if cp_size > 1:
        out = allgather_cp_sharded_tensor(out, cp_group, seq_dim=1)
    if pad_len > 0:
        out = out[:, :-pad_len]
    return out[:, :-1]
