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
- Any Python process (TRL, torchrun ranks, Ray actors): nothing to do where exactlogp is
  installed in site-packages. Its `exactlogp-autopatch.pth` runs a start-up hook in every
  interpreter (`_exactlogp_autopatch`): with EXACTLOGP_PATCH set it patches trl, verl and
  megatron (at `megatron.core`) right after each is first imported. Where the .pth is not
  processed (`python -S`, exactlogp only on PYTHONPATH), call `apply_from_env()` at
  start-up, or put it in a `sitecustomize.py`.

A requested patch that cannot be applied raises (never a silent no-op), and the call is
all or nothing: the patches it applied before the failing one are undone first (patches
applied before the call stay). Both variables are checked, naming them, before anything
is patched: EXACTLOGP_PATCH's hosts must be known, EXACTLOGP_VOCAB_SIZE a decimal integer
in [1, 2^20].
"""

from __future__ import annotations

import os
from collections.abc import Callable

from ..contract import MAX_VOCAB
from . import _patching

ENV = "EXACTLOGP_PATCH"
VOCAB_ENV = "EXACTLOGP_VOCAB_SIZE"
HOSTS = ("trl", "verl", "megatron", "vllm", "sglang")
# Rebuilt with the context of a failed EXACTLOGP_PATCH; any other kind is re-raised as is.
_REBUILT = (
    ImportError, ModuleNotFoundError, AttributeError, RuntimeError, ValueError, TypeError,
    NotImplementedError,
)  # fmt: skip


def requested() -> tuple[str, ...]:
    """The hosts EXACTLOGP_PATCH names, each once, in order (empty when unset)."""
    raw = os.environ.get(ENV, "")
    names = tuple(dict.fromkeys(n.strip() for n in raw.split(",") if n.strip()))
    unknown = [n for n in names if n not in HOSTS]
    if unknown:
        raise ValueError(
            f"{ENV}={raw!r} names unknown hosts {unknown}; the known hosts are {', '.join(HOSTS)}"
        )
    return names


def vocab_size() -> int | None:
    """EXACTLOGP_VOCAB_SIZE as an int in [1, 2^20] (None when unset or empty)."""
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
    the host is first imported); an error names EXACTLOGP_PATCH and the host."""
    if host not in HOSTS:
        raise ValueError(f"host={host!r} is unknown; the known hosts are {', '.join(HOSTS)}")
    try:
        return _patch_function(host, vocab_size())()
    except _REBUILT as exc:
        if type(exc) not in _REBUILT:
            raise
        raise type(exc)(
            f"{ENV}={os.environ.get(ENV, '')!r}: patching {host} when it was imported failed: {exc}"
        ) from exc


def _patch_function(host: str, vocab: int | None) -> Callable[[], _patching.PatchHandle]:
    if host == "trl":
        from .trl import patch_trl

        return patch_trl
    if host == "verl":
        from .verl import patch_verl

        return lambda: patch_verl(vocab_size=vocab)
    if host == "megatron":
        from .megatron import patch_megatron

        return lambda: patch_megatron(vocab_size=vocab)
    if host == "vllm":
        from .vllm import patch_vllm_sampler

        return patch_vllm_sampler
    from .sglang import patch_sglang

    return patch_sglang


def _in_context(exc: BaseException, failed: str, undone: list[str]) -> str:
    """`exc`'s message with what EXACTLOGP_PATCH asked for and what was undone."""
    done = (
        f"the patches this call had applied ({', '.join(undone)}) were undone"
        if undone
        else "no patch had been applied by this call"
    )
    return f"{ENV}={os.environ.get(ENV, '')!r}: {failed} failed and {done}: {exc}"
