"""Opt-in, idempotent, reversible swaps of a framework's module attributes.

Every site is resolved before anything is changed, so a framework version that moved a
symbol raises an error naming it and leaves the framework untouched. A patch is keyed by
name: applying it again returns the live handle instead of wrapping twice.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Site:
    """`module.name` (name may be dotted: "Class.method") is to be replaced by
    `replacement`, or by `replacement(original)` when `wraps` is set."""

    module: str
    name: str
    replacement: Callable
    wraps: bool = False

    @property
    def path(self) -> str:
        return f"{self.module}.{self.name}"


@dataclass(frozen=True)
class _Swap:
    owner: object  # the module or class that holds the attribute
    attr: str
    path: str
    original: object
    new: object


class PatchHandle:
    """A live patch; `undo()` puts every original back (also `unpatch_<framework>()`)."""

    def __init__(self, key: str, swaps: list[_Swap], options: dict):
        self.key = key
        self.options = options
        self._swaps = swaps

    @property
    def active(self) -> bool:
        return _ACTIVE.get(self.key) is self

    @property
    def sites(self) -> tuple[str, ...]:
        return tuple(s.path for s in self._swaps)

    def undo(self) -> None:
        if _ACTIVE.get(self.key) is self:
            del _ACTIVE[self.key]
            self._restore()

    def _restore(self) -> None:
        for swap in reversed(self._swaps):
            if swap.owner.__dict__.get(swap.attr) is swap.new:
                setattr(swap.owner, swap.attr, swap.original)
            else:  # someone replaced it after us: theirs stays, we do not clobber it
                logger.warning("%s was replaced after %s; left as it is", swap.path, self.key)

    def __repr__(self) -> str:
        state = "active" if self.active else "undone"
        return f"PatchHandle({self.key!r}, {state}, sites={list(self.sites)})"


_ACTIVE: dict[str, PatchHandle] = {}


def active(key: str) -> PatchHandle | None:
    return _ACTIVE.get(key)


def apply(key: str, sites: Sequence[Site], options: dict | None = None) -> PatchHandle:
    """Swap every site in; return the live handle if `key` is already applied.

    Raises ValueError if `key` is live with other `options`, ImportError / AttributeError
    naming the first site that cannot be resolved (nothing is changed then).
    """
    options = dict(options or {})
    live = _ACTIVE.get(key)
    if live is not None:
        if live.options != options:
            raise ValueError(
                f"{key} is already applied with {live.options}; undo it before applying "
                f"it with {options}"
            )
        return live
    swaps = [_resolve(key, site) for site in sites]
    for swap in swaps:
        setattr(swap.owner, swap.attr, swap.new)
    handle = PatchHandle(key, swaps, options)
    _ACTIVE[key] = handle
    return handle


def undo(key: str) -> bool:
    """Undo the live patch `key`; False if it was not applied."""
    live = _ACTIVE.get(key)
    if live is None:
        return False
    live.undo()
    return True


def _resolve(key: str, site: Site) -> _Swap:
    try:
        owner = importlib.import_module(site.module)
    except ImportError as exc:
        raise ImportError(
            f"{key}: cannot import {site.module} ({exc}); nothing was patched"
        ) from exc
    *parents, attr = site.name.split(".")
    for part in parents:
        owner = getattr(owner, part, None)
    if owner is None or attr not in getattr(owner, "__dict__", {}):
        raise AttributeError(
            f"{key}: {site.path} does not exist in this version; the symbol to replace "
            "has moved, so nothing was patched"
        )
    original = owner.__dict__[attr]
    new = site.replacement(original) if site.wraps else site.replacement
    return _Swap(owner, attr, site.path, original, new)
