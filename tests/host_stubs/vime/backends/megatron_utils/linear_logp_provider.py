"""Stand-in: vime/backends/megatron_utils/linear_logp_provider.py of
RL-Align/vime@33254c738f1d43250916ae6887f7981e77dbe411 (the `--linear-logp-provider`
boundary; the module is in no vime release and vime is not on the package index).

Written from that source: the request / result dataclasses with their `__post_init__`
checks, `compute_linear_logp(*, args, request, native)` -- the provider path from
`args.linear_logp_provider` ("package.module.callable", imported on every call), mode
`args.linear_logp_provider_mode` ("auto" or "strict"), native fallback in auto mode when
the provider does not import or raises an exception whose
`linear_logp_provider_unavailable` attribute is truthy, every other exception propagated --
and the result's normalisation (the dataclass, a Mapping or any object with the five
fields) and validation (logp exactly [T, 1] floating on the logits' device; entropy [T]
exactly when `with_entropy`, else None; strict: non-empty ids and autograd connected).
The log lines name the provider's identity and the native route as vime's do.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

logger = logging.getLogger(__name__)
_LOGGED_PROVIDER_IDENTITIES: set = set()
_LOGGED_NATIVE_IDENTITIES: set = set()
_NATIVE_CONTRACT_ID = "vime.native.linear_logp.v1"

TokenLayoutKind = Literal["single", "zigzag", "allgather"]


class LinearLogpProviderUnavailable(RuntimeError):
    linear_logp_provider_unavailable = True


@dataclass(frozen=True)
class TokenLayout:
    world_size: int
    rank: int
    layout: TokenLayoutKind

    def __post_init__(self):
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(
                f"invalid token topology: world_size={self.world_size}, rank={self.rank}"
            )
        if (self.world_size == 1) != (self.layout == "single"):
            raise ValueError("layout 'single' is for one rank exactly; use zigzag or allgather")


@dataclass(frozen=True)
class LinearProjection:
    weight: torch.Tensor  # [V_local, H]
    bias: torch.Tensor | None = None

    def __post_init__(self):
        if not isinstance(self.weight, torch.Tensor) or self.weight.ndim != 2:
            raise ValueError("linear_logp projection.weight must be a rank-2 tensor")
        if self.bias is None:
            return
        if not isinstance(self.bias, torch.Tensor):
            raise ValueError("linear_logp projection.bias must be a tensor")
        if self.bias.ndim != 1 or self.bias.size(0) != self.weight.size(0):
            raise ValueError("linear_logp projection.bias must match local vocabulary width")
        if self.bias.device != self.weight.device:
            raise ValueError("linear_logp projection tensors must share a device")


@dataclass(frozen=True)
class VocabPartition:
    local_start: int
    local_size: int
    real_size: int
    padded_size: int

    def __post_init__(self):
        if self.local_start < 0 or self.local_size <= 0:
            raise ValueError(
                "linear_logp vocabulary partition must have a non-empty non-negative local range"
            )
        if not 0 < self.real_size <= self.padded_size:
            raise ValueError("linear_logp vocabulary sizes are invalid")
        if self.local_start + self.local_size > self.padded_size:
            raise ValueError("linear_logp local vocabulary range exceeds padded vocabulary")


@dataclass(frozen=True)
class LinearLogpContext:
    hidden: torch.Tensor  # [T, H]
    projection: LinearProjection
    vocab_partition: VocabPartition

    def __post_init__(self):
        if not isinstance(self.hidden, torch.Tensor) or self.hidden.ndim != 2:
            raise ValueError("linear_logp context.hidden must be [T, hidden]")
        if self.hidden.size(1) != self.projection.weight.size(1):
            raise ValueError("linear_logp hidden width must match projection width")
        if self.projection.weight.size(0) != self.vocab_partition.local_size:
            raise ValueError("linear_logp projection width must match vocabulary partition")
        if self.hidden.device != self.projection.weight.device:
            raise ValueError("linear_logp context tensors must share a device")


@dataclass(frozen=True)
class LinearLogpRequest:
    logits: torch.Tensor  # [T, V_local], not temperature-scaled
    target_ids: torch.Tensor  # [T] global ids
    tensor_parallel_group: Any
    token_layout: TokenLayout
    with_entropy: bool
    with_entropy_grad: bool
    chunk_size: int
    log_prob_keep_mask: torch.Tensor | None = None
    context: LinearLogpContext | None = None
    temperature: float | torch.Tensor | None = None
    metadata: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        if not isinstance(self.logits, torch.Tensor) or self.logits.ndim != 2:
            raise ValueError(
                f"linear_logp logits must be [T, V_local], got {getattr(self.logits, 'shape', None)}"
            )
        rows, width = self.logits.shape
        if self.target_ids.shape != (rows,):
            raise ValueError(
                f"linear_logp target_ids must be [T] aligned with logits; got "
                f"{tuple(self.target_ids.shape)} for T={rows}"
            )
        if self.target_ids.device != self.logits.device:
            raise ValueError("linear_logp target_ids must share the logits device")
        if self.target_ids.is_floating_point() or self.target_ids.is_complex():
            raise TypeError("linear_logp target_ids must use an integer dtype")
        if (
            self.log_prob_keep_mask is not None
            and self.log_prob_keep_mask.shape != self.logits.shape
        ):
            raise ValueError("linear_logp log_prob_keep_mask must match logits shape")
        if self.context is not None:
            if self.context.hidden.size(0) != rows:
                raise ValueError("linear_logp context rows must match local logits rows")
            if self.context.projection.weight.size(0) != width:
                raise ValueError("linear_logp projection rows must match local logits width")
            if self.context.hidden.device != self.logits.device:
                raise ValueError("linear_logp context must share the logits device")
        self._check_temperature(rows)

    def _check_temperature(self, rows):
        tau = self.temperature
        if tau is None:
            return
        if isinstance(tau, torch.Tensor):
            if tau.numel() not in (1, rows):
                raise ValueError("linear_logp temperature must be scalar or [T]")
            if bool((tau <= 0).any().item()):
                raise ValueError("linear_logp temperature must be positive")
        elif float(tau) <= 0:
            raise ValueError("linear_logp temperature must be positive")


@dataclass(frozen=True)
class LinearLogpResult:
    logp: torch.Tensor
    entropy: torch.Tensor | None
    backend_id: str
    contract_id: str
    provenance: Mapping[str, Any] = field(default_factory=dict)


def linear_logp_provider_path(args):
    path = getattr(args, "linear_logp_provider", None)
    return (str(path).strip() or None) if path is not None else None


def linear_logp_provider_mode(args):
    raw = getattr(args, "linear_logp_provider_mode", "auto")
    mode = str(raw).strip().lower()
    if mode not in ("auto", "strict"):
        raise ValueError(f"linear_logp_provider_mode must be 'auto' or 'strict', got {raw!r}.")
    return mode


def compute_linear_logp(*, args, request: LinearLogpRequest, native: Callable):
    path = linear_logp_provider_path(args)
    if path is None:
        return _native(request, native, route="unconfigured")
    mode = linear_logp_provider_mode(args)
    try:
        provider = _load_provider(path)
    except (ImportError, AttributeError) as exc:
        return _unavailable(request, native, path, mode, exc)
    try:
        result = provider(request)
    except Exception as exc:
        if not getattr(exc, "linear_logp_provider_unavailable", False):
            raise  # provider bugs are never hidden by a fallback
        return _unavailable(request, native, path, mode, exc)
    result = _normalize_result(result)
    _validate_result(result, request, strict=mode == "strict")
    identity = (result.backend_id, result.contract_id)
    if identity not in _LOGGED_PROVIDER_IDENTITIES:
        _LOGGED_PROVIDER_IDENTITIES.add(identity)
        logger.info(
            "linear_logp provider active: backend_id=%s contract_id=%s provenance=%s",
            result.backend_id,
            result.contract_id,
            dict(result.provenance),
        )
    return result.logp, result.entropy


def _unavailable(request, native, path, mode, exc):
    if mode == "strict":
        raise RuntimeError(f"linear_logp provider {path!r} is unavailable: {exc}") from exc
    logger.warning("linear_logp provider %s is unavailable; using native path: %s", path, exc)
    return _native(request, native, route="provider_unavailable_fallback")


def _load_provider(path):
    module_path, dot, attribute = path.rpartition(".")
    if not (dot and module_path and attribute):
        raise ImportError("provider must use the import path 'package.module.callable'")
    provider = getattr(importlib.import_module(module_path), attribute)
    if not callable(provider):
        raise TypeError(f"linear_logp provider {path!r} is not callable")
    return provider


def _native(request, native, *, route):
    result = native(
        request.logits,
        request.target_ids,
        request.tensor_parallel_group,
        with_entropy=request.with_entropy,
        with_entropy_grad=request.with_entropy_grad,
        chunk_size=request.chunk_size,
        log_prob_keep_mask=request.log_prob_keep_mask,
    )
    module = getattr(native, "__module__", type(native).__module__)
    qualname = getattr(native, "__qualname__", type(native).__qualname__)
    identity = (f"{module}.{qualname}", route, request.logits.device.type)
    if identity not in _LOGGED_NATIVE_IDENTITIES:
        _LOGGED_NATIVE_IDENTITIES.add(identity)
        logger.info(
            "linear_logp native active: backend_id=%s contract_id=%s route=%s device=%s",
            identity[0],
            _NATIVE_CONTRACT_ID,
            route,
            identity[2],
        )
    return result


def _normalize_result(result):
    if isinstance(result, LinearLogpResult):
        return result
    get = (
        result.__getitem__ if isinstance(result, Mapping) else (lambda name: getattr(result, name))
    )
    try:
        fields = {
            name: get(name)
            for name in ("provenance", "logp", "entropy", "backend_id", "contract_id")
        }
    except (AttributeError, KeyError) as exc:
        raise TypeError(
            "linear_logp providers must return logp, entropy, backend_id, "
            "contract_id, and provenance"
        ) from exc
    if not isinstance(fields["provenance"], Mapping):
        raise TypeError("linear_logp provider provenance must be a mapping")
    return LinearLogpResult(**fields)


def _validate_result(result, request, *, strict):
    rows, device = request.logits.size(0), request.logits.device
    if result.logp.shape != (rows, 1):
        raise ValueError(
            f"linear_logp provider returned invalid logp shape "
            f"{tuple(result.logp.shape)}; expected {(rows, 1)}."
        )
    if result.logp.device != device:
        raise ValueError("linear_logp provider returned logp on a different device")
    if not result.logp.is_floating_point():
        raise TypeError("linear_logp provider must return floating-point logp")
    if request.with_entropy:
        if result.entropy is None or result.entropy.shape != (rows,):
            raise ValueError("linear_logp provider must return [T] entropy when with_entropy=True")
        if result.entropy.device != device:
            raise ValueError("linear_logp provider returned entropy on a different device")
        if not result.entropy.is_floating_point():
            raise TypeError("linear_logp provider must return floating-point entropy")
    elif result.entropy is not None:
        raise ValueError("linear_logp provider returned entropy when with_entropy=False")
    if not strict:
        return
    if not result.backend_id or not result.contract_id:
        raise ValueError("strict linear_logp runs require non-empty backend_id and contract_id")
    if request.logits.requires_grad and not result.logp.requires_grad:
        raise ValueError("strict linear_logp result is detached from autograd")
    if (
        request.with_entropy_grad
        and result.entropy is not None
        and not result.entropy.requires_grad
    ):
        raise ValueError("strict linear_logp entropy is detached from autograd")
