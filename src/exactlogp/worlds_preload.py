"""What the fork server of `worlds` imports once, before it forks any rank: torch and
torch.distributed, this package's world code, and megatron-core where it is installed
(the report's and the trainer examples' ranks use it). A rank forked from the server
starts with these modules loaded instead of importing them itself, seconds per rank
on a small CPU. megatron-core warns at import when Transformer Engine / Apex are absent;
those warnings are silenced here, as the report's candidates do."""

from __future__ import annotations

import importlib.util
import warnings

import torch
import torch.distributed

from . import worlds  # noqa: F401

if importlib.util.find_spec("megatron") is not None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            import megatron.core  # noqa: F401
        except Exception:  # a broken install: the ranks that need it import it and say why
            pass

__all__ = ["torch"]
