"""Apply exactlogp's host patches where the host runs: worker processes and Ray actors.

A `patch_*()` call changes the process that makes it. vLLM samples in its engine-core and
worker processes, verl and slime train in Ray actors, so a patch in the driver changes
nothing where it matters. The environment variable EXACTLOGP_PATCH carries the request
into every process: a comma-separated list of the hosts of the table
(`_exactlogp_autopatch/hosts.py`: trl, verl, megatron, slime, nemo_rl, skyrl, areal, openrlhf,
vllm, sglang;
EXACTLOGP_VOCAB_SIZE, if set, is passed to the adapters that take a `vocab_size`).

- vLLM / SGLang call exactlogp's plugin entry points in each of their processes
  (`vllm.general_plugins`, `sglang.srt.plugins`: `vllm_plugin`, `sglang_plugin` below):
  setting EXACTLOGP_PATCH is enough.
- Ray: `runtime_env={"env_vars": {"EXACTLOGP_PATCH": "verl"},
  "worker_process_setup_hook": "exactlogp.integrations.autopatch.apply_from_env"}`.
- Any Python process (TRL, torchrun ranks, Ray actors): nothing to do where exactlogp is
  installed in site-packages. Its `exactlogp-autopatch.pth` runs a start-up hook in every
  interpreter (`_exactlogp_autopatch`): with EXACTLOGP_PATCH set it patches each host of
  the table that has a trigger module right after that module is first imported. Where the .pth is not processed (`python -S`, exactlogp only on PYTHONPATH),
  call `apply_from_env()` at start-up, or put it in a `sitecustomize.py`.

A requested patch that cannot be applied raises (never a silent no-op), and the call is
all or nothing: the patches it applied before the failing one are undone first (patches
applied before the call stay). Both variables are checked, naming them, before anything
is patched: EXACTLOGP_PATCH's hosts must be known, EXACTLOGP_VOCAB_SIZE a decimal integer
in [1, 2^20].

The hosts are one table, torch-free for the start-up hook (`_exactlogp_autopatch.hosts`):
each row names the adapter module whose `patch_from_env(vocab_size)` applies the host's
patch with the options its own variables ask for (EXACTLOGP_VLLM_CUT, ...).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable

from _exactlogp_autopatch import hosts

from . import _patching

ENV, VOCAB_ENV, HOSTS = hosts.ENV, hosts.VOCAB_ENV, hosts.HOSTS
requested, vocab_size = hosts.requested, hosts.vocab_size
# Rebuilt with the context of a failed EXACTLOGP_PATCH; any other kind is re-raised as is.
_REBUILT = (
    ImportError, ModuleNotFoundError, AttributeError, RuntimeError, ValueError, TypeError,
    NotImplementedError,
)  # fmt: skip


def apply_from_env() -> dict:
    """Apply every patch EXACTLOGP_PATCH asks for in this process; {host: PatchHandle}.

    All or nothing: if one cannot be applied, those this call applied are undone before
    the error is raised.
    """
    vocab = vocab_size()
    patches = {host: _patch_function(host, vocab) for host in requested()}
    handles: dict = {}
    with _patching.LOCK:
        before = _patching.live()
        try:
            for host, patch in patches.items():
                handles[host] = patch()
        except BaseException as exc:
            applied = [h for h, handle in handles.items() if before.get(handle.key) is not handle]
            for h in reversed(applied):
                handles[h].undo()
            if type(exc) not in _REBUILT:
                raise
            failed = next(h for h in patches if h not in handles)
            raise type(exc)(_in_context(exc, failed, applied)) from exc
    return handles


def apply_host(host: str) -> _patching.PatchHandle:
    """Apply the patch of one host EXACTLOGP_PATCH names (the start-up hook calls it when
    the host is first imported, the plugins in the host's processes); an error names
    EXACTLOGP_PATCH and the host."""
    if host not in hosts.BY_NAME:
        raise ValueError(f"host={host!r} is unknown; the known hosts are {', '.join(HOSTS)}")
    try:
        return _patch_function(host, vocab_size())()
    except _REBUILT as exc:
        if type(exc) not in _REBUILT:
            raise
        raw = os.environ.get(ENV, "")
        raise type(exc)(
            f"{ENV}={raw!r}: patching {host} when it was imported failed: {exc}"
        ) from exc


def _plugin(host: str) -> None:
    """A host's plugin entry point: its patch where EXACTLOGP_PATCH names it, nothing
    (and no import of the host) otherwise."""
    if host in requested():
        apply_host(host)


def vllm_plugin() -> None:
    """vLLM's `general_plugins` entry point (registered as `exactlogp`): vLLM calls it in
    its front-end, engine-core and every worker process; EXACTLOGP_PATCH=vllm applies
    `patch_vllm_sampler` (EXACTLOGP_VLLM_CUT=exact: with cut="exact")."""
    _plugin("vllm")


def sglang_plugin() -> None:
    """SGLang's `sglang.srt.plugins` entry point: EXACTLOGP_PATCH=sglang applies
    `patch_sglang` in each SGLang process (EXACTLOGP_SGLANG_CUT=exact: cut="exact")."""
    _plugin("sglang")


def _patch_function(host: str, vocab: int | None) -> Callable[[], _patching.PatchHandle]:
    """The host's patch with the options the environment asks for, from its adapter."""
    adapter = importlib.import_module(f"{__package__}.{hosts.BY_NAME[host].adapter}")
    return lambda: adapter.patch_from_env(vocab)


def _in_context(exc: BaseException, failed: str, undone: list[str]) -> str:
    """`exc`'s message with what EXACTLOGP_PATCH asked for and what was undone."""
    done = (
        f"the patches this call had applied ({', '.join(undone)}) were undone"
        if undone
        else "no patch had been applied by this call"
    )
    raw = os.environ.get(ENV, "")
    return f"{ENV}={raw!r}: {failed} failed and {done}: {exc}"
