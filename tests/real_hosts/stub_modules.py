"""Small stand-in modules put into `sys.modules` before a real host is imported, for the
imports of a host module that pull packages this machine cannot or need not install.
Each run script names every stub it puts there and why."""

from __future__ import annotations

import importlib.machinery
import sys
import types


def stub(name: str, *, path: str | None = None, **attrs) -> types.ModuleType:
    """Put a module `name` with `attrs` into sys.modules. `path`: a package whose
    submodules are the real files in that directory (its own `__init__.py` is not run).
    The module has a spec, so `importlib.util.find_spec(name)` works on it (transformers
    asks it of optional packages; with no distribution metadata it then finds them absent)."""
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=path is not None)
    if path is not None:
        module.__path__ = [path]
        module.__spec__.submodule_search_locations = [path]
    sys.modules[name] = module
    return module
