"""vllm_gather: vLLM's logprob path on vocab-parallel logits.

all_gather the vocabulary shards (vLLM pads the vocabulary to a multiple of 64), drop
the padding, fp32 log_softmax of the whole row, gather the target. Re-implemented here
from vLLM's published path unless vLLM imports, in which case vLLM's own
`Sampler.compute_logprobs` does the log_softmax. No float collective: every rank holds
the full row, so the result cannot depend on the TP degree.
"""

from __future__ import annotations

import torch

from .base import (
    Candidate,
    ShardContext,
    all_gather_cat,
    in_row_blocks,
    package_version,
    real_or_reimplementation,
    round_up,
)

VLLM_PAD_MULTIPLE = 64
ROW_BLOCK = 256  # full-vocabulary fp32 copies are made this many rows at a time
REAL_MODULE = "vllm.v1.sample.sampler"


def fp32_log_softmax(full_logits: torch.Tensor) -> torch.Tensor:
    return full_logits.to(torch.float32).log_softmax(dim=-1)


class VllmGather(Candidate):
    name = "vllm_gather"

    def __init__(self):
        sampler = real_or_reimplementation(
            self,
            REAL_MODULE,
            "Sampler",
            real="all_gather of the shards, then vLLM's Sampler.compute_logprobs (fp32 "
            "log_softmax of the full row), gather",
            reimplementation="re-implementation of vLLM's path: all_gather the vocabulary "
            "shards, fp32 log_softmax of the full row, gather the target",
        )
        self._log_softmax = (
            fp32_log_softmax
            if sampler is None
            else lambda x: sampler.compute_logprobs(x.to(torch.float32))
        )

    def padded_vocab(self, vocab_size: int, tp: int) -> int:
        padded = round_up(vocab_size, VLLM_PAD_MULTIPLE)
        if padded % tp:
            raise ValueError(f"vLLM shards {padded} columns evenly; tp={tp} does not divide it")
        return padded

    def describe(self) -> dict:
        details = {"row_block": ROW_BLOCK, "pad_multiple": VLLM_PAD_MULTIPLE}
        return {**super().describe(), "details": details}

    def third_party(self) -> list[dict]:
        if self.implementation != "real":
            return []
        return [{"name": "vllm", "version": package_version("vllm")}]

    def build(self, ctx: ShardContext):
        log_softmax = self._log_softmax

        def run(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            full = all_gather_cat(logits, ctx)[:, : ctx.vocab_size]  # (n, V)
            return log_softmax(full).gather(-1, target.unsqueeze(-1)).squeeze(-1)

        return in_row_blocks(run, ROW_BLOCK)
