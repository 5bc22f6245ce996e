"""EXACTLOGP_PATCH at interpreter start-up: exactlogp's `exactlogp-autopatch.pth`, installed
in site-packages with the package, runs `install()` in every Python process where the
environment variable EXACTLOGP_PATCH is set (and does nothing else where it is not).

`install()` imports no host and not even torch or exactlogp: it checks the variables and
puts a `sys.meta_path` finder in front of the import system. When a named host is first
imported (its trigger in the hosts table: `trl`, `verl`, `megatron.core`, `areal`,
`openrlhf`), the finder lets the host's module execute and then applies its patch
(`exactlogp.integrations.autopatch.apply_host`); a patch that cannot be applied raises
from that import, naming EXACTLOGP_PATCH. Hosts already imported are patched at once.
vLLM and SGLang are left to their plugin entry points, which they call in each of their
processes: `EXACTLOGP_PATCH=vllm` imports nothing here.

At start-up it never raises: an unknown host or a bad EXACTLOGP_VOCAB_SIZE is a warning
naming the variable and its value, and nothing is patched.
"""

from __future__ import annotations

import os
import sys
import threading
import warnings

from . import hosts

ENV = hosts.ENV


def requested() -> tuple[str, ...] | None:
    """The hosts EXACTLOGP_PATCH names, or None (with a warning) when its value or
    EXACTLOGP_VOCAB_SIZE's is bad (the table's checks: hosts.py)."""
    try:
        hosts.vocab_size()
        return hosts.requested()
    except ValueError as exc:
        _warn(str(exc))
        return None


def _warn(message: str) -> None:
    warnings.warn(f"exactlogp: {message}; nothing is patched", RuntimeWarning, stacklevel=3)


class PatchOnImport:
    """A `sys.meta_path` finder: patches a host right after its trigger module executed."""

    def __init__(self, pending: dict[str, str]):
        self.pending = dict(pending)  # trigger module -> host
        self._lock = threading.RLock()
        self._finding: set[str] = set()

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in self.pending or fullname in self._finding:
            return None
        self._finding.add(fullname)
        try:
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
            else:
                return None
        finally:
            self._finding.discard(fullname)
        loader = spec.loader
        if loader is None or isinstance(loader, type) or not hasattr(loader, "exec_module"):
            return spec
        run = loader.exec_module

        def exec_module(module):
            try:
                run(module)
            finally:
                try:
                    del loader.exec_module  # leave the host's loader as it was
                except AttributeError:
                    pass
            self.patch(fullname)

        try:
            loader.exec_module = exec_module
        except (AttributeError, TypeError):
            return spec
        return spec

    def patch(self, trigger: str) -> None:
        with self._lock:
            host = self.pending.pop(trigger, None)
            if not self.pending:
                uninstall()
        if host is not None:
            from exactlogp.integrations.autopatch import apply_host

            apply_host(host)


_FINDER: PatchOnImport | None = None


def install() -> PatchOnImport | None:
    """Install the finder for the hosts EXACTLOGP_PATCH names (once); patch those already
    imported. Never raises: a problem is a RuntimeWarning naming what is wrong."""
    global _FINDER
    try:
        names = requested()
        if not names or _FINDER is not None:
            return _FINDER
        triggers = {h: hosts.BY_NAME[h].trigger for h in names}
        pending = {trigger: h for h, trigger in triggers.items() if trigger is not None}
        if not pending:
            return None
        _FINDER = PatchOnImport(pending)
        sys.meta_path.insert(0, _FINDER)
        for trigger in [t for t in pending if t in sys.modules]:
            _FINDER.patch(trigger)
        return _FINDER
    except Exception as exc:  # noqa: BLE001 -- start-up must go on
        _warn(f"{ENV}={os.environ.get(ENV, '')!r} could not be applied ({exc!r})")
        return _FINDER


def uninstall() -> None:
    global _FINDER
    if _FINDER is not None and _FINDER in sys.meta_path:
        sys.meta_path.remove(_FINDER)
    _FINDER = None


def startup() -> None:
    """The .pth file's entry point."""
    if os.environ.get(ENV, "").strip():
        install()
