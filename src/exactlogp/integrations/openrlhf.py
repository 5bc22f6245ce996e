"""OpenRLHF drop-ins: `log_probs_from_logits` and `compute_entropy` computed by exactlogp.

OpenRLHF (0.11.2) scores its actor's tokens with two functions of `openrlhf.models.utils`,
which `openrlhf.models.actor` (`Actor.forward`) binds by name. The drop-ins have
OpenRLHF's names, arguments, defaults, shapes and output dtypes:

- `log_probs_from_logits(logits, labels, temperature=1.0)`: log softmax(logits)[labels]
  over the last dimension, shaped like `labels`. `labels` are already shifted by the
  caller (`Actor.forward` passes `torch.roll(sequences, -1, dims=1)` and drops the last
  column itself); nothing is shifted here. Output dtype as OpenRLHF's: fp32 for fp32
  logits, the logits' dtype for bf16 / fp16 (OpenRLHF's per-row `log_softmax` branch),
  and for fp64 logits fp32 where flash-attn's cross-entropy imports (OpenRLHF's fused
  branch, fp32 losses), else fp64.
- `compute_entropy(logits)`: the entropy of softmax(logits) per row, shaped
  `logits.shape[:-1]`, in the logits' dtype.

Both are exactlogp's correctly rounded fp32 values (fp64 logits: plain torch in fp64,
outside the contract), rounded once to that dtype, and differentiable in the logits.

Unlike OpenRLHF's: the logits are never modified. OpenRLHF's `log_probs_from_logits`
divides the caller's tensor in place (`logits.div_(temperature)`) when `temperature !=
1`, so the caller's logits hold logits / T afterwards (and a leaf that requires grad
raises); here `temperature` gives y = fp32(logits) / T and the caller's tensor is left as
it was. (On bf16 logits OpenRLHF divides and takes the log-softmax in bf16; here the
division and everything after it is fp32.) OpenRLHF 0.11.2's `Actor.forward` divides the
fp32 logits by its temperature itself before calling either function, so it passes none.
A label equal to -100 gives 0 with a zero gradient, as on OpenRLHF's flash-attn path
(its other paths raise on it).
"""

from __future__ import annotations

import torch

from . import _patching, _rows

PATCH_KEY = "patch_openrlhf"
KNOWN = "OpenRLHF 0.11.2"
_DEFINED = "openrlhf.models.utils"
_ACTOR = "openrlhf.models.actor"  # `from .utils import compute_entropy, log_probs_from_logits`


def log_probs_from_logits(
    logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """log softmax(logits / temperature)[labels], shaped like labels, OpenRLHF's dtype
    (the module docstring); `logits` are not modified."""
    _rows.check_tensor("logits", logits)
    temperature = _rows.check_positive_temperature(temperature)
    logprobs, _ = _rows.one_id_per_row(logits, labels, temperature=temperature)
    return _rows.cast(logprobs, _logprob_dtype(logits.dtype))


def compute_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) per row, shaped logits.shape[:-1], the logits' dtype."""
    return _rows.cast(_rows.entropy(logits), logits.dtype)


def _logprob_dtype(dtype: torch.dtype) -> torch.dtype:
    if dtype == torch.float64 and _flash_attn_cross_entropy():
        return torch.float32
    return dtype


def _flash_attn_cross_entropy() -> bool:
    """Whether OpenRLHF's own function takes flash-attn's fp32 cross-entropy for fp32 /
    fp64 logits: it tries this import on every call."""
    try:
        import flash_attn.ops.triton.cross_entropy  # noqa: F401
    except ImportError:
        return False
    return True


_FUNCTIONS = {"log_probs_from_logits": log_probs_from_logits, "compute_entropy": compute_entropy}


@_patching.atomic
def patch_openrlhf() -> _patching.PatchHandle:
    """Make OpenRLHF's actor compute log-probs and entropy with exactlogp.

    Replaces `log_probs_from_logits` and `compute_entropy` in `openrlhf.models.utils` and
    in every OpenRLHF module that bound them by name (`openrlhf.models.actor`, whose
    `Actor.forward` calls them). Opt-in and idempotent (a second call returns the live
    handle); undo with `unpatch_openrlhf()` or `handle.undo()`. An OpenRLHF whose
    functions take other arguments than OpenRLHF 0.11.2's is refused (RuntimeError naming
    its version); ImportError without OpenRLHF (or without what `openrlhf.models`
    imports: deepspeed, flash-attn, peft, transformers), AttributeError naming a symbol
    this OpenRLHF moved. Nothing is changed then.
    """
    _patching.check_signatures(PATCH_KEY, "openrlhf", _DEFINED, _FUNCTIONS, KNOWN)
    sites = [_patching.Site(_DEFINED, n, f, everywhere=True) for n, f in _FUNCTIONS.items()]
    sites += [_patching.Site(_ACTOR, n, f) for n, f in _FUNCTIONS.items()]
    return _patching.apply(PATCH_KEY, sites)


@_patching.atomic
def unpatch_openrlhf() -> bool:
    """Restore OpenRLHF's own functions; False if `patch_openrlhf` was not applied."""
    return _patching.undo(PATCH_KEY)


def patch_from_env(vocab_size: int | None = None) -> _patching.PatchHandle:
    """EXACTLOGP_PATCH=openrlhf (exactlogp.integrations.autopatch): `patch_openrlhf()`."""
    del vocab_size  # every column of the model's logits counts, as in OpenRLHF
    return patch_openrlhf()
