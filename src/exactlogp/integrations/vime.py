"""vime's linear-logp provider: exactlogp scores the token rows of vime's Megatron backend.

    --linear-logp-provider exactlogp.integrations.vime.provider --linear-logp-provider-mode strict

vime (RL-Align/vime, `vime.backends.megatron_utils.linear_logp_provider`, commit 33254c7)
calls the callable named by `--linear-logp-provider` with one `LinearLogpRequest` per
micro-batch and takes `logp` [T, 1] and `entropy` [T] (or None) from its result. `provider`
imports nothing of vime and patches nothing: it reads the request's fields by name and
returns a `LinearLogpResult` with vime's five fields, which vime validates.

Two routes; `provenance["route"]` says which ran:
- "logits": `exactlogp.selected_logprobs` on `request.logits` [T, V_local]; `contract_id`
  is `exactlogp.CONTRACT`.
- "fused": when `request.context` is given (hidden [T, H], the LM-head shard [V_local, H],
  its bias, the vocabulary partition), `exactlogp.linear_selected_logprobs` computes the
  exact logits from the hidden states in row blocks, without [T, V] logits; the request's
  logits are not read. `contract_id` is the handshake fingerprint
  (`exactlogp.CONTRACT` + `exactlogp.LOGITS_CONTRACT`). `context.hidden` must be the same
  on every TP rank, from before Megatron's copy-to-tensor-parallel region (the hidden
  gradient is summed over the vocabulary shards here). The exact head takes no keep mask,
  and pre-scaled logits leave its temperature unknown: such requests take the logits route
  (with the context's partition), and `provenance["fused_declined"]` says why.

Semantics are those of vime's native path (slime's `calculate_log_probs_and_entropy`,
`exactlogp.integrations.slime`): `log_prob_keep_mask` (bool [T, V_local]) narrows the
log-prob's normaliser to the kept columns plus the target's; the entropy is the unmasked
distribution's; `with_entropy_grad=False` detaches it. Autograd stays connected (vime's
strict mode checks it): gradients reach the logits, or the hidden states, weight and bias.

- Temperature: `request.temperature` (None = 1; a float, or a tensor of 1 or T values)
  divides fp32 logits by IEEE division, unless `metadata["logits_are_temperature_scaled"]`
  is truthy. vime's native path divides the logits in their own dtype (other bits for
  bf16 logits).
- Vocabulary: `context.vocab_partition` (`local_start`, `real_size`) where a context is
  given; else Megatron's even split (rank * V_local) with `metadata["real_vocab_size"]`
  as the real vocabulary -- padding columns are left out (vime's native path counts them)
  -- and `metadata["padded_vocab_size"]`, where given, checked to be V_local * TP size.
- `tensor_parallel_group` is the only group reduced over (None: as slime reads it).
- `chunk_size` is accepted and ignored: vime chunks rows to bound fp32 [T, V_local] copies,
  and exactlogp keeps none (it reads the shard in row blocks and recomputes in backward).

Bad requests raise ValueError / TypeError naming the field (vime propagates them in both
modes: a provider error is never hidden by its native fallback).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import __version__
from ..backends import get_backend
from ..contract import CONTRACT
from ..distributed import resolve
from ..linear import linear_selected_logprobs
from . import _rows, handshake
from .slime import logprobs_and_entropy, slime_group

BACKEND_PREFIX = "exactlogp."  # backend_id = "exactlogp.<backend name>", e.g. exactlogp.cpu
SCALED_KEY = "logits_are_temperature_scaled"


@dataclass(frozen=True)
class LinearLogpResult:
    """vime's result fields: logp [T, 1] fp32, entropy [T] fp32 or None, identity."""

    logp: torch.Tensor
    entropy: torch.Tensor | None
    backend_id: str
    contract_id: str
    provenance: Mapping[str, Any] = field(default_factory=dict)


