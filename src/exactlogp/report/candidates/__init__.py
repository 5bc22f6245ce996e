"""The candidates, registered by name. Each module says exactly what it runs.

`create(name)` builds one by report name: a registered name, "exactlogp[BACKEND]" for
exactlogp pinned to one backend, or "package.module:Class" for a candidate defined
elsewhere (a Candidate subclass taking no arguments).
"""

from __future__ import annotations

import importlib

import torch

from ... import backends
from .base import Candidate, ShardContext, Unavailable

REGISTRY: dict[str, str] = {
    "exactlogp": "exactlogp.report.candidates.exactlogp:ExactlogpCandidate",
    "megatron_ce": "exactlogp.report.candidates.megatron_ce:MegatronCE",
    "megatron_fused_ce": "exactlogp.report.candidates.megatron_fused_ce:MegatronFusedCE",
    "vime_default": "exactlogp.report.candidates.vime_default:VimeDefault",
    "vllm_gather": "exactlogp.report.candidates.vllm_gather:VllmGather",
    "rl_kernel_ws2": "exactlogp.report.candidates.rl_kernel_ws2:RLKernelWS2",
    "miles_fused": "exactlogp.report.candidates.miles_fused:MilesFused",
    "verl_fused": "exactlogp.report.candidates.verl_fused:VerlFused",
    "torch_full": "exactlogp.report.candidates.torch_full:TorchFull",
}


def names() -> tuple[str, ...]:
    return tuple(REGISTRY)


def create(name: str) -> Candidate:
    if name.startswith("exactlogp[") and name.endswith("]"):
        from .exactlogp import ExactlogpCandidate

        return ExactlogpCandidate(backend=name[len("exactlogp[") : -1])
    spec = REGISTRY.get(name, name)
    if ":" not in spec:
        raise ValueError(f"candidate must be one of {names()} or 'module:Class', got {name!r}")
    module, attr = spec.split(":", 1)
    candidate = getattr(importlib.import_module(module), attr)()
    if not isinstance(candidate, Candidate):
        raise TypeError(f"candidate {name!r} is a {type(candidate).__name__}, not a Candidate")
    return candidate


def expand(requested: list[str], device: torch.device) -> list[str]:
    """Report rows for the requested names: "exactlogp" (backend auto) brings one more row
    per other backend that loads and supports `device`."""
    rows: list[str] = []
    for name in requested:
        rows.append(name)
        if name == "exactlogp":
            rows += [f"exactlogp[{b}]" for b in other_backends(device)]
    return list(dict.fromkeys(rows))


def other_backends(device: torch.device) -> list[str]:
    auto = backends.get_backend("auto", device).name
    found = []
    for name in backends.backend_names():
        if name == auto:
            continue
        try:
            backends.get_backend(name, device)
        except (ValueError, RuntimeError):
            continue
        found.append(name)
    return found


__all__ = ["Candidate", "ShardContext", "Unavailable", "create", "expand", "names"]
