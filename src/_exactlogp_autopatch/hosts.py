"""The one table of the hosts exactlogp patches, and the variables that ask for them.

Torch-free and exactlogp-free, so that the start-up hook (this package's `__init__`) can
read it in every interpreter. `exactlogp.integrations.autopatch` applies a host's patch by
importing `exactlogp.integrations.<adapter>` and calling its `patch_from_env(vocab_size)`;
a host with a trigger is patched by the start-up hook right after that module's first
import; a host without one (vLLM, SGLang) calls exactlogp's plugin entry point in each of
its processes (pyproject.toml, `exactlogp.integrations.autopatch.<name>_plugin`).

Adding a host: one row here and the adapter module (docs/architecture.md, "Where to add").
"""

from __future__ import annotations

import os
from typing import NamedTuple

ENV = "EXACTLOGP_PATCH"
VOCAB_ENV = "EXACTLOGP_VOCAB_SIZE"
MAX_VOCAB = 1 << 20  # = exactlogp.contract.MAX_VOCAB


class Host(NamedTuple):
    name: str  # as EXACTLOGP_PATCH names it
    adapter: str  # exactlogp.integrations.<adapter>: its patch_from_env(vocab_size)
    trigger: str | None  # its first import patches the host at start-up; None: a plugin


TABLE = (
    Host("trl", "trl", "trl"),
    Host("verl", "verl", "verl"),
    Host("megatron", "megatron", "megatron.core"),
    Host("slime", "slime", "slime"),
    Host("nemo_rl", "nemo_rl", "nemo_rl"),
    Host("skyrl", "skyrl", "skyrl"),
    Host("areal", "areal", "areal"),
    Host("openrlhf", "openrlhf", "openrlhf"),
    Host("vllm", "vllm", None),
    Host("sglang", "sglang", None),
)
HOSTS = tuple(host.name for host in TABLE)
BY_NAME = {host.name: host for host in TABLE}


def requested() -> tuple[str, ...]:
    """The hosts EXACTLOGP_PATCH names, each once, in order (empty when unset); a
    ValueError naming the variable for an unknown host."""
    raw = os.environ.get(ENV, "")
    names = tuple(dict.fromkeys(n.strip() for n in raw.split(",") if n.strip()))
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        raise ValueError(
            f"{ENV}={raw!r} names unknown hosts {unknown}; the known hosts are {', '.join(HOSTS)}"
        )
    return names


def vocab_size() -> int | None:
    """EXACTLOGP_VOCAB_SIZE as an int in [1, 2^20] (None when unset or empty); a
    ValueError naming the variable otherwise."""
    raw = os.environ.get(VOCAB_ENV, "")
    text = raw.strip()
    if not text:
        return None
    if not (text.isascii() and text.isdigit()):
        raise ValueError(
            f"{VOCAB_ENV}={raw!r} is not a vocabulary size: it must be a decimal integer "
            "(the model's real vocabulary, e.g. 151936)"
        )
    value = int(text)
    if not 1 <= value <= MAX_VOCAB:
        raise ValueError(f"{VOCAB_ENV}={raw!r} must be in [1, {MAX_VOCAB}]")
    return value