def provider(request) -> LinearLogpResult:
    """vime's `--linear-logp-provider` entry point (see the module docstring)."""
    logits = _rows.check_tensor("request.logits", request.logits)
    if logits.dim() != 2:
        raise ValueError(f"request.logits must be [T, V_local], got shape {tuple(logits.shape)}")
    group = slime_group(request.tensor_parallel_group)
    tp = resolve(group)
    vocab_start, vocab_size = _vocab_range(request, tp.rank, tp.size)
    route, declined = _route(request)
    if route == "fused":
        logp, entropy = _fused(request, group, vocab_start, vocab_size)
        contract_id = handshake.contract_fingerprint()
    else:
        logp, entropy = logprobs_and_entropy(
            logits, request.target_ids, group, keep_mask=request.log_prob_keep_mask,
            with_entropy=request.with_entropy, with_entropy_grad=request.with_entropy_grad,
            temperature=_temperature(request, scaled_ok=True), vocab_start=vocab_start,
            vocab_size=vocab_size,
        )  # fmt: skip
        contract_id = CONTRACT
    backend = get_backend("auto", logits.device).name
    provenance = {
        "exactlogp_version": __version__, "route": route, "tp_size": tp.size,
        "vocab_start": vocab_start, "vocab_size": vocab_size, "backend": backend,
        "keep_mask": request.log_prob_keep_mask is not None, "chunk_size": "ignored",
    }  # fmt: skip
    if declined:
        provenance["fused_declined"] = declined
    return LinearLogpResult(logp.unsqueeze(-1), entropy, BACKEND_PREFIX + backend, contract_id,
                            provenance)  # fmt: skip


def _route(request) -> tuple[str, str | None]:
    """("fused" or "logits", why a request with a context takes the logits route)."""
    if request.context is None:
        return "logits", None
    if request.log_prob_keep_mask is not None:
        return "logits", "log_prob_keep_mask: the exact LM head takes no keep mask"
    if _scaled(request):
        return "logits", f"metadata[{SCALED_KEY!r}]: the logits carry a temperature"
    return "fused", None


def _fused(request, group, vocab_start: int, vocab_size: int):
    context = request.context
    projection = context.projection
    res = linear_selected_logprobs(
        context.hidden, projection.weight, request.target_ids, bias=projection.bias,
        tp_group=group, vocab_start=vocab_start, vocab_size=vocab_size,
        temperature=_temperature(request, scaled_ok=False), with_entropy=request.with_entropy,
    )  # fmt: skip
    entropy = res.entropy
    if entropy is not None and not request.with_entropy_grad:
        entropy = entropy.detach()
    return res.logprobs, entropy


def _scaled(request) -> bool:
    metadata = request.metadata or {}
    return bool(metadata.get(SCALED_KEY, False))


def _temperature(request, *, scaled_ok: bool) -> float | torch.Tensor:
    """exactlogp's temperature: a float, or an fp32 tensor of shape () or [T]."""
    tau = request.temperature
    if tau is None or (scaled_ok and _scaled(request)):
        return 1.0
    if not isinstance(tau, torch.Tensor):
        return _rows.check_positive_temperature(tau)
    rows = request.target_ids.numel()
    if tau.numel() not in (1, rows):
        raise ValueError(
            f"request.temperature must hold 1 or T = {rows} values, got shape {tuple(tau.shape)}"
        )
    tau = tau.to(device=request.target_ids.device, dtype=torch.float32)
    return tau.reshape(()) if tau.numel() == 1 else tau.reshape(rows)


def _vocab_range(request, rank: int, size: int) -> tuple[int, int | None]:
    """(vocab_start, vocab_size) of this shard: the context's partition, else Megatron's
    even split with the metadata's sizes."""
    width = request.logits.shape[1]
    if request.context is not None:
        part = request.context.vocab_partition
        if part.local_size != width:
            raise ValueError(
                f"request.context.vocab_partition.local_size = {part.local_size} but the "
                f"logits hold {width} columns"
            )
        return int(part.local_start), _rows.check_vocab_size(int(part.real_size))
    metadata = request.metadata or {}
    padded = metadata.get("padded_vocab_size")
    if padded is not None and padded != width * size:
        raise ValueError(
            f"request.metadata['padded_vocab_size'] = {padded!r}, but Megatron's even split "
            f"of {width} columns on each of {size} TP ranks is {width * size}: the shards' "
            "vocabulary ranges are unknown; pass a context with its vocab_partition"
        )
    return rank * width, _rows.check_vocab_size(metadata.get("real_vocab_size"))
