"""Opt-in, idempotent, reversible swaps of a framework's module attributes.

Every required site is resolved before anything is changed, so a framework version that
moved a symbol raises an error naming it and leaves the framework untouched. A patch is
keyed by name: applying it again returns the live handle instead of wrapping twice.

Hosts copy functions into their consumers (`from .utils import f`), so a swap of the
definition alone misses every copy made before it. A site with `everywhere=True` also
swaps each module attribute under the host's package that holds the original object, and
undo restores the copies made while the patch was live (modules imported after it).
Optional sites (a trainer module whose own dependencies are missing) are skipped with the
reason kept on the handle; such a module, imported later, copies the patched definition.

Thread safety: one lock (`LOCK`, re-entrant) serialises every apply and undo, and what they
read and write (the live handles, the host's bindings). Concurrent first calls of one
`patch_<host>()` give one handle whose originals are the host's own objects; the
`patch_<host>()` / `unpatch_<host>()` functions hold it for their whole body (`atomic`).
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

logger = logging.getLogger(__name__)

# Serialises apply / undo and everything they read and write. Re-entrant: a patch_<host>()
# holding it calls apply(), and autopatch holds it across several patch_<host>() calls.
LOCK = threading.RLock()


def atomic(fn: Callable) -> Callable:
    """Run `fn` (a patch_<host>() or unpatch_<host>()) holding LOCK."""

    @functools.wraps(fn)
    def locked(*args, **kwargs):
        with LOCK:
            return fn(*args, **kwargs)

    return locked


@dataclass(frozen=True)
class Site:
    """`module.name` (name may be dotted: "Class.method") is to be replaced by
    `replacement`, or by `replacement(original)` when `wraps` is set.

    optional: a module that cannot be imported, or a name it does not have, is skipped
        (recorded in `PatchHandle.skipped`) instead of failing the whole patch.
    everywhere: also swap every copy of the original bound as a module attribute in the
        package `module` belongs to (its top-level name).
    """

    module: str
    name: str
    replacement: Callable
    wraps: bool = False
    optional: bool = False
    everywhere: bool = False

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
    package: str | None = None  # set for `everywhere` sites: where copies may appear later


class PatchHandle:
    """A live patch; `undo()` puts every original back (also `unpatch_<framework>()`)."""

    def __init__(
        self,
        key: str,
        swaps: list[_Swap],
        options: dict,
        skipped: dict[str, str],
        on_undo: Callable[[], None] | None = None,
    ):
        self.key = key
        self.options = options
        self.skipped = skipped  # site path -> why it was not patched
        self._swaps = swaps
        self._on_undo = on_undo

    @property
    def active(self) -> bool:
        return _ACTIVE.get(self.key) is self

    @property
    def sites(self) -> tuple[str, ...]:
        return tuple(s.path for s in self._swaps)

    def original(self, path: str):
        """The host's own object that this patch replaced at `path` (None if none)."""
        for swap in self._swaps:
            if swap.path == path:
                return swap.original
        return None

    def undo(self) -> None:
        with LOCK:
            if _ACTIVE.get(self.key) is self:
                del _ACTIVE[self.key]
                self._restore()
                if self._on_undo is not None:
                    self._on_undo()

    def _restore(self) -> None:
        for swap in reversed(self._swaps):
            if swap.owner.__dict__.get(swap.attr) is swap.new:
                setattr(swap.owner, swap.attr, swap.original)
            else:  # someone replaced it after us: theirs stays, we do not clobber it
                logger.warning("%s was replaced after %s; left as it is", swap.path, self.key)
        # copies taken while the patch was live (modules imported after it)
        for swap in self._swaps:
            if swap.package is not None:
                for module, attr in _copies(swap.package, swap.new):
                    setattr(module, attr, swap.original)

    def __repr__(self) -> str:
        state = "active" if self.active else "undone"
        return f"PatchHandle({self.key!r}, {state}, sites={list(self.sites)})"


_ACTIVE: dict[str, PatchHandle] = {}


