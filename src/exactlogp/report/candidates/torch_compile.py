"""torch_compile: fp32 target logit minus logsumexp, compiled by torch.compile (TP1 only).

The fastest plain-PyTorch pipeline a trainer would write: logprob = x[target] -
logsumexp(x) in fp32, which Inductor fuses into one pass over each row. It is compiled
for the shape at hand (dynamic=False): the warm-up run pays the compile, timed runs do
not. `teardown` forgets the compiled graphs, so the next shape compiles afresh instead
of running into torch.compile's recompile limit.
"""

from __future__ import annotations

import torch

from .base import Candidate, ShardContext


def fp32_logprobs(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    x = logits.float()  # (N, V)
    return x.gather(-1, target.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(x, dim=-1)


class TorchCompile(Candidate):
    name = "torch_compile"
    summary = (
        "torch.compile(x.float().gather(-1, target) - torch.logsumexp(x.float(), -1)) "
        "on the whole row, one device"
    )
    implementation = "real"
    tp1_only = True
    supports_backward = True

    def build(self, ctx: ShardContext):
        if ctx.tp != 1:
            raise ValueError(f"torch_compile runs at tp=1 only, got tp={ctx.tp}")
        vocab = ctx.vocab_size
        compiled = torch.compile(fp32_logprobs, dynamic=False)
        return lambda logits, target: compiled(logits[:, :vocab], target)

    def teardown(self) -> None:
        torch._dynamo.reset()
