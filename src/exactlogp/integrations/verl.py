"""verl drop-ins, with verl 0.9's names, arguments and output dtypes.

FSDP / torchtitan / automodel engines (`verl.utils.torch_functional`, full logits or a
DTensor sharded on the vocabulary):
- `logprobs_from_logits(logits, labels, inplace_backward=True)`, `logprobs_from_logits_v2`
- `entropy_from_logits(logits)`, `entropy_from_logits_with_chunking(logits, chunk_size=2048)`

Megatron engine (`verl.utils.megatron.tensor_parallel`, vocab-parallel logits in
Megatron's layout over its tensor-model-parallel group unless `tp_group` is given):
- `vocab_parallel_log_probs_from_logits`, `vocab_parallel_entropy`,
  `vocab_parallel_entropy_with_chunking`, and `vocab_parallel_log_probs_and_entropy`
  (both from one pass).

Fused kernels (`use_fused_kernels=True`), computed by `exactlogp.linear_selected_logprobs`:
- `FusedLinearForPPO` (`verl.utils.experimental.torch_functional`) and
  `linear_cross_entropy(hidden, weight, labels, temperature, reduction, dist_process_group)`
  (`verl.utils.kernel.linear_cross_entropy`, the Triton path and Megatron's fused forward).
  Under autocast (the FSDP engine's bf16 mixed precision) they compute in autocast's
  dtype, as verl's own kernels do.

Processed logprobs (rollouts sampled with top-k / top-p / min-p), opt-in:
`processed_logprobs_from_logits` (FSDP) and `vocab_parallel_processed_log_probs`
(Megatron) return `ProcessedReplay(logprobs, loss_mask, num_dropped)`: the log-softmax over
the kept set of the exact cut (`exactlogp.processed_logprobs`, docs/numerics.md section 13),
a target outside it 0 with a zero gradient, out of `loss_mask`, and counted.
`patch_verl(top_k=..., top_p=..., min_p=...)` makes the patched log-prob functions return
those processed logprobs (the cut's dropped targets 0 with a zero gradient; the count is
logged and kept in `dropped_tokens()`).

`patch_verl()` swaps all of them into verl. verl divides the logits by the temperature
itself, in their dtype, before these functions see them. Output dtypes are verl's: the
logits' dtype, except fp32 where verl's flash-attn / NPU cross-entropy would run and for
`entropy_from_logits_with_chunking`, the Megatron functions and the fused kernels
(`out_dtype=torch.float32` keeps exactlogp's fp32). fp64 logits are computed in fp64 with
plain torch (outside the contract).
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
import sys
import warnings
import weakref
from contextlib import nullcontext

import torch

from ..api import LogprobResult, selected_logprobs
from ..cut.api import processed_logprobs
from ..cut.options import scalar_cut
from ..linear import linear_selected_logprobs
from . import _patching, _rows, kept
from .megatron import ProcessedReplay, resolve_tp_group
from .megatron import processed_logprobs as _megatron_processed

logger = logging.getLogger(__name__)

PATCH_KEY = "patch_verl"


# --- FSDP / torchtitan / automodel: full (or DTensor) logits ---


def logprobs_from_logits(
    logits: torch.Tensor,
    labels: torch.Tensor,
    inplace_backward: bool = True,
    *,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """log_softmax(logits, -1) at `labels`, shaped like labels. `inplace_backward` is
    accepted for verl's signature: exactlogp never writes into the logits."""
    del inplace_backward
    out_dtype = _rows.check_out_dtype(out_dtype)
    logprobs, _ = _rows.one_id_per_row(_rows.check_tensor("logits", logits), labels)
    return _rows.cast(logprobs, _dtype(out_dtype, logits, fused_ce=True))


