"""Apply exactlogp's host patches where the host runs: worker processes and Ray actors.

A `patch_*()` call changes the process that makes it. vLLM samples in its engine-core and
worker processes, verl and slime train in Ray actors, so a patch in the driver changes
nothing where it matters. The environment variable EXACTLOGP_PATCH carries the request
into every process: a comma-separated list of hosts among trl, verl, megatron, vllm,
sglang (EXACTLOGP_VOCAB_SIZE, if set, is passed to megatron and verl as `vocab_size`).

- vLLM / SGLang call exactlogp's plugin entry points in each of their processes
  (`vllm.general_plugins`, `sglang.srt.plugins`): setting EXACTLOGP_PATCH is enough.
- Ray: `runtime_env={"env_vars": {"EXACTLOGP_PATCH": "verl"},
  "worker_process_setup_hook": "exactlogp.integrations.autopatch.apply_from_env"}`.
- Any Python process: call `apply_from_env()` at start-up, or put
  `import exactlogp.integrations.autopatch as a; a.apply_from_env()` in a
  `sitecustomize.py` on the workers' PYTHONPATH.

A requested patch that cannot be applied raises (never a silent no-op).
"""

from __future__ import annotations

import os

ENV = "EXACTLOGP_PATCH"
VOCAB_ENV = "EXACTLOGP_VOCAB_SIZE"
HOSTS = ("trl", "verl", "megatron", "vllm", "sglang")


def requested() -> tuple[str, ...]:
    """The hosts EXACTLOGP_PATCH names (empty when unset)."""
    names = tuple(n.strip() for n in os.environ.get(ENV, "").split(",") if n.strip())
    unknown = [n for n in names if n not in HOSTS]
    if unknown:
        raise ValueError(f"{ENV}={os.environ[ENV]!r} names unknown hosts {unknown}; use {HOSTS}")
    return names


def apply_from_env() -> dict:
    """Apply every patch EXACTLOGP_PATCH asks for in this process; {host: PatchHandle}."""
    vocab = os.environ.get(VOCAB_ENV)
    vocab_size = int(vocab) if vocab else None
    handles = {}
    for host in requested():
        if host == "trl":
            from .trl import patch_trl as patch
        elif host == "verl":
            from .verl import patch_verl

            def patch():
                return patch_verl(vocab_size=vocab_size)
        elif host == "megatron":
            from .megatron import patch_megatron

            def patch():
                return patch_megatron(vocab_size=vocab_size)
        elif host == "vllm":
            from .vllm import patch_vllm_sampler as patch
        else:
            from .sglang import patch_sglang as patch
        handles[host] = patch()
    return handles
