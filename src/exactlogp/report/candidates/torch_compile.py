"""torch_compile: fp32 target logit minus logsumexp, compiled by torch.compile (TP1 only).

The fastest plain-PyTorch pipeline a trainer would write: logprob = x[target] -
logsumexp(x) in fp32, which Inductor fuses into one pass over each row. It is compiled
for the shape at hand (dynamic=False): the warm-up run pays the compile, timed runs do
not. `teardown` forgets the compiled graphs, so the next shape compiles afresh instead
of running into torch.compile's recompile limit.
"""

from __future__ import annotations

import torch

from .base import Candidate, ShardContext, scaled_fp32, temperature_param


def fp32_logprobs(
    logits: torch.Tensor, target: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    x = scaled_fp32(logits, temperature)  # (N, V)
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

    def __init__(self, temperature: float = 1.0):
        self.temperature = temperature
        if temperature != 1.0:
            self.name = f"torch_compile[temperature={temperature:g}]"

    @classmethod
    def from_params(cls, params: tuple[str, ...]) -> TorchCompile:
        temperatures = [temperature_param(p) for p in params]
        if None in temperatures or len(params) > 1:
            raise ValueError(
                f"candidate 'torch_compile' takes no parameters but temperature=T, got {list(params)}"
            )
        return cls(*temperatures)

    def build(self, ctx: ShardContext):
        if ctx.tp != 1:
            raise ValueError(f"torch_compile runs at tp=1 only, got tp={ctx.tp}")
        vocab, temperature = ctx.vocab_size, self.temperature
        compiled = torch.compile(fp32_logprobs, dynamic=False)
        return lambda logits, target: compiled(logits[:, :vocab], target, temperature)

    def teardown(self) -> None:
        torch._dynamo.reset()