def logprobs_from_logits_v2(
    logits: torch.Tensor, labels: torch.Tensor, *, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """verl's memory-lean variant: the same values; the logits' dtype."""
    out_dtype = _rows.check_out_dtype(out_dtype)
    logprobs, _ = _rows.one_id_per_row(_rows.check_tensor("logits", logits), labels)
    return _rows.cast(logprobs, _dtype(out_dtype, logits))


def entropy_from_logits(
    logits: torch.Tensor, *, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Entropy of softmax(logits) per row, shaped logits.shape[:-1]; the logits' dtype."""
    out_dtype = _rows.check_out_dtype(out_dtype)
    return _rows.cast(_rows.entropy(logits), _dtype(out_dtype, logits))


def entropy_from_logits_with_chunking(logits: torch.Tensor, chunk_size: int = 2048) -> torch.Tensor:
    """The same entropy in fp32 (verl's chunked variant returns fp32); `chunk_size` is
    verl's memory knob and changes no bit (any leading shape is accepted)."""
    _rows.check_chunk_size(chunk_size)
    return _rows.cast(_rows.entropy(logits), torch.float32)


def _dtype(out_dtype, logits: torch.Tensor, fused_ce: bool = False) -> torch.dtype:
    if out_dtype is not None:
        return out_dtype
    if fused_ce and _verl_uses_fused_ce():
        return torch.float32
    return logits.dtype


def _verl_uses_fused_ce() -> bool:
    """Whether verl's own logprobs_from_logits would take its fp32 flash-attn / NPU path."""
    module = sys.modules.get("verl.utils.torch_functional")
    if module is not None:
        flash = getattr(module, "FLAH_ATTN_CROSS_ENTROPY_LOSS_AVAILABLE", False)
        npu = getattr(module, "NPU_CROSS_ENTROPY_LOSS_AVAILABLE", False)
    else:
        flash = importlib.util.find_spec("flash_attn") is not None
        npu = importlib.util.find_spec("torch_npu") is not None
    flash = flash and os.environ.get("VERL_DISABLE_FLASH_ATTN_CE", "0") != "1"
    return bool(flash or npu)


# --- Megatron engine: vocab-parallel logits ---


def vocab_parallel_log_probs_from_logits(
    logits: torch.Tensor, labels: torch.Tensor, *, tp_group=None, vocab_size: int | None = None
) -> torch.Tensor:
    """log softmax(logits)[labels] over the whole (sharded) vocabulary; shape of labels."""
    return _run(logits, labels, tp_group, vocab_size, with_entropy=False).logprobs


def vocab_parallel_entropy(
    vocab_parallel_logits: torch.Tensor, *, tp_group=None, vocab_size: int | None = None
) -> torch.Tensor:
    """Entropy of softmax(logits) over the whole (sharded) vocabulary; shape logits[..., 0]."""
    # Any id inside the vocabulary serves as the (unused) target; id 0 is always real.
    labels = torch.zeros(
        vocab_parallel_logits.shape[:-1], dtype=torch.int64, device=vocab_parallel_logits.device
    )
    return _run(vocab_parallel_logits, labels, tp_group, vocab_size, True, replay=False).entropy


def vocab_parallel_entropy_with_chunking(
    vocab_parallel_logits: torch.Tensor,
    chunk_size: int = 2048,
    *,
    tp_group=None,
    vocab_size: int | None = None,
) -> torch.Tensor:
    """`vocab_parallel_entropy`; `chunk_size` is verl's memory knob and changes no bit."""
    _rows.check_chunk_size(chunk_size)
    return vocab_parallel_entropy(vocab_parallel_logits, tp_group=tp_group, vocab_size=vocab_size)


def vocab_parallel_log_probs_and_entropy(
    logits: torch.Tensor, labels: torch.Tensor, *, tp_group=None, vocab_size: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs, entropy) from one pass over the logits and one pair of collectives."""
    result = _run(logits, labels, tp_group, vocab_size, with_entropy=True)
    return result.logprobs, result.entropy


def _run(logits, labels, tp_group, vocab_size, with_entropy: bool, replay=True) -> LogprobResult:
    """The labels' logprobs (and entropy) on Megatron's vocab shards; inside
    `kept.replaying` (`replay`: a call for the labels) over the rollout's kept sets."""
    _rows.check_tensor("logits", logits)
    group, vocab_start = resolve_tp_group(tp_group, logits)
    options = dict(tp_group=group, vocab_start=vocab_start, vocab_size=vocab_size,
                   with_entropy=with_entropy)  # fmt: skip
    found = kept.replayed(logits, labels, "verl's log-probs", **options) if replay else None
    if found is not None:
        return found
    return selected_logprobs(
        logits,
        labels,
        tp_group=group,
        vocab_start=vocab_start,
        vocab_size=vocab_size,
        with_entropy=with_entropy,
    )


# --- processed logprobs: the exact top-k / top-p / min-p cut ---


def processed_logprobs_from_logits(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    top_k: int | torch.Tensor | None = None,
    top_p: float | torch.Tensor | None = None,
    min_p: float | torch.Tensor | None = None,
    loss_mask: torch.Tensor | None = None,
) -> ProcessedReplay:
    """FSDP engines: the processed logprobs of `labels` on full logits that verl has
    already divided by the temperature (so the cut runs at temperature 1 on them):
    temperature, then min-p, top-k, top-p, renormalised over the kept set. verl's
    conventions: `top_k` -1 or 0 and `top_p` 1.0 are no cut. A label outside the kept set
    gets logprob 0 with a zero gradient and False in `loss_mask`; the count is logged."""
    _rows.check_tensor("logits", logits)
    res = processed_logprobs(logits, labels, top_k=top_k, top_p=top_p, min_p=min_p)
    kept = ~res.dropped
    logprobs = torch.where(kept, res.logprobs, torch.zeros_like(res.logprobs))
    _count_dropped(int(res.num_dropped), labels.numel())
    mask = kept if loss_mask is None else kept & loss_mask.to(torch.bool)
    return ProcessedReplay(logprobs, mask, res.num_dropped)


def vocab_parallel_processed_log_probs(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    top_k: int | torch.Tensor | None = None,
    top_p: float | torch.Tensor | None = None,
    min_p: float | torch.Tensor | None = None,
    tp_group=None,
    vocab_size: int | None = None,
    loss_mask: torch.Tensor | None = None,
) -> ProcessedReplay:
    """Megatron engine: `processed_logprobs_from_logits` on vocab-parallel logits in
    Megatron's layout (the group and vocabulary range as for
    `vocab_parallel_log_probs_from_logits`); the same bits at any TP degree."""
    _rows.check_tensor("logits", logits)
    out = _megatron_processed(
        logits, labels, top_k=top_k, top_p=top_p, min_p=min_p, tp_group=tp_group,
        vocab_size=vocab_size, loss_mask=loss_mask,
    )  # fmt: skip
    _count_dropped(int(out.num_dropped), 0, log=False)  # megatron's drop-in logged it
    return out


_DROPPED = {"tokens": 0}


def dropped_tokens(reset: bool = False) -> int:
    """Labels found outside the kept set by the processed functions in this process
    (since the last reset)."""
    n = _DROPPED["tokens"]
    if reset:
        _DROPPED["tokens"] = 0
    return n


def _count_dropped(dropped: int, total: int, log: bool = True) -> None:
    _DROPPED["tokens"] += dropped
    if dropped and log:
        logger.warning(
            "%d of %d labels lie outside the top-k / top-p / min-p kept set; their "
            "logprob is 0 with a zero gradient",
            dropped,
            total,
        )


def _processed_functions(cut: dict, vocab_size) -> dict:
    """The log-prob functions patch_verl installs when a cut is given: processed
    logprobs, with verl's signatures and output dtypes."""

    def logprobs_from_logits(logits, labels, inplace_backward=True, *, out_dtype=None):
        del inplace_backward
        out_dtype = _rows.check_out_dtype(out_dtype)
        got = processed_logprobs_from_logits(logits, labels, **cut).logprobs
        return _rows.cast(got, _dtype(out_dtype, logits, fused_ce=True))

    def logprobs_from_logits_v2(logits, labels, *, out_dtype=None):
        out_dtype = _rows.check_out_dtype(out_dtype)
        got = processed_logprobs_from_logits(logits, labels, **cut).logprobs
        return _rows.cast(got, _dtype(out_dtype, logits))

    def vocab_parallel_log_probs_from_logits(logits, labels, *, tp_group=None):
        return vocab_parallel_processed_log_probs(
            logits, labels, tp_group=tp_group, vocab_size=vocab_size, **cut
        ).logprobs

    for fn, doc in (
        (logprobs_from_logits, "verl's logprobs_from_logits, processed (patch_verl's cut)."),
        (logprobs_from_logits_v2, "verl's logprobs_from_logits_v2, processed."),
        (vocab_parallel_log_probs_from_logits, "the Megatron engine's log-probs, processed."),
    ):
        fn.__doc__ = doc
    return {
        "logprobs_from_logits": logprobs_from_logits,
        "logprobs_from_logits_v2": logprobs_from_logits_v2,
        "vocab_parallel_log_probs_from_logits": vocab_parallel_log_probs_from_logits,
    }


# --- fused kernels: hidden states and the LM-head weight ---


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    reduction: str = "none",
    dist_process_group=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's `linear_cross_entropy`: (log-probs, entropy) of softmax(hidden @ weight.T /
    temperature) at `labels`, both fp32 and flattened to (num_tokens,). With
    `dist_process_group`, `weight` is this rank's rows of a vocabulary split in
    Megatron's layout (rank r from r * V_local)."""
    if reduction != "none":
        raise ValueError(
            f"reduction={reduction!r} is not supported: verl calls it with 'none'; reduce "
            "the per-token values yourself"
        )
    temperature = _rows.check_positive_temperature(temperature)
    hidden = hidden.reshape(-1, hidden.shape[-1])
    kind = hidden.device.type
    context = nullcontext()
    if torch.is_autocast_enabled(kind):
        # verl's own kernels run their matmul under the engine's autocast (FSDP's default
        # bf16 mixed precision keeps the weight in fp32): compute in autocast's dtype too.
        dtype = torch.get_autocast_dtype(kind)
        hidden, weight = hidden.to(dtype), weight.to(dtype)
        context = torch.autocast(kind, enabled=False)
    with context:
        result = linear_selected_logprobs(
            hidden,
            weight,
            labels.reshape(-1).to(torch.int64),
            tp_group=dist_process_group,
            temperature=temperature,
            with_entropy=True,
        )
    return result.logprobs, result.entropy


class FusedLinearForPPO(torch.nn.Module):
    """verl's `FusedLinearForPPO`: forward(hidden_states (..., H), vocab_weights (V, H),
    input_ids (...), temperature) -> (log_probs fp32, entropy in the hidden dtype), as
    verl's torch backend returns them. `chunk_size` and `impl_backend` change no bit."""

    def __init__(self, chunk_size: int = 512, impl_backend: str = "torch"):
        super().__init__()
        if impl_backend not in ("torch", "liger"):
            raise ValueError(f"impl_backend must be 'torch' or 'liger', got {impl_backend!r}")
        self.chunk_size = _rows.check_chunk_size(chunk_size)
        self.impl_backend = impl_backend

    def forward(self, hidden_states, vocab_weights, input_ids, temperature: float = 1.0):
        shape = input_ids.shape
        log_probs, entropy = linear_cross_entropy(
            hidden_states, vocab_weights, input_ids, float(temperature)
        )
        return log_probs.view(shape), entropy.view(shape).to(hidden_states.dtype)


# --- patching verl ---

# Engines seen holding exactlogp's entropy function while patch_verl() was live (weak
# references): unpatch_verl() cannot give them verl's back, so it names those still alive.
_ENGINES_WHILE_PATCHED: weakref.WeakSet = weakref.WeakSet()

_ENGINES = (
    ("verl.workers.engine.fsdp.transformer_impl", "FSDPEngineWithLMHead"),
    ("verl.workers.engine.veomni.transformer_impl", "VeOmniEngineWithLMHead"),
    ("verl.workers.engine.torchtitan.transformer_impl", "TorchTitanEngineWithLMHead"),
    ("verl.workers.engine.automodel.transformer_impl", "AutomodelEngineWithLMHead"),
)


@_patching.atomic
def patch_verl(
    *,
    vocab_size: int | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
) -> _patching.PatchHandle:
    """Make verl 0.9's engines compute log-probs and entropy with exactlogp.

    Replaces, in verl and in every verl module that bound them by name:
    - `verl.utils.torch_functional`: `logprobs_from_logits`, `logprobs_from_logits_v2`,
      `entropy_from_logits`, `entropy_from_logits_with_chunking` (FSDP, VeOmni,
      torchtitan and automodel engines, `core_algos`, prefix grouper, naive rollout);
    - `verl.utils.megatron.tensor_parallel`: `vocab_parallel_log_probs_from_logits`,
      `vocab_parallel_entropy`, `vocab_parallel_entropy_with_chunking` (Megatron engine;
      needs megatron-core; `vocab_size` leaves Megatron's padding columns out);
    - `use_fused_kernels=True`: `verl.utils.experimental.torch_functional.FusedLinearForPPO`
      and `verl.utils.kernel.linear_cross_entropy.linear_cross_entropy` (with its copies in
      `verl.models.mcore`).

    Engines bind their entropy function (possibly `torch.compile`d) when they are built:
    patch before building them. An engine built earlier is detected at its next
    `prepare_model_outputs`, given exactlogp's function (compiled as its own was) and a
    RuntimeWarning. Sites whose module does not import here (an engine whose own
    dependencies are missing) are skipped and listed in `handle.skipped`.

    `vocab_size`: None or an int >= 1 (TypeError / ValueError otherwise).

    `top_k` / `top_p` / `min_p` (opt-in; the rollout's `actor_rollout_ref.rollout`
    settings): the log-prob functions above return processed logprobs under that cut
    (`processed_logprobs_from_logits`); labels outside the kept set give 0 with a zero
    gradient, are logged and counted in `dropped_tokens()`. The fused kernels
    (`use_fused_kernels=True`) have no logits to cut: with a cut they raise ValueError.

    Opt-in and idempotent; undo with `unpatch_verl()` or `handle.undo()`.
    """
    vocab_size = _rows.check_vocab_size(vocab_size)
    megatron = _megatron_functions(vocab_size)
    cut = scalar_cut(top_k, top_p, min_p)
    full = {"logprobs_from_logits": logprobs_from_logits,
            "logprobs_from_logits_v2": logprobs_from_logits_v2}  # fmt: skip
    fused, fused_ce = FusedLinearForPPO, linear_cross_entropy
    if cut:
        processed = _processed_functions(cut, vocab_size)
        full = {name: processed[name] for name in full}
        megatron["vocab_parallel_log_probs_from_logits"] = processed[
            "vocab_parallel_log_probs_from_logits"
        ]
        fused, fused_ce = _refuse_fused(FusedLinearForPPO), _refuse_fused(linear_cross_entropy)
    sites = [
        _patching.Site("verl.utils.torch_functional", name, fn, everywhere=True)
        for name, fn in (
            *full.items(),
            ("entropy_from_logits", entropy_from_logits),
            ("entropy_from_logits_with_chunking", entropy_from_logits_with_chunking),
        )
    ]
    sites += [
        _patching.Site("verl.utils.experimental.torch_functional", "FusedLinearForPPO",
                       fused, everywhere=True),
        _patching.Site("verl.utils.kernel.linear_cross_entropy", "linear_cross_entropy",
                       fused_ce, everywhere=True),
    ]  # fmt: skip
    sites += [
        _patching.Site(
            "verl.utils.megatron.tensor_parallel", name, fn, optional=True, everywhere=True
        )
        for name, fn in megatron.items()
    ]
    sites += [
        _patching.Site(
            module, f"{cls}.prepare_model_outputs", _entropy_guard, wraps=True, optional=True
        )
        for module, cls in _ENGINES
    ]
    options = {"vocab_size": vocab_size, **{k: _option(v) for k, v in cut.items()}}
    return _patching.apply(PATCH_KEY, sites, options, on_undo=_warn_left_behind)


def patch_from_env(vocab_size: int | None = None) -> _patching.PatchHandle:
    """EXACTLOGP_PATCH=verl (exactlogp.integrations.autopatch): `patch_verl` with
    EXACTLOGP_VOCAB_SIZE as its `vocab_size`."""
    return patch_verl(vocab_size=vocab_size)


def _option(value):
    return value if not isinstance(value, torch.Tensor) else value.tolist()


def _refuse_fused(host):
    message = (
        "use_fused_kernels=True has no logits to cut: with patch_verl(top_k / top_p / min_p) "
        "set use_fused_kernels=False (the engine then materialises the logits)"
    )
    if isinstance(host, type):

        class Refused(host):
            def forward(self, *args, **kwargs):
                raise ValueError(message)

        Refused.__name__ = Refused.__qualname__ = host.__name__
        return Refused

    @functools.wraps(host)
    def refused(*args, **kwargs):
        raise ValueError(message)

    return refused


@_patching.atomic
def unpatch_verl() -> bool:
    """Restore verl's own functions; False if `patch_verl` was not applied. An engine built
    (or run) while patched keeps exactlogp's entropy function, bound on the engine; a
    RuntimeWarning names those still alive that ran a forward while patched."""
    return _patching.undo(PATCH_KEY)


def _warn_left_behind() -> None:
    _patching.warn_kept(
        _ENGINES_WHILE_PATCHED, "unpatch_verl",
        "exactlogp's entropy function (bound on each engine when it was built or first run)",
        "Build the engines again after unpatch_verl() for verl's own entropy.",
    )  # fmt: skip


def _megatron_functions(vocab_size) -> dict:
    if vocab_size is None:
        return {
            "vocab_parallel_log_probs_from_logits": vocab_parallel_log_probs_from_logits,
            "vocab_parallel_entropy": vocab_parallel_entropy,
            "vocab_parallel_entropy_with_chunking": vocab_parallel_entropy_with_chunking,
        }
    return {
        name: functools.wraps(fn)(functools.partial(fn, vocab_size=vocab_size))
        for name, fn in (
            ("vocab_parallel_log_probs_from_logits", vocab_parallel_log_probs_from_logits),
            ("vocab_parallel_entropy", vocab_parallel_entropy),
            ("vocab_parallel_entropy_with_chunking", vocab_parallel_entropy_with_chunking),
        )
    }


def _entropy_guard(original):
    @functools.wraps(original)
    def prepare_model_outputs(self, *args, **kwargs):
        _rebind_entropy(self)
        return original(self, *args, **kwargs)

    return prepare_model_outputs


def _rebind_entropy(engine) -> None:
    bound = engine.__dict__.get("compute_entropy_from_logits")
    handle = _patching.active(PATCH_KEY)
    if bound is None or handle is None:
        return
    base = getattr(bound, "_torchdynamo_orig_callable", bound)
    plain = handle.original("verl.utils.torch_functional.entropy_from_logits")
    chunked = handle.original("verl.utils.torch_functional.entropy_from_logits_with_chunking")
    if base in (entropy_from_logits, entropy_from_logits_with_chunking):
        _ENGINES_WHILE_PATCHED.add(engine)  # built while patched
    if base is not plain and base is not chunked:
        return  # exactlogp's already, or the user's own
    _ENGINES_WHILE_PATCHED.add(engine)
    ours = entropy_from_logits_with_chunking if base is chunked else entropy_from_logits
    engine.compute_entropy_from_logits = (
        torch.compile(ours, dynamic=True) if base is not bound else ours
    )
    warnings.warn(
        f"{type(engine).__name__} was built before patch_verl(): its entropy function was "
        "verl's own and is now exactlogp's; call patch_verl() before building engines",
        RuntimeWarning,
        stacklevel=3,
    )
