"""The candidates, registered by name: the one registry of the report, the bench, the
GPU check and the tests. Each module says exactly what it runs.

`create(name)` makes one from a registered name, optionally with parameters in brackets
("exactlogp[cpu,entropy]", "torch_full[row_block=all]": the class's `from_params`), or
from "package.module:Class" for a candidate defined elsewhere.

The first rows take the shared logits; exactlogp_linear, verl_fused, miles_fused and
torch_linear take the hidden states and the LM-head weight (kind "hidden_states").

A new candidate is one module here (a `Candidate` subclass, see base.py) and one line in
REGISTRY.
"""

from __future__ import annotations

import importlib

import torch

from ... import backends
from .base import Candidate, ShardContext, Unavailable, logprobs_of

REGISTRY: dict[str, str] = {
    "exactlogp": "exactlogp.report.candidates.exactlogp:ExactlogpCandidate",
    "megatron_ce": "exactlogp.report.candidates.megatron_ce:MegatronCE",
    "megatron_fused_ce": "exactlogp.report.candidates.megatron_fused_ce:MegatronFusedCE",
    "vime_default": "exactlogp.report.candidates.vime_default:VimeDefault",
    "vllm_gather": "exactlogp.report.candidates.vllm_gather:VllmGather",
    "rl_kernel_ws2": "exactlogp.report.candidates.rl_kernel_ws2:RLKernelWS2",
    "torch_full": "exactlogp.report.candidates.torch_full:TorchFull",
    "torch_compile": "exactlogp.report.candidates.torch_compile:TorchCompile",
    "exactlogp_linear": "exactlogp.report.candidates.exactlogp_linear:ExactlogpLinear",
    "verl_fused": "exactlogp.report.candidates.verl_fused:VerlFused",
    "miles_fused": "exactlogp.report.candidates.miles_fused:MilesFused",
    "torch_linear": "exactlogp.report.candidates.torch_linear:TorchLinear",
}


def names() -> tuple[str, ...]:
    return tuple(REGISTRY)


def split_names(text: str) -> tuple[str, ...]:
    """Comma-separated candidate names; commas inside brackets belong to the name."""
    names, depth, start = [], 0, 0
    for i, ch in enumerate(text + ","):
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            names.append(text[start:i].strip())
            start = i + 1
    return tuple(n for n in names if n)


def create(name: str) -> Candidate:
    base, params = name, ()
    if name.endswith("]") and "[" in name:
        base, inside = name[:-1].split("[", 1)
        params = tuple(p.strip() for p in inside.split(",") if p.strip())
    spec = REGISTRY.get(base, base)
    if ":" not in spec:
        raise ValueError(f"candidate must be one of {names()} or 'module:Class', got {name!r}")
    module, attr = spec.split(":", 1)
    cls = getattr(importlib.import_module(module), attr)
    if not (isinstance(cls, type) and issubclass(cls, Candidate)):
        raise TypeError(f"candidate {name!r} is a {getattr(cls, '__name__', cls)}, not a Candidate")
    return cls.from_params(params)


def expand(requested: list[str], device: torch.device) -> list[str]:
    """Report rows for the requested names: "exactlogp" (backend auto) brings one more row
    per other backend that loads and supports `device`. (An "exactlogp_linear[BACKEND]"
    row is there when asked for by name: each of its calls costs seconds on a CPU.)"""
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


__all__ = [
    "Candidate",
    "ShardContext",
    "Unavailable",
    "create",
    "expand",
    "logprobs_of",
    "names",
    "split_names",
]