def active(key: str) -> PatchHandle | None:
    return _ACTIVE.get(key)


def live() -> dict[str, PatchHandle]:
    """A copy of {key: live handle}."""
    with LOCK:
        return dict(_ACTIVE)


def apply(
    key: str,
    sites: Sequence[Site],
    options: dict | None = None,
    on_undo: Callable[[], None] | None = None,
) -> PatchHandle:
    """Swap every site in; return the live handle if `key` is already applied.

    `on_undo` is called (under LOCK) after the undo restored every binding: to report the
    objects the patch reached that an undo cannot restore (a model built while patched).

    Raises ValueError if `key` is live with other `options`, ImportError / AttributeError
    naming the first required site that cannot be resolved (nothing is changed then).
    """
    with LOCK:
        return _apply(key, sites, dict(options or {}), on_undo)


def _apply(key: str, sites: Sequence[Site], options: dict, on_undo=None) -> PatchHandle:
    handle = _ACTIVE.get(key)
    if handle is not None:
        if handle.options != options:
            raise ValueError(
                f"{key} is already applied with {handle.options}; undo it before applying "
                f"it with {options}"
            )
        return handle
    swaps: list[_Swap] = []
    skipped: dict[str, str] = {}
    for site in sites:
        try:
            swap = _resolve(key, site)
        except (ImportError, AttributeError) as exc:
            if not site.optional:
                raise
            skipped[site.path] = str(exc)
            continue
        swaps.append(swap)
        if site.everywhere:
            swaps.extend(_copy_swaps(swap))
    swaps = _unique(swaps)
    for swap in swaps:
        setattr(swap.owner, swap.attr, swap.new)
    handle = PatchHandle(key, swaps, options, skipped, on_undo)
    _ACTIVE[key] = handle
    return handle


def undo(key: str) -> bool:
    """Undo the live patch `key`; False if it was not applied."""
    with LOCK:
        handle = _ACTIVE.get(key)
        if handle is None:
            return False
        handle.undo()
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
    if owner is not None and attr not in getattr(owner, "__dict__", {}):
        getattr(owner, attr, None)  # a lazy module binds its export on first access
    if owner is None or attr not in getattr(owner, "__dict__", {}):
        raise AttributeError(
            f"{key}: {site.path} does not exist in this version; the symbol to replace "
            "has moved, so nothing was patched"
        )
    original = owner.__dict__[attr]
    new = site.replacement(original) if site.wraps else site.replacement
    package = site.module.split(".")[0] if site.everywhere else None
    return _Swap(owner, attr, site.path, original, new, package)


def _copy_swaps(swap: _Swap) -> list[_Swap]:
    return [
        _Swap(module, attr, f"{module.__name__}.{attr}", swap.original, swap.new, swap.package)
        for module, attr in _copies(swap.package, swap.original)
        if not (module is swap.owner and attr == swap.attr)
    ]


def _copies(package: str, obj: object) -> list[tuple[object, str]]:
    """(module, attribute) of every module of `package` now loaded that binds `obj`."""
    found = []
    for name, module in list(sys.modules.items()):
        if module is None or not (name == package or name.startswith(package + ".")):
            continue
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        for attr, value in list(namespace.items()):
            if value is obj:
                found.append((module, attr))
    return found


def _unique(swaps: list[_Swap]) -> list[_Swap]:
    seen: set[tuple[int, str]] = set()
    out = []
    for swap in swaps:
        ident = (id(swap.owner), swap.attr)
        if ident not in seen:
            seen.add(ident)
            out.append(swap)
    return out


# --- objects that keep a patched function after the unpatch ---


