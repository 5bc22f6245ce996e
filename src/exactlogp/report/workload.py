"""The shared workload: one seeded set of LLM-like logits, its targets and its fp64 truth.

Logits come from `exactlogp.testing.llm_like_logits`: a Gaussian bulk (std 2.5) plus a
few dominant logits 8..30 above it in every row, rounded to the report's dtype; targets
are drawn from softmax(logits) as an RL rollout draws them, so many are near-certain
tokens with logprob close to 0. They are generated once, written to one file, and every
candidate's ranks cut their own shards from it, so every candidate sees the same bits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..testing import fp64_reference, llm_like_logits, sha256

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
REFERENCE_BLOCK_ROWS = 32  # fp64 (rows, V) temporaries, a few hundred MiB at V = 151936


@dataclass(frozen=True)
class Workload:
    tokens: int
    vocab: int
    dtype: str
    seed: int = 0

    def describe(self) -> dict:
        return {
            "generator": "exactlogp.testing.llm_like_logits",
            "seed": self.seed,
            "distribution": (
                "Gaussian bulk (std 2.5) plus 4 dominant logits 8..30 above it per row, "
                f"rounded to {self.dtype}; targets sampled from softmax(logits) as an RL "
                "rollout samples them"
            ),
        }


def generate(workload: Workload) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits (tokens, vocab) in the workload dtype, target (tokens,) int64), on CPU."""
    return llm_like_logits(
        workload.tokens, workload.vocab, dtype=DTYPES[workload.dtype], seed=workload.seed
    )


def save(path: str, logits: torch.Tensor, target: torch.Tensor) -> None:
    torch.save({"logits": logits.contiguous(), "target": target.contiguous()}, path)


def load_shard(path: str, lo: int, width: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Columns [lo, lo + width) of the saved logits, -inf beyond the real vocabulary."""
    data = torch.load(path, mmap=True, weights_only=True)
    return cut_shard(data["logits"], lo, width, vocab), data["target"].clone()


def cut_shard(logits: torch.Tensor, lo: int, width: int, vocab: int) -> torch.Tensor:
    """(N, width): columns [lo, lo + width) of the full (N, vocab) logits, -inf padding
    beyond the real vocabulary (a fresh tensor on the logits' device)."""
    shard = torch.full(
        (logits.shape[0], width), float("-inf"), dtype=logits.dtype, device=logits.device
    )
    real_hi = min(lo + width, vocab)
    if real_hi > lo:
        shard[:, : real_hi - lo] = logits[:, lo:real_hi]
    return shard


def reference_logprobs(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """(N,) fp64 ground truth, accurate near logprob = 0 (testing.fp64_reference), by blocks."""
    out = [
        fp64_reference(
            logits[i : i + REFERENCE_BLOCK_ROWS], target[i : i + REFERENCE_BLOCK_ROWS]
        ).logprobs
        for i in range(0, logits.shape[0], REFERENCE_BLOCK_ROWS)
    ]
    return torch.cat(out)


def summary(logits: torch.Tensor, target: torch.Tensor, reference: torch.Tensor) -> dict:
    """Facts about the generated data that the report prints with it."""
    return {
        "logits_sha256": sha256(logits),
        "target_sha256": sha256(target),
        "targets_with_logprob_above_minus_1e-3": float((reference > -1e-3).double().mean()),
        "targets_with_logprob_above_minus_1e-6": float((reference > -1e-6).double().mean()),
        "median_target_logprob": float(reference.median()),
    }


def check_rows(tokens: int, count: int, seed: int) -> tuple[list[int], list[int]]:
    """(rows the batch and setting checks use, other rows to mix them with), seeded."""
    gen = torch.Generator().manual_seed(seed + 1)
    perm = torch.randperm(tokens, generator=gen).tolist()
    count = min(count, tokens)
    rows = sorted(perm[:count])
    extra = perm[count : 2 * count]
    return rows, extra
