"""verl_fused: a re-implementation of verl's fused LM head, `linear_cross_entropy`
(verl 0.9.1, verl/utils/kernel/kernels.py: efficient_entropy_forward), in torch ops.

verl's kernel is Triton and runs on CUDA only; here its algorithm runs step for step
(hidden-state workload). Per rank, on its `V_local` rows of the LM-head weight:

  1. for each block of BLOCK_M token rows (zero-padded) and each split of
     VOCAB_PER_SPLIT local weight rows, for each tile of TILE weight rows in it:
       z = hidden @ W_tile^T                 fp32 accumulation of the bf16 products
       z = z * fp32(1 / temperature)         a reciprocal multiply, not a division
       m_new = max(m, rowmax(z)); c = exp(m - m_new)
       a = c a + sum exp(z - m_new);  b = b c + sum z exp(z - m_new)
       the target logit, from the tile that holds it
     (m, a, b) of each split kept: (N, splits) each
  2. TP = 1: the splits merged MERGE at a time, from a running max that starts at 0
     TP > 1: all_reduce(MAX) of the (N, splits) maxima; all_reduce(SUM) of the target
     logit (0 on the ranks without it); each rank merges its splits to the global
     maxima as in TP = 1; then one float all_reduce(SUM) of [a; b] (2, N) -- the
     order-dependent sum over ranks
  3. logprob = -((max + log a) - z_target);  entropy = (log a + max) - b / a

verl takes every weight row as a token (there is no vocab_size argument): the
vocabulary must split evenly over the TP ranks, with no padding rows. The kernel's
in-tile sums and its GEMM's accumulation order are the GPU's; here they are torch's on
this device, so bits need not match the real kernel's, but every stage above -- and every
float collective -- is the same. Rows are zero-padded to blocks of BLOCK_M as the
kernel's programs pad them, so every GEMM here has one shape whatever the batch.
"""

from __future__ import annotations

import torch

from ..workload import TEMPERATURE
from .base import Candidate, ShardContext

VOCAB_PER_SPLIT = 1024  # vocab_per_split in efficient_entropy_forward
BLOCK_M = 128  # BLOCK_SIZE_M of the forward main loop: rows per program
TILE = 256  # BLOCK_SIZE_N of the forward main loop
MERGE = 64  # BLOCK_SIZE_N of the epilogues: splits merged per step
HIDDEN_MULTIPLE = 128  # efficient_entropy_forward asserts hidden_size % 128 == 0


def split_stats(hidden, weight, local_target, temperature: float):
    """Stage 1: ((N, S) maxima, (N, S) sum-exp, (N, S) sum z exp(z - m), (N,) target
    logit or 0) of this rank's splits; local_target is the target's local row (any value
    where this rank does not hold it). Rows go in blocks of BLOCK_M, as the kernel's
    programs take them."""
    blocks = [
        _block_stats(hidden[r : r + BLOCK_M], weight, local_target[r : r + BLOCK_M], temperature)
        for r in range(0, hidden.shape[0], BLOCK_M)
    ]
    return tuple(torch.cat(parts) for parts in zip(*blocks, strict=True))


def _block_stats(hidden, weight, local_target, temperature: float):
    """split_stats of at most BLOCK_M rows, zero-padded to BLOCK_M as the kernel's masked
    loads pad them: every GEMM has the same shape whatever the batch (on the GPU, a
    program's tile shape is fixed too)."""
    rows, width, dev = hidden.shape[0], weight.shape[0], hidden.device
    h = torch.zeros(BLOCK_M, hidden.shape[1], dtype=torch.float32, device=dev)
    h[:rows] = hidden
    rcp = torch.tensor(1.0 / temperature, dtype=torch.float32, device=dev)
    starts = range(0, width, VOCAB_PER_SPLIT)
    maxima, accu, entropy_b = (
        torch.empty(BLOCK_M, len(starts), dtype=torch.float32, device=dev) for _ in range(3)
    )
    label = torch.full((BLOCK_M,), -1, dtype=torch.int64, device=dev)
    label[:rows] = local_target
    target_logit = torch.zeros(BLOCK_M, dtype=torch.float32, device=dev)
    for s, lo in enumerate(starts):
        hi = min(lo + VOCAB_PER_SPLIT, width)
        m = torch.full((BLOCK_M,), float("-inf"), dtype=torch.float32, device=dev)
        a, b, t = (torch.zeros_like(target_logit) for _ in range(3))
        for t0 in range(lo, hi, TILE):
            t1 = min(t0 + TILE, hi)
            z = (h @ weight[t0:t1].to(torch.float32).T) * rcp  # (BLOCK_M, tile)
            m_old, m = m, torch.maximum(m, z.amax(-1))
            e = torch.exp(z - m.unsqueeze(-1))
            coeff = torch.exp(m_old - m)
            a = coeff * a + e.sum(-1)
            b = b * coeff + (z * e).sum(-1)
            cols = torch.arange(t0, t1, device=dev)
            t = t + (z * (cols == label.unsqueeze(-1))).sum(-1)
        maxima[:, s], accu[:, s], entropy_b[:, s] = m, a, b
        target_logit = torch.where((label >= lo) & (label < hi), t, target_logit)
    return maxima[:rows], accu[:rows], entropy_b[:rows], target_logit[:rows]


