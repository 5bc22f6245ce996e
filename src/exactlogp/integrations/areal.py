"""AReaL drop-ins: `gather_logprobs` and `gather_logprobs_entropy` computed by exactlogp.

AReaL (1.0.4) computes every log-prob and entropy its trainers use in one module,
`areal.utils.functional.vocab_parallel`: the FSDP, Megatron and Archon engines and the
tree-attention path all call these two functions. The drop-ins have AReaL's names,
arguments, defaults, shapes and dtypes:

- `logits` (..., V), or with a `tp_group` of more than one rank (..., V / tp): this rank's
  columns in AReaL's even split (rank r holds [r * V_local, (r + 1) * V_local)).
- `labels` (...) global token ids, already shifted by AReaL's callers
  (`torch.roll(input_ids, -1)`: position t holds token t + 1); nothing is shifted here.
- y = fp32(logits) / temperature, as AReaL computes it (fp64 logits are rounded to fp32
  first, as AReaL's `.float()` does); the entropy is that of softmax(y).
- fp32 results shaped like `labels`, differentiable in the logits (the entropy too).
- `chunk_size` is accepted and changes nothing: exactlogp keeps no (N, V) fp32 copy of
  the logits, which is what AReaL chunks to bound.
- `vocab_size` (keyword only, also `patch_areal(vocab_size=...)`): columns >= vocab_size
  (an LM head padded past the model's vocabulary) are left out; None keeps every
  column, as AReaL does.

Unlike AReaL's: the values are correctly rounded and have the same bits for every TP
degree; a label equal to -100 gives 0 with a zero gradient (AReaL's gather raises);
uneven shards and out-of-range labels raise ValueError. exactlogp divides by IEEE
division; AReaL's own code divides by a Python float, which PyTorch's CUDA kernel
computes as a product with the reciprocal (the last bit of y may differ there).

`patch_areal()` swaps both into `areal.utils.functional.vocab_parallel` and into every
module of AReaL that bound them by name (`areal.utils.functional` and the engines).
"""

from __future__ import annotations

import functools

import torch

from ..api import selected_logprobs
from . import _patching, _rows

PATCH_KEY = "patch_areal"
KNOWN = "AReaL 1.0.4"
_DEFINED = "areal.utils.functional.vocab_parallel"
# Modules that bind the two names with `from ... import` (AReaL 1.0.4). The re-export in
# `areal.utils.functional` is what the engines import, so it must be there; the engines
# and the tree-attention path import only with their own dependencies installed.
_REEXPORT = "areal.utils.functional"
_CONSUMERS = (
    "areal.engine.fsdp_engine",
    "areal.engine.megatron_engine",
    "areal.experimental.engine.archon_engine",
    "areal.models.tree_attn.functional",
)


def gather_logprobs(
    logits: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    tp_group=None,
    chunk_size: int = 1024,
    *,
    vocab_size: int | None = None,
) -> torch.Tensor:
    """log softmax(fp32(logits) / temperature)[labels], fp32, shaped like labels."""
    result = _run(logits, labels, temperature, tp_group, chunk_size, vocab_size, False)
    return result.logprobs


def gather_logprobs_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    tp_group=None,
    chunk_size: int = 1024,
    *,
    vocab_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs, entropy) of softmax(fp32(logits) / temperature) from one pass; fp32,
    shaped like labels."""
    result = _run(logits, labels, temperature, tp_group, chunk_size, vocab_size, True)
    return result.logprobs, result.entropy


def _run(logits, labels, temperature, tp_group, chunk_size, vocab_size, with_entropy: bool):
    _rows.check_tensor("logits", logits)
    _rows.check_chunk_size(chunk_size)
    if logits.dtype == torch.float64:
        logits = logits.float()  # AReaL's `.float()`: the contract's fp32 from here on
    return selected_logprobs(
        logits,
        labels,
        tp_group=_vocab_group(tp_group),
        vocab_size=vocab_size,
        temperature=temperature,
        with_entropy=with_entropy,
    )


def _vocab_group(tp_group):
    """AReaL's rule: the vocabulary is split only over a group of more than one rank; a
    group of one (or None) holds it whole."""
    if tp_group is None:
        return None
    import torch.distributed as dist

    return tp_group if dist.get_world_size(tp_group) > 1 else None


_FUNCTIONS = {
    "gather_logprobs": gather_logprobs,
    "gather_logprobs_entropy": gather_logprobs_entropy,
}


@_patching.atomic
def patch_areal(*, vocab_size: int | None = None) -> _patching.PatchHandle:
    """Make AReaL's engines compute log-probs and entropy with exactlogp.

    Replaces `gather_logprobs` and `gather_logprobs_entropy` in
    `areal.utils.functional.vocab_parallel`, its re-export `areal.utils.functional`, and
    every AReaL module that bound them by name: the FSDP, Megatron and Archon engines
    (`areal.engine.fsdp_engine`, `areal.engine.megatron_engine`,
    `areal.experimental.engine.archon_engine`) and `areal.models.tree_attn.functional`.
    An engine module that does not import here (its own dependencies missing) is skipped
    and named in `handle.skipped`; imported later, it binds the patched functions.

    `vocab_size`: None or an int >= 1 (TypeError / ValueError otherwise), bound into the
    patched functions. Opt-in and idempotent (a second call returns the live handle); undo
    with `unpatch_areal()` or `handle.undo()`. An AReaL whose functions take other
    arguments than AReaL 1.0.4's is refused (RuntimeError naming its version);
    ImportError without AReaL, AttributeError naming a symbol this AReaL moved. Nothing
    is changed then.
    """
    vocab_size = _rows.check_vocab_size(vocab_size)
    _patching.check_signatures(PATCH_KEY, "areal", _DEFINED, _FUNCTIONS, KNOWN)
    ours = dict(_FUNCTIONS)
    if vocab_size is not None:
        ours = {name: _bind(fn, vocab_size=vocab_size) for name, fn in ours.items()}
    sites = [_patching.Site(_DEFINED, n, f, everywhere=True) for n, f in ours.items()]
    sites += [_patching.Site(_REEXPORT, n, f) for n, f in ours.items()]
    sites += [
        _patching.Site(module, n, f, optional=True)
        for module in _CONSUMERS
        for n, f in ours.items()
    ]
    return _patching.apply(PATCH_KEY, sites, {"vocab_size": vocab_size})


@_patching.atomic
def unpatch_areal() -> bool:
    """Restore AReaL's own functions; False if `patch_areal` was not applied."""
    return _patching.undo(PATCH_KEY)


def patch_from_env(vocab_size: int | None = None) -> _patching.PatchHandle:
    """EXACTLOGP_PATCH=areal (exactlogp.integrations.autopatch): `patch_areal` with
    EXACTLOGP_VOCAB_SIZE as its `vocab_size`."""
    return patch_areal(vocab_size=vocab_size)


def _bind(fn, **keywords):
    return functools.wraps(fn)(functools.partial(fn, **keywords))
