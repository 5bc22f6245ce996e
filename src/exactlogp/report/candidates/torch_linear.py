"""torch_linear: the common LM-head pipeline on one device (hidden-state workload, TP1).

    logits = hidden @ weight.T                 # the inputs' dtype: a bf16 GEMM (fp32
                                               # accumulation) rounds every logit to bf16
    logprobs = log_softmax(fp32(logits)).gather(target)

What a bf16 model's forward and an fp32 log-softmax compute in eager PyTorch. The
rounding of the logits to bf16 (a relative error up to 2^-9) dominates its error.
"""

from __future__ import annotations

import torch

from .base import Candidate, ShardContext


class TorchLinear(Candidate):
    name = "torch_linear"
    summary = (
        "logits = hidden @ weight.T in the inputs' dtype, then "
        "torch.log_softmax(fp32(logits), -1).gather(target), one device"
    )
    implementation = "real"
    kind = "hidden_states"
    tp1_only = True

    def build(self, ctx: ShardContext):
        if ctx.tp != 1:
            raise ValueError(f"torch_linear runs at tp=1 only, got tp={ctx.tp}")
        weight = ctx.weight[: ctx.vocab_size]

        def run(hidden: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            logits = hidden @ weight.T  # (N, V)
            lp = torch.log_softmax(logits.to(torch.float32), dim=-1)
            return lp.gather(-1, target.unsqueeze(-1)).squeeze(-1)

        return run