def merge_splits(maxima, scale_maxima, accu, entropy_b):
    """Stage 2's epilogue: ((N,) max, (N,) sum-exp, (N,) sum z exp(z - max)) over the
    splits, MERGE at a time, from a max of 0. `maxima` give the max (the all-reduced ones
    under TP), `scale_maxima` the split's own max its sums were taken at."""
    n = maxima.shape[0]
    gmax, ga, gb = (torch.zeros(n, dtype=torch.float32, device=maxima.device) for _ in range(3))
    for c in range(0, maxima.shape[1], MERGE):
        cols = slice(c, c + MERGE)
        m_old, gmax = gmax, torch.maximum(gmax, maxima[:, cols].amax(-1))
        coeff = torch.exp(m_old - gmax)
        scale = torch.exp(scale_maxima[:, cols] - gmax.unsqueeze(-1))
        ga = coeff * ga + (scale * accu[:, cols]).sum(-1)
        gb = coeff * gb + (scale * entropy_b[:, cols]).sum(-1)
    return gmax, ga, gb


def verl_linear_cross_entropy(hidden, weight, target, temperature: float, ctx: ShardContext):
    """(logprobs (N,), entropy (N,)) fp32, as verl's linear_cross_entropy(hidden, weight,
    target, temperature, "none", tp_group if TP > 1 else None) computes them."""
    import torch.distributed as dist

    maxima, accu, entropy_b, target_logit = split_stats(
        hidden, weight, target - ctx.vocab_start, temperature
    )
    if ctx.tp == 1:
        gmax, ga, gb = merge_splits(maxima, maxima, accu, entropy_b)
    else:
        own = maxima.clone()
        dist.all_reduce(maxima, op=dist.ReduceOp.MAX, group=ctx.group)
        dist.all_reduce(target_logit, op=dist.ReduceOp.SUM, group=ctx.group)
        gmax, ga, gb = merge_splits(maxima, own, accu, entropy_b)
        sums = torch.stack((ga, gb))  # (2, N): verl's accumulate_and_entropy_b buffer
        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=ctx.group)
        ga, gb = sums[0], sums[1]
    log_a = torch.log(ga)
    entropy = (log_a + gmax) - gb / ga
    logprobs = -((gmax + log_a) - target_logit)
    return logprobs, entropy


class VerlFused(Candidate):
    name = "verl_fused"
    summary = (
        "re-implementation of verl 0.9.1's linear_cross_entropy: fp32-accumulated GEMM per "
        f"{TILE}-row tile of the head, logits * fp32(1/T), online softmax per "
        f"{VOCAB_PER_SPLIT}-row split; TP: all_reduce(MAX) of the split maxima, float "
        "all_reduce(SUM) of the target logit and of [sum-exp; sum z exp]"
    )
    implementation = "re-implementation"
    note = "verl's kernel is Triton on CUDA only; its algorithm runs here in torch ops"
    kind = "hidden_states"

    def padded_vocab(self, vocab_size: int, tp: int) -> int:
        if vocab_size % tp:
            raise ValueError(
                f"verl's linear_cross_entropy takes every weight row as a token: the "
                f"vocabulary {vocab_size} must split evenly over tp={tp}, with no padding"
            )
        return vocab_size

    def build(self, ctx: ShardContext):
        weight = ctx.weight
        if weight.shape[1] % HIDDEN_MULTIPLE:
            raise ValueError(
                f"verl's kernel asserts hidden_size % {HIDDEN_MULTIPLE} == 0, got {weight.shape[1]}"
            )
        return lambda hidden, target: verl_linear_cross_entropy(
            hidden, weight, target, TEMPERATURE, ctx
        )