def warn_kept(kept, unpatch: str, what: str, advice: str) -> None:
    """After `unpatch` restored the host: a RuntimeWarning naming the objects of the weak
    set `kept` (filled while patched) still alive -- `what` they keep, `advice` for the
    user -- and `kept` emptied. Objects freed only by the cycle collector are collected
    first, so that only live ones are named."""
    import gc
    import os
    import sys
    import warnings

    if len(kept):
        gc.collect()  # a bound forward or closure refers to its object: a cycle only gc frees
    alive = list(kept)
    kept.clear()
    if not alive:
        return
    names = ", ".join(f"{type(o).__name__} at {id(o):#x}" for o in alive[:5])
    more = f" and {len(alive) - 5} more" if len(alive) > 5 else ""
    here, frame, level = os.path.dirname(__file__), sys._getframe(0), 1
    while frame is not None and os.path.dirname(frame.f_code.co_filename) == here:
        frame, level = frame.f_back, level + 1  # to the caller of unpatch / handle.undo
    warnings.warn(
        f"{unpatch}: the host's functions are restored, but {len(alive)} object(s) built "
        f"while patched ({names}{more}) keep {what}. {advice}",
        RuntimeWarning,
        stacklevel=level,
    )


def env_choice(name: str, choices: tuple[str, ...]) -> str:
    """The environment variable `name` as one of `choices` (the first when unset or
    empty); a ValueError naming the variable and its value otherwise."""
    raw = os.environ.get(name, "")
    value = raw.strip() or choices[0]
    if value not in choices:
        raise ValueError(f"{name}={raw!r} must be one of {', '.join(choices)} (or unset)")
    return value


def host_version(package: str, patch: str) -> str:
    """The installed `package`'s version, for messages ("of unknown version" if it has
    none); an ImportError naming `patch` when it does not import."""
    try:
        module = importlib.import_module(package)
    except ImportError as exc:
        raise ImportError(f"{patch}: cannot import {package} ({exc}); nothing was patched") from exc
    version = getattr(module, "__version__", None)
    if version is None:
        from importlib.metadata import PackageNotFoundError
        from importlib.metadata import version as dist_version

        try:
            version = dist_version(package)
        except PackageNotFoundError:
            version = "of unknown version"
    return str(version)


def check_signatures(patch: str, package: str, module: str, ours: dict, known: str) -> None:
    """Refuse a host whose functions `module.<name>` take other arguments than the drop-ins
    `ours` {name: the drop-in function, or the tuple of the host's parameter names (of a
    function, or of an autograd Function's `forward`)}: a RuntimeError naming the host's
    version and `known` (the version the drop-ins follow), raised before anything is
    patched. Against a drop-in, the whole signature is compared (names, kinds, order,
    defaults; its keyword-only arguments, exactlogp's own options, are its alone);
    against a tuple, the names in order. A name the host lacks is left to `apply` (AttributeError). Nothing is
    checked while `patch` is live (its own functions are in place)."""
    if active(patch) is not None:
        return
    try:
        host = importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(f"{patch}: cannot import {module} ({exc}); nothing was patched") from exc
    for name, fn in ours.items():
        theirs = host.__dict__.get(name)
        if theirs is None:
            continue
        if isinstance(fn, tuple):  # the names in order (of a Function: its forward's)
            forward = getattr(theirs, "forward", theirs)
            expected, found = ", ".join(fn), ", ".join(_names(forward))
        else:
            expected, found = _parameters(fn, own_options=True), _parameters(theirs)
        if found != expected:
            version = host_version(package, patch)
            raise RuntimeError(
                f"{patch}: {package} {version}'s {module}.{name} takes ({found}); exactlogp "
                f"knows ({expected}) of {known}, so nothing was patched"
            )


def _names(fn) -> tuple[str, ...]:
    import inspect

    try:
        return tuple(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return ("?",)


def _parameters(fn, own_options: bool = False) -> str:
    """`fn`'s parameters as its signature writes them (without the keyword-only ones
    when `own_options`); "?" where Python cannot tell."""
    import inspect

    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return "?"
    if own_options:
        parameters = [p for p in parameters if p.kind is not inspect.Parameter.KEYWORD_ONLY]
    bare = [p.replace(annotation=inspect.Parameter.empty) for p in parameters]
    return str(inspect.Signature(bare))[1:-1]  # "(a, b=1, *, c)" without its parentheses
