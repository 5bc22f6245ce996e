"""The shared workloads: seeded inputs, their targets and their fp64 truth.

"logits" (candidate kind "logits"): LLM-like logits from `exactlogp.testing.llm_like_logits`,
a Gaussian bulk (std 2.5) plus a few dominant logits 8..30 above it in every row,
rounded to the report's dtype; targets are drawn from softmax(logits) as an RL rollout
draws them, so many are near-certain tokens with logprob close to 0.

"hidden_states" (fused LM-head candidates): hidden states (N, H) and an LM-head weight
(V, H) from `exactlogp.testing.lm_head_inputs` (RMS-normed rows with a few large channels,
a third of them confident, some flat; targets sampled from the fp64 softmax), in the
report's dtype. Its truth is the fp64 GEMM of those same rounded inputs followed by an
fp64 log-softmax accurate near logprob = 0.

Each is generated once and written to one file; every candidate's ranks cut their own
shard from it (columns of the logits, rows of the weight), so every candidate sees the
same bits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..testing import (
    fp64_reference,
    fp64_softmax_reference,
    llm_like_logits,
    lm_head_inputs,
    sha256,
)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# The sampling temperature of both workloads (their truth is at 1); a fused LM-head
# candidate whose host passes one to its kernel passes this.
TEMPERATURE = 1.0
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


@dataclass(frozen=True)
class HiddenWorkload:
    tokens: int
    hidden: int  # H
    vocab: int
    dtype: str
    seed: int = 0
    outlier: float = 0.0  # > 0: two channels this many times the rest; 0: H // 64 at 8x

    def describe(self) -> dict:
        channels = (
            "H // 64 channels 8x the rest" if not self.outlier
            else f"two channels {self.outlier:g}x the rest"
        )  # fmt: skip
        return {
            "generator": "exactlogp.testing.lm_head_inputs",
            "seed": self.seed,
            "distribution": (
                f"hidden states ({self.tokens}, {self.hidden}): RMS-normed rows times a norm "
                f"weight around 1 with {channels}, a third of them confident (their "
                "top logit far above the rest), some flat; LM-head weight "
                f"({self.vocab}, {self.hidden}) Gaussian, logits std ~3; both rounded to "
                f"{self.dtype}; targets sampled from the fp64 softmax of their logits"
            ),
        }


@dataclass(frozen=True)
class Saved:
    """A workload written for the worlds: its file, vocabulary and the rows to check."""

    kind: str  # "logits" or "hidden_states" (the candidate kind it is for)
    path: str
    vocab: int
    check_rows: tuple[int, ...]
    extra_rows: tuple[int, ...]


def generate(workload: Workload) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits (tokens, vocab) in the workload dtype, target (tokens,) int64), on CPU."""
    return llm_like_logits(
        workload.tokens, workload.vocab, dtype=DTYPES[workload.dtype], seed=workload.seed
    )


def generate_hidden(
    workload: HiddenWorkload,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(hidden (tokens, H), weight (vocab, H), both in the workload dtype, target (tokens,))."""
    more = {}
    if workload.outlier:
        more = dict(outlier=float(workload.outlier), outlier_channels=2)
    return lm_head_inputs(
        workload.tokens,
        workload.hidden,
        workload.vocab,
        dtype=DTYPES[workload.dtype],
        seed=workload.seed,
        **more,
    )


def save(path: str, **tensors: torch.Tensor) -> None:
    torch.save({k: t.contiguous() for k, t in tensors.items()}, path)


def load_shard(path: str, lo: int, width: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Columns [lo, lo + width) of the saved logits, -inf beyond the real vocabulary."""
    data = torch.load(path, mmap=True, weights_only=True)
    return cut_shard(data["logits"], lo, width, vocab), data["target"].clone()


def load_hidden_shard(
    path: str, lo: int, width: int, vocab: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(hidden (N, H), weight rows [lo, lo + width), target (N,)) of the saved
    hidden-state workload."""
    data = torch.load(path, mmap=True, weights_only=True)
    return (
        data["hidden"].clone(),
        cut_rows(data["weight"], lo, width, vocab),
        data["target"].clone(),
    )


def cut_rows(weight: torch.Tensor, lo: int, width: int, vocab: int) -> torch.Tensor:
    """(width, H): rows [lo, lo + width) of the (vocab, H) LM-head weight, zero rows beyond
    the real vocabulary (a fresh tensor on the weight's device)."""
    rows = torch.zeros(width, weight.shape[1], dtype=weight.dtype, device=weight.device)
    real_hi = min(lo + width, vocab)
    if real_hi > lo:
        rows[: real_hi - lo] = weight[lo:real_hi]
    return rows


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


def reference_hidden_logprobs(
    hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor
) -> torch.Tensor:
    """(N,) fp64 ground truth of the LM head: the fp64 GEMM of the (rounded) inputs, then
    the fp64 log-softmax of testing.fp64_softmax_reference, by blocks of rows. (A product
    of two bf16/fp16 values is exact in fp64 and H such products add with relative error
    ~H 2^-53: far below any fp32 result's rounding.)"""
    w = weight.to(torch.float64)
    out = [
        fp64_softmax_reference(
            hidden[i : i + REFERENCE_BLOCK_ROWS].to(torch.float64) @ w.T,
            target[i : i + REFERENCE_BLOCK_ROWS],
        ).logprobs
        for i in range(0, hidden.shape[0], REFERENCE_BLOCK_ROWS)
    ]
    return torch.cat(out)


def summary(reference: torch.Tensor, **tensors: torch.Tensor) -> dict:
    """Facts about the generated data that the report prints with it: the SHA-256 of each
    input ("<name>_sha256") and how the targets' true logprobs are spread."""
    return {
        **{f"{name}_sha256": sha256(t) for name, t in tensors.items()},
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
