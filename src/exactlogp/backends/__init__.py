"""Backend registry: each entry is a factory so optional dependencies load lazily."""

from __future__ import annotations

import importlib
import os
import warnings

import torch

from .base import Backend, ShardPlan

# name -> (module, class)
_REGISTRY: dict[str, tuple[str, str]] = {
    "reference": ("exactlogp.backends.reference", "ReferenceBackend"),
    "cpu": ("exactlogp.backends.cpu", "CpuBackend"),
    "triton": ("exactlogp.backends.triton", "TritonBackend"),
}
# "auto" picks the first (name, device types or None for any) that loads and supports the
# device; Triton is offered only for CUDA (on CPU it would run in its slow interpreter).
_AUTO_ORDER = (("triton", ("cuda",)), ("cpu", ("cpu",)), ("reference", None))
_cache: dict[str, Backend] = {}  # by name, and "auto:<device type>"


# A forked child must not start an OpenMP region: its OpenMP state names the parent's
# threads, which the child does not have, and a region would wait for them forever
# (torch's own parallel ops do). Registered when exactlogp is imported, so every child
# forked after that knows; the CPU kernels then run on the calling thread (the same bits).
_forked = False


def _mark_forked() -> None:
    global _forked
    _forked = True


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_mark_forked)


def in_forked_child() -> bool:
    """True in a process forked (os.fork, multiprocessing's "fork") after exactlogp was
    imported."""
    return _forked


def backend_names() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def get_backend(name: str | Backend, device: torch.device) -> Backend:
    """The backend called `name` (or the best for `device` when name == "auto"), or the
    backend object `name` itself once it supports `device`."""
    if isinstance(name, Backend):
        _check_supports(name, device, name.name)
        return name
    if not isinstance(name, str):
        raise TypeError(
            f"backend must be a str or an exactlogp Backend object (e.g. "
            f"exactlogp.backends.CpuBackend(num_threads=4)), got {type(name).__name__}"
        )
    if name == "auto":  # resolved once per device type
        found = _cache.get(f"auto:{device.type}")
        if found is None:
            found = _cache[f"auto:{device.type}"] = _auto(device)
        return found
    if name not in _REGISTRY:
        raise ValueError(f"backend must be 'auto' or one of {backend_names()}, got {name!r}")
    backend = _load(name)
    if backend is None:
        raise ValueError(f"backend={name!r} is not available: {_load_errors[name]}")
    _check_supports(backend, device, name)
    return backend


def _check_supports(backend: Backend, device: torch.device, name: str) -> None:
    if not backend.supports(device):
        why = getattr(backend, "unsupported_reason", lambda _: None)(device)
        raise ValueError(
            f"backend={name!r} does not support device {device}" + (f": {why}" if why else "")
        )


def _auto(device: torch.device) -> Backend:
    passed_over = []
    for candidate, device_types in _AUTO_ORDER:
        if device_types is not None and device.type not in device_types:
            continue
        backend = _load(candidate)
        if backend is not None and backend.supports(device):
            if passed_over and candidate == "reference":
                _warn_fallback(device, passed_over)
            return backend
        passed_over.append(candidate)
    raise RuntimeError(f"no exactlogp backend supports device {device}")


_load_errors: dict[str, str] = {}
_warned: set[tuple[str, tuple[str, ...]]] = set()


def _warn_fallback(device: torch.device, passed_over: list[str]) -> None:
    """Once per device type: "auto" fell back to the slow reference backend, and why."""
    key = (device.type, tuple(passed_over))
    if key in _warned:
        return
    _warned.add(key)
    why = "; ".join(
        f"backend={n!r}: {_load_errors.get(n, 'does not support it')}" for n in passed_over
    )
    warnings.warn(
        f"exactlogp: backend='auto' uses the reference backend on {device.type} (the same "
        f"bits, but tens of times slower) because {why}",
        RuntimeWarning,
        stacklevel=5,
    )


def _load(name: str) -> Backend | None:
    if name not in _cache and name not in _load_errors:
        module, cls = _REGISTRY[name]
        try:
            _cache[name] = getattr(importlib.import_module(module), cls)()
        except (ImportError, OSError, RuntimeError) as exc:
            _load_errors[name] = f"{type(exc).__name__}: {exc}"
    return _cache.get(name)


def __getattr__(name: str):
    """The backend classes by name, loaded on first use (their optional dependencies with
    them): exactlogp.backends.CpuBackend, ReferenceBackend, TritonBackend."""
    for module, cls in _REGISTRY.values():
        if cls == name:
            return getattr(importlib.import_module(module), cls)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "Backend",
    "CpuBackend",
    "ReferenceBackend",
    "ShardPlan",
    "TritonBackend",
    "backend_names",
    "get_backend",
]
