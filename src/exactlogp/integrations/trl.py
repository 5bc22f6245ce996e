"""TRL drop-ins, with TRL 1.16's names, arguments and output dtypes.

On full logits (`trl.trainer.utils`):
- `selective_log_softmax(logits, index, temperature=1.0, row_mask=None)`: index (...) or
  (..., K); rows where `row_mask == 0` give 0.
- `selective_log_softmax_and_entropy(logits, index, entropy_requires_grad=True,
  temperature=1.0, row_mask=None)`: both from one pass.
- `entropy_from_logits(logits, chunk_size=128)`.

On hidden states and the LM-head weight (the fused head every TRL 1.16 trainer uses):
- `ChunkedLogProbFunction.apply(...)`, the 9-argument, 5-output form of
  `trl.kernels.ChunkedLogProbFunction`, and `add_fused_lm_head(model, temperature,
  cast_lm_head_to_fp32, outputs)`, computed by `exactlogp.linear_selected_logprobs`.

`patch_trl()` swaps all of them into TRL, in every module that bound them.

Processed logprobs (`patch_trl(processed=True)`, opt-in): `GRPOTrainer` scores the policy,
old and reference logprobs as the log-softmax over the kept set of the exact temperature /
min-p / top-k / top-p cut (`exactlogp.processed_logprobs`, docs/numerics.md section 13),
with the trainer's `GRPOConfig` `temperature`, `top_k`, `top_p`, `min_p`: what a rollout
engine that reports processed logprobs (vLLM's `processed_logprobs`) computes. A completion
token outside the trainer's kept set gets logprob 0 with a zero gradient and is removed
from the loss (its `tool_mask` entry, the mask TRL's loss and metrics multiply in), and
the count is logged (metrics `exactlogp/dropped_tokens/policy` and `.../old_ref`). The fused LM head computes the logits
(`exactlogp.linear_logits`) in row blocks for this, checkpointed under autograd.
`processed_selective_log_softmax` is the same on full logits.

Values: every bf16 / fp16 / fp32 result is exactlogp's (`exactlogp.CONTRACT`): the
temperature divides fp32(logits) by IEEE division (as TRL's GPU kernel does, and as a
rollout engine's processed logprobs do), not the logits in their own dtype (TRL's CPU
path). Output dtype: TRL's -- fp32 where TRL would run its Triton kernel (a CUDA / XPU
device with Triton, at most 3-D logits, one id per row), the logits' dtype elsewhere;
`out_dtype=torch.float32` keeps exactlogp's fp32 everywhere. fp64 logits are outside the
contract and computed in fp64 with plain torch (accurate, not bit-invariant); so are fp64
hidden states in the fused head (an fp64 model without autocast), whose results are
TRL's fp32. Ids equal to -100 give 0 (TRL's gather raises on them).
"""

from __future__ import annotations

import contextvars
import functools
import importlib
import logging
import types
import weakref
from contextlib import nullcontext

import torch

from ..cut.api import processed_logprobs
from ..cut.options import scalar_cut
from ..linear import linear_logits, linear_selected_logprobs
from ..validation import LOGIT_DTYPES
from . import _patching, _rows
from ._dtensor import is_dtensor

logger = logging.getLogger(__name__)

PATCH_KEY = "patch_trl"
DROPPED_METRIC = "exactlogp/dropped_tokens"  # + "/policy" or "/old_ref", per batch
OPTIONAL_OUTPUTS = ("entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
FUSED_OUTPUTS = ("log_probs", *OPTIONAL_OUTPUTS)
_ROW_BLOCK = 1024  # rows of (N, V) fp32 logits materialised at once for mean_logits / is_top1
# Models given exactlogp's fused head while patch_trl() was live: an unpatch cannot give
# them TRL's head back, so it warns about those still alive (weak: no model is kept).
_HEADS_WHILE_PATCHED: weakref.WeakSet = weakref.WeakSet()


# --- full logits ---


def selective_log_softmax(
    logits: torch.Tensor,
    index: torch.Tensor,
    temperature: float = 1.0,
    row_mask: torch.Tensor | None = None,
    *,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """log_softmax(logits / temperature, -1) gathered at `index`, shaped like `index`.

    Args:
        logits: (..., V).
        index: (...) one id per row, or (..., K) K ids per row (each its own exact pass).
        temperature: > 0.
        row_mask: shaped like `index` (or like logits.shape[:-1] with a (..., K) index);
            rows where it is 0 give exactly 0 and no gradient.
        out_dtype: None for TRL's dtype (see the module docstring), or a dtype.
    """
    out_dtype = _rows.check_out_dtype(out_dtype)
    temperature = _rows.check_positive_temperature(temperature)
    logprobs = _rows.k_ids_per_row(logits, index, temperature=temperature, row_mask=row_mask)
    return _rows.cast(logprobs, _dtype(out_dtype, logits, index))


def selective_log_softmax_and_entropy(
    logits: torch.Tensor,
    index: torch.Tensor,
    entropy_requires_grad: bool = True,
    temperature: float = 1.0,
    row_mask: torch.Tensor | None = None,
    *,
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probabilities at `index`, entropy) of softmax(logits / temperature), one id
    per row, from one pass; both 0 where `row_mask == 0`. With
    `entropy_requires_grad=False` the entropy is detached."""
    out_dtype = _rows.check_out_dtype(out_dtype)
    temperature = _rows.check_positive_temperature(temperature)
    _check_one_id_per_row(logits, index)
    logprobs, entropy = _rows.one_id_per_row(
        logits, index, temperature=temperature, row_mask=row_mask, with_entropy=True
    )
    if not entropy_requires_grad:
        entropy = entropy.detach()
    dtype = _dtype(out_dtype, logits, index)
    return _rows.cast(logprobs, dtype), _rows.cast(entropy, dtype)


def kernel_selective_log_softmax_and_entropy(
    logits: torch.Tensor,
    index: torch.Tensor,
    temperature: float = 1.0,
    row_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`trl.kernels.selective_log_softmax_and_entropy`, TRL's Triton kernel (the temperature
    third, no entropy_requires_grad): (log-probabilities at `index`, entropy), fp32 as the
    kernel returns them, both 0 where `row_mask == 0`."""
    temperature = _rows.check_positive_temperature(temperature)
    _check_one_id_per_row(logits, index)
    return _rows.one_id_per_row(
        logits, index, temperature=temperature, row_mask=row_mask, with_entropy=True
    )


def entropy_from_logits(
    logits: torch.Tensor, chunk_size: int = 128, *, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Entropy (nats) of softmax(logits) per row, shaped logits.shape[:-1].

    `chunk_size` is TRL's memory knob; exactlogp already bounds its memory per row block,
    and no chunking changes a bit.
    """
    out_dtype = _rows.check_out_dtype(out_dtype)
    _rows.check_chunk_size(chunk_size)
    return _rows.cast(
        _rows.entropy(logits), _dtype(out_dtype, _rows.check_tensor("logits", logits))
    )


def processed_selective_log_softmax(
    logits: torch.Tensor,
    index: torch.Tensor,
    temperature: float = 1.0,
    *,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
    row_mask: torch.Tensor | None = None,
):
    """The processed logprobs (temperature, then the exact min-p / top-k / top-p cut,
    renormalised over the kept set) of `index` (...), one id per row, on full logits
    (..., V); TRL's conventions: `top_k` 0 and `top_p` 1.0 mean no cut, `min_p` None.

    Returns `ProcessedReplay(logprobs, loss_mask, num_dropped)` (fp32): an id outside the
    kept set gives logprob 0 with a zero gradient and False in `loss_mask` (also False
    where `row_mask == 0`, whose logprob is 0), never -inf or NaN; the count is logged."""
    from .megatron import ProcessedReplay

    _rows.check_positive_temperature(temperature)
    _check_one_id_per_row(logits, index)
    keep = torch.ones(index.shape, dtype=torch.bool, device=index.device)
    if row_mask is not None:
        if tuple(row_mask.shape) != tuple(index.shape):
            raise ValueError(
                f"row_mask shape {tuple(row_mask.shape)} must equal index shape "
                f"{tuple(index.shape)}"
            )
        keep = row_mask.to(device=index.device) != 0
    ids = torch.where(keep, index.to(torch.int64), torch.full_like(index, -100, dtype=torch.int64))
    res = processed_logprobs(
        logits, ids, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p
    )
    kept = ~res.dropped
    logprobs = torch.where(kept, res.logprobs, torch.zeros_like(res.logprobs))
    _log_dropped(int(res.num_dropped), index.numel())
    return ProcessedReplay(logprobs, kept & keep, res.num_dropped)


def _log_dropped(dropped: int, total: int) -> None:
    if dropped:
        logger.warning(
            "%d of %d target tokens lie outside the top-k / top-p / min-p kept set; they "
            "are masked out of the loss",
            dropped,
            total,
        )


def _dtype(out_dtype, logits: torch.Tensor, index: torch.Tensor | None = None) -> torch.dtype:
    if out_dtype is not None:
        return out_dtype
    kernel = (
        logits.device.type in ("cuda", "xpu")
        and logits.dtype in LOGIT_DTYPES
        and 1 <= logits.dim() <= 3
        and (index is None or tuple(index.shape) == tuple(logits.shape[:-1]))
        and _rows.triton_installed()
    )
    return torch.float32 if kernel else logits.dtype


# --- the fused LM head ---


def chunked_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    temperature: float,
    chunk_size: int = 4096,
    final_logit_softcapping: float | None = None,
    logit_scale: float = 1.0,
    outputs: tuple[str, ...] = OPTIONAL_OUTPUTS,
) -> tuple[torch.Tensor, ...]:
    """TRL 1.16's `ChunkedLogProbFunction` contract, computed by exactlogp.

    Args:
        hidden: (N, H); weight: (V, H) (a DTensor is gathered whole, as TRL does);
        bias: (V,) or None; targets: (N,) ids in [0, V) (-100 gives 0).
        temperature, logit_scale: z = (hidden @ weight.T + bias) * logit_scale / temperature.
        chunk_size: TRL's tile width; no effect on a bit here.
        final_logit_softcapping: must be None (refused: outside the contract).
        outputs: which of OPTIONAL_OUTPUTS to compute; the others are None.
    Returns:
        (log_probs, entropy, log_sum_sq_probs, mean_logits, is_top1), each (N,): fp32
        (is_top1 bool). fp64 hidden states (outside the contract) are computed in fp64 with
        plain torch, accurate but not bit-invariant, and returned in fp32 as TRL does. log_probs and entropy are exactlogp's and differentiable with
        respect to hidden, weight and bias; log_sum_sq_probs (log sum_v p_v^2, from the
        log-sum-exp at temperature / 2: lse(2z) - 2 lse(z)), mean_logits (mean of z over
        the vocabulary, summed in fp64) and is_top1 (target == argmax z, ties to the
        lowest id) carry no gradient.
    """
    _check_outputs(outputs, allowed=OPTIONAL_OUTPUTS + ("log_probs",))
    if final_logit_softcapping is not None:
        raise ValueError(
            f"final_logit_softcapping={final_logit_softcapping!r} is not supported: "
            "tanh soft-capping of the logits is outside exactlogp's linear-logits contract; "
            "use TRL's own fused head (unpatch_trl()) for this model"
        )
    _rows.check_positive_temperature(temperature)
    compute = _compute_dtype(hidden)
    if compute == torch.float64:
        return _fp64_chunked(hidden, weight, bias, targets, temperature, logit_scale, outputs)
    with _no_autocast(hidden.device):
        hidden = hidden.to(compute)
        head = _head(weight, bias, compute)
        result = linear_selected_logprobs(
            hidden,
            head.weight,
            targets,
            bias=head.bias,
            temperature=temperature,
            logit_scale=logit_scale,
            with_entropy="entropy" in outputs,
        )
        extras = _extras(result, hidden, head, targets, temperature, logit_scale, outputs)
    entropy = result.entropy if "entropy" in outputs else None
    return (result.logprobs, entropy, *extras)


def _fp64_chunked(hidden, weight, bias, targets, temperature, logit_scale, outputs):
    """`chunked_logprobs` for fp64 hidden states: outside the contract (bf16, fp16, fp32),
    computed in fp64 with plain torch -- accurate, not bit-invariant -- and returned in
    TRL's dtypes (fp32, is_top1 bool). Row blocks are checkpointed, so the (rows, V) fp64
    logits of one block at a time are held, in the forward and in the backward."""
    from torch.utils.checkpoint import checkpoint

    weight = (weight.full_tensor() if is_dtensor(weight) else weight).to(torch.float64)
    if bias is not None:
        bias = (bias.full_tensor() if is_dtensor(bias) else bias).to(torch.float64)
    hidden = hidden.to(torch.float64)
    valid = targets != -100
    ids = targets.masked_fill(~valid, 0).unsqueeze(-1)
    want_entropy = "entropy" in outputs

    def block(h, i):
        z = torch.nn.functional.linear(h, weight, bias) * logit_scale / temperature
        logp = torch.log_softmax(z, -1)
        picked = logp.gather(-1, i)[..., 0]
        ent = -(logp.exp() * logp).sum(-1) if want_entropy else picked.new_zeros(())
        return picked, ent

    picked, ents, sq, means, tops = [], [], [], [], []
    for lo in range(0, hidden.shape[0], _ROW_BLOCK):
        h, i = hidden[lo : lo + _ROW_BLOCK], ids[lo : lo + _ROW_BLOCK]
        if torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (h, weight, bias)
        ):
            p, e = checkpoint(block, h, i, use_reentrant=False)
        else:
            p, e = block(h, i)
        picked.append(p)
        ents.append(e)
        with torch.no_grad():
            z = torch.nn.functional.linear(h, weight, bias) * logit_scale / temperature
            if "log_sum_sq_probs" in outputs:
                sq.append(torch.logsumexp(2 * z, -1) - 2 * torch.logsumexp(z, -1))
            if "mean_logits" in outputs:
                means.append(z.mean(-1))
            if "is_top1" in outputs:
                tops.append(z.argmax(-1) == targets[lo : lo + _ROW_BLOCK])

    def cat(parts, wanted, mask=False):
        if not wanted:
            return None
        out = torch.cat(parts) if parts else hidden.new_empty((0,))
        if mask:  # -100 gives 0, as exactlogp's log_probs and entropy do
            out = out.masked_fill(~valid, 0)
        return out if out.dtype == torch.bool else out.to(torch.float32)

    top = (torch.cat(tops) if tops else valid[:0]) if "is_top1" in outputs else None
    return (
        cat(picked, True, mask=True),
        cat(ents, want_entropy, mask=True),
        cat(sq, "log_sum_sq_probs" in outputs),
        cat(means, "mean_logits" in outputs),
        top,
    )


def processed_head_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    temperature: float,
    *,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
    logit_scale: float = 1.0,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """The fused head's processed logprobs: (log_probs, entropy or None, dropped), each (N,).

    The cut needs the logits of a whole row, so the head computes them with
    `exactlogp.linear_logits` (contract exactlogp-linear-v2) in blocks of rows and takes
    `exactlogp.processed_logprobs` of each block at `temperature`; under autograd each
    block is checkpointed (its logits recomputed in the backward), so one block's logits
    are held at a time. With no cut the log_probs equal `chunked_logprobs`' bit for bit.
    A target outside the kept set gives log_probs 0 with a zero gradient and dropped True;
    -100 gives 0 (not dropped). `entropy` is the processed distribution's (kept set)."""
    from torch.utils.checkpoint import checkpoint

    _rows.check_positive_temperature(temperature)
    compute = _compute_dtype(hidden)  # autocast's dtype, read before autocast is turned off
    if compute == torch.float64:
        raise ValueError(
            "processed logprobs need the contract's logits: fp64 hidden states are outside "
            "it; run the model in bf16, fp16 or fp32"
        )
    with _no_autocast(hidden.device):
        hidden = hidden.to(compute)
        head = _head(weight, bias, compute)

        def block(h, t):
            z = linear_logits(h, head.weight, head.bias, logit_scale=logit_scale)
            res = processed_logprobs(
                z, t, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                with_entropy=with_entropy,
            )  # fmt: skip
            lp = torch.where(res.dropped, torch.zeros_like(res.logprobs), res.logprobs)
            ent = res.entropy if with_entropy else lp.new_zeros(())
            return lp, ent, res.dropped

        grad = torch.is_grad_enabled() and any(
            x is not None and x.requires_grad for x in (hidden, head.weight, head.bias)
        )
        parts = []
        for lo in range(0, hidden.shape[0], _ROW_BLOCK):
            h, t = hidden[lo : lo + _ROW_BLOCK], targets[lo : lo + _ROW_BLOCK]
            parts.append(checkpoint(block, h, t, use_reentrant=False) if grad else block(h, t))
    if not parts:
        empty = hidden.new_zeros((0,), dtype=torch.float32)
        return empty, (empty if with_entropy else None), empty.bool()
    log_probs = torch.cat([p[0] for p in parts])
    entropy = torch.cat([p[1] for p in parts]) if with_entropy else None
    return log_probs, entropy, torch.cat([p[2] for p in parts])


class ChunkedLogProbFunction:
    """Stands in for `trl.kernels.ChunkedLogProbFunction` (TRL calls `.apply(...)`)."""

    apply = staticmethod(chunked_logprobs)


def add_fused_lm_head(
    model,
    temperature: float = 1.0,
    cast_lm_head_to_fp32: bool = False,
    outputs: tuple[str, ...] = ("log_probs",),
) -> None:
    """TRL 1.16's `add_fused_lm_head`, computed by exactlogp.

    After it, `model(..., labels=labels, fused_lm_head=True)` returns TRL's
    `FusedCausalLMOutput`: per-token `log_probs` (and the `outputs` asked for) of the
    next-token labels, shaped (B, L - 1) -- or (B, L) with pre-shifted `shift_labels` --
    0 where the label is -100, `label_mask`, and `loss` = -sum(log_probs) /
    (`num_items_in_batch` or the number of labels), plus the MoE load-balancing loss when
    the config asks for router logits. Without `fused_lm_head=True` the model's own
    forward runs. The config's logit scale (`logit_scale`, `output_multiplier`,
    `lm_head_multiplier`, 1 / `logits_scaling` -- a multiplier for HyperCLOVA X) is read
    once, now; `final_logit_softcapping` is refused (ValueError) now.
    """
    _rows.check_positive_temperature(temperature)
    _check_outputs(outputs, allowed=FUSED_OUTPUTS)
    text_config = model.config.get_text_config()
    softcap = getattr(text_config, "final_logit_softcapping", None)
    if softcap is not None:
        raise ValueError(
            f"final_logit_softcapping={softcap!r} in the model config is not supported: tanh "
            "soft-capping is outside exactlogp's linear-logits contract"
        )
    logit_scale = _config_logit_scale(text_config)
    kernel_outputs = tuple(name for name in OPTIONAL_OUTPUTS if name in outputs)
    original_forward = model.forward
    backbone = _backbone_attr(model, text_config)

    @functools.wraps(type(model).forward)  # generate() checks kwargs against the signature
    def forward(self, *args, fused_lm_head=False, labels=None, shift_labels=None,
                num_items_in_batch=None, **kwargs):  # fmt: skip
        if not fused_lm_head:
            for name, value in (("labels", labels), ("shift_labels", shift_labels),
                                ("num_items_in_batch", num_items_in_batch)):  # fmt: skip
                if value is not None:
                    kwargs[name] = value
            return original_forward(*args, **kwargs)
        return _fused_forward(
            self, backbone, text_config, args, kwargs, labels, shift_labels, num_items_in_batch,
            temperature, cast_lm_head_to_fp32, logit_scale, kernel_outputs,
        )  # fmt: skip

    model.forward = types.MethodType(forward, model)
    if _patching.active(PATCH_KEY) is not None:
        _HEADS_WHILE_PATCHED.add(model)


def _fused_forward(model, backbone, text_config, args, kwargs, labels, shift_labels,
                   num_items_in_batch, temperature, cast_to_fp32, logit_scale, outputs):  # fmt: skip
    _refuse_zero3()
    kwargs["use_cache"] = False
    if getattr(text_config, "output_router_logits", False):
        kwargs.setdefault("output_router_logits", True)
    states = getattr(model, backbone)(*args, **kwargs)
    if shift_labels is None:
        if labels is None:
            raise ValueError("fused_lm_head=True needs labels (or shift_labels)")
        hidden, labels = states.last_hidden_state[:, :-1], labels[:, 1:]
    else:
        hidden, labels = states.last_hidden_state, shift_labels
    head = model.get_output_embeddings()
    hidden = hidden.to(head.weight.device)
    labels = labels.to(head.weight.device)
    mask = labels != -100
    context = nullcontext()
    if cast_to_fp32:
        hidden = hidden.float()
        context = _no_autocast(hidden.device)
    replay = _REPLAY.get()
    if replay is not None:
        per_token = _processed_forward(
            replay, hidden, head, labels, mask, temperature, logit_scale, outputs, context
        )
    else:
        with context:
            per_token = chunked_logprobs(
                hidden.reshape(-1, hidden.shape[-1]),
                head.weight,
                head.bias,
                labels.reshape(-1),  # -100 gives 0 and no gradient
                temperature,
                4096,
                None,
                logit_scale,
                outputs,
            )
    log_probs, entropy, log_sum_sq, mean_logits, is_top1 = (
        None if x is None else x.view(mask.shape).masked_fill(~mask, 0) for x in per_token
    )
    denominator = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
    loss = -log_probs.sum() / denominator
    aux_loss = None
    if kwargs.get("output_router_logits"):
        aux_loss = _router_aux_loss(model, text_config, states, kwargs.get("attention_mask"))
        loss = loss + getattr(text_config, "router_aux_loss_coef", 0.0) * aux_loss
    from trl.trainer.utils import FusedCausalLMOutput

    return FusedCausalLMOutput(
        loss=loss, log_probs=log_probs, entropy=entropy, log_sum_sq_probs=log_sum_sq,
        mean_logits=mean_logits, is_top1=is_top1, label_mask=mask, aux_loss=aux_loss,
    )  # fmt: skip


def _processed_forward(replay, hidden, head, labels, mask, temperature, logit_scale,
                       outputs, context):  # fmt: skip
    extra = [name for name in outputs if name != "entropy"]
    if extra:
        raise ValueError(
            f"outputs {extra} are not computed with processed logprobs (patch_trl("
            "processed=True)); ask only for log_probs and entropy"
        )
    with context:
        log_probs, entropy, dropped = processed_head_logprobs(
            hidden.reshape(-1, hidden.shape[-1]), head.weight, head.bias, labels.reshape(-1),
            temperature, **replay.cut,
            logit_scale=logit_scale, with_entropy="entropy" in outputs,
        )  # fmt: skip
    replay.dropped.append(dropped.view(mask.shape) & mask)
    return log_probs, entropy, None, None, None


class _Head(types.SimpleNamespace):
    """weight (V, H) and bias (V,) or None, whole, in the compute dtype."""


def _head(weight, bias, compute) -> _Head:
    """The head as TRL's own fused head takes it: a DTensor weight or bias (FSDP2 shards
    them on their rows) gathered whole with `full_tensor()` -- whose backward gives each
    rank the rows of the gradient it holds -- so each rank computes its own rows of data
    over the whole vocabulary. Treating the shards as a tensor-parallel group instead
    would pair ranks whose hidden states differ (data parallelism)."""
    weight = weight.full_tensor() if is_dtensor(weight) else weight
    if bias is not None and is_dtensor(bias):
        bias = bias.full_tensor()
    return _Head(weight=weight.to(compute), bias=None if bias is None else bias.to(compute))


def _extras(result, hidden, head, targets, temperature, logit_scale, outputs):
    log_sum_sq = mean_logits = is_top1 = None
    with torch.no_grad():
        if "log_sum_sq_probs" in outputs:
            # log sum_v p_v^2 = lse(2 z) - 2 lse(z), and 2 z is z at temperature / 2 exactly
            # (halving a float is exact), so both terms are exactlogp's log-sum-exp.
            half = linear_selected_logprobs(
                hidden, head.weight, targets, bias=head.bias, temperature=temperature / 2,
                logit_scale=logit_scale,
            )  # fmt: skip
            log_sum_sq = half.lse - 2 * result.lse.detach()
        if "mean_logits" in outputs or "is_top1" in outputs:
            mean_logits, is_top1 = _logit_stats(
                hidden, head, targets, temperature, logit_scale, outputs
            )
    return log_sum_sq, mean_logits, is_top1


def _logit_stats(hidden, head, targets, temperature, logit_scale, outputs):
    means, tops = [], []
    for lo in range(0, hidden.shape[0], _ROW_BLOCK):
        z = linear_logits(
            hidden[lo : lo + _ROW_BLOCK], head.weight, head.bias, logit_scale=logit_scale
        )
        z = z.to(torch.float32) / temperature
        if "mean_logits" in outputs:
            means.append((z.double().sum(-1) / z.shape[-1]).to(torch.float32))
        if "is_top1" in outputs:
            tops.append(z.argmax(-1) == targets[lo : lo + _ROW_BLOCK])
    empty = hidden.new_empty((0,), dtype=torch.float32)
    mean = (torch.cat(means) if means else empty) if "mean_logits" in outputs else None
    top = (torch.cat(tops) if tops else empty.bool()) if "is_top1" in outputs else None
    return mean, top


def _check_outputs(outputs, allowed) -> None:
    if isinstance(outputs, str) or not all(isinstance(o, str) for o in outputs):
        raise TypeError(f"outputs must be a tuple of names, got {outputs!r}")
    unknown = [o for o in outputs if o not in allowed]
    if unknown:
        raise ValueError(f"outputs {unknown} are unknown; choose among {allowed}")


def _config_logit_scale(config) -> float:
    for name in ("logit_scale", "output_multiplier", "lm_head_multiplier"):
        value = getattr(config, name, None)
        if value is not None:
            return float(value)
    scaling = getattr(config, "logits_scaling", None)
    if scaling is not None:
        # Granite and MiniCPM3 divide by it; HyperCLOVA X multiplies by it.
        return float(scaling) if config.model_type == "hyperclovax" else 1 / float(scaling)
    return 1.0


def _backbone_attr(model, text_config) -> str:
    if text_config is model.config:
        return "base_model"
    import transformers
    from packaging.version import Version

    # Before transformers 5, vision-language models keep the language backbone at `model`.
    return "model" if Version(transformers.__version__) < Version("5.0.0") else "base_model"


def _compute_dtype(hidden: torch.Tensor) -> torch.dtype:
    kind = hidden.device.type
    if torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return hidden.dtype


def _check_one_id_per_row(logits, index) -> None:
    _rows.check_tensor("logits", logits)
    _rows.check_tensor("index", index)
    if tuple(index.shape) != tuple(logits.shape[:-1]):
        raise ValueError(
            f"index shape {tuple(index.shape)} must be logits shape without its last "
            f"dimension, {tuple(logits.shape[:-1])} (one id per row)"
        )


def _no_autocast(device: torch.device):
    """Autocast off inside (the head computes in the dtype it chose), where it is on."""
    if not torch.is_autocast_enabled(device.type):
        return nullcontext()
    return torch.autocast(device.type, enabled=False)


def _refuse_zero3() -> None:
    try:
        from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled
    except ImportError:
        return
    if is_deepspeed_zero3_enabled():
        raise RuntimeError(
            "DeepSpeed ZeRO-3 is not supported by exactlogp's add_fused_lm_head: its backward "
            "recomputes the logits from lm_head.weight, which ZeRO-3 gathers only inside the "
            "head's own forward; use FSDP2 (DTensor) or unpatch_trl()"
        )


def _router_aux_loss(model, text_config, states, attention_mask):
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    experts = getattr(text_config, "num_experts", None)
    if experts is None:
        experts = getattr(model, "num_experts", None)
    per_token = getattr(text_config, "num_experts_per_tok", None)
    if per_token is None:
        per_token = getattr(model, "num_experts_per_tok", None)
    return load_balancing_loss_func(states.router_logits, experts, per_token, attention_mask)


# --- processed logprobs in GRPOTrainer ---


class _Replay:
    """The cut a scoring call replays, and the dropped targets of its fused forwards."""

    def __init__(self, top_k, top_p, min_p):
        self.cut = scalar_cut(top_k, top_p, min_p)
        self.dropped: list[torch.Tensor] = []  # per fused forward: labels' shape, bool


# Set while GRPOTrainer scores tokens under patch_trl(processed=True): the fused head reads it.
_REPLAY: contextvars.ContextVar = contextvars.ContextVar("exactlogp_trl_replay", default=None)
_PENDING = "_exactlogp_dropped"  # trainer attribute: the dropped masks of the scoring calls
_SCORE = "_get_per_token_logps_and_entropies"


def _score_processed(original):
    """GRPOTrainer._get_per_token_logps_and_entropies, scoring under the trainer's cut."""

    @functools.wraps(original)
    def scored(self, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        replay = _Replay(self.top_k, self.top_p, self.min_p)
        token = _REPLAY.set(replay)
        try:
            out = original(self, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs)
        finally:
            _REPLAY.reset(token)
        logps = out[0]
        if replay.dropped:
            dropped = torch.cat([d[:, -logits_to_keep:] for d in replay.dropped])
            dropped = dropped.to(logps.device)
        else:
            dropped = torch.zeros(logps.shape, dtype=torch.bool, device=logps.device)
        self.__dict__.setdefault(_PENDING, []).append(dropped)
        return out

    return scored


def _take_dropped(trainer, shape, device) -> torch.Tensor:
    pending = trainer.__dict__.pop(_PENDING, [])
    dropped = torch.zeros(shape, dtype=torch.bool, device=device)
    for d in pending:
        dropped |= d.to(device)
    return dropped


def _mask_dropped(trainer, inputs: dict, dropped: torch.Tensor, what: str) -> dict:
    """inputs with the dropped completion tokens out of the loss (`tool_mask`, which TRL's
    loss multiplies into `completion_mask`), and the count logged."""
    completion_mask = inputs["completion_mask"]
    count = int((dropped & (completion_mask != 0)).sum())
    mode = "train" if trainer.model.training else "eval"
    trainer._metrics[mode][f"{DROPPED_METRIC}/{what}"].append(float(count))
    if not count:
        return inputs
    logger.warning(
        "%d of %d completion tokens lie outside the kept top-k / top-p / min-p set of the %s "
        "logprobs; they are masked out of the loss",
        count, int((completion_mask != 0).sum()), what,
    )  # fmt: skip
    base = inputs.get("tool_mask")
    base = torch.ones_like(completion_mask) if base is None else base
    return {**inputs, "tool_mask": base * (~dropped).to(base.dtype)}


def _generate_processed(original):
    """GRPOTrainer._generate_and_score_completions: old / reference tokens cut masked."""

    @functools.wraps(original)
    def generate(self, *args, **kwargs):
        self.__dict__[_PENDING] = []
        output = original(self, *args, **kwargs)
        mask = output["completion_mask"]
        dropped = _take_dropped(self, mask.shape, mask.device)
        return _mask_dropped(self, output, dropped, "old_ref")

    return generate


class _Captured(Exception):
    pass


def _loss_processed(original):
    """GRPOTrainer._compute_loss: the policy's tokens outside its kept set masked out.

    TRL reads the loss mask before it scores the policy, so the scoring call is captured
    first (TRL's own arguments), run, and its dropped tokens masked in `tool_mask`; then
    TRL's loss runs on those inputs with that scoring result."""

    @functools.wraps(original)
    def compute_loss(self, model, inputs):
        call = {}

        def capture(*args, **kwargs):
            call["args"] = (args, kwargs)
            raise _Captured

        with _instead(self, capture):
            try:
                return_value = original(self, model, inputs)
            except _Captured:
                pass
            else:  # this TRL's loss did not score the policy: nothing to replay
                return return_value
        args, kwargs = call["args"]
        self.__dict__[_PENDING] = []
        scored = getattr(self, _SCORE)(*args, **kwargs)
        mask = inputs["completion_mask"]
        inputs = _mask_dropped(self, inputs, _take_dropped(self, mask.shape, mask.device), "policy")
        with _instead(self, lambda *a, **k: scored):
            return original(self, model, inputs)

    return compute_loss


class _instead:
    """Set the trainer's scoring method (an instance attribute) for the block, then put
    back what was there (the class's, or an instance attribute set by someone else)."""

    _MISSING = object()

    def __init__(self, trainer, fn):
        self.trainer, self.fn = trainer, fn

    def __enter__(self):
        self.prior = self.trainer.__dict__.get(_SCORE, self._MISSING)
        self.trainer.__dict__[_SCORE] = self.fn

    def __exit__(self, *exc):
        if self.prior is self._MISSING:
            self.trainer.__dict__.pop(_SCORE, None)
        else:
            self.trainer.__dict__[_SCORE] = self.prior
        return False


_GRPO = "trl.trainer.grpo_trainer"


def _processed_sites() -> list:
    return [
        _patching.Site(_GRPO, f"GRPOTrainer.{_SCORE}", _score_processed, wraps=True),
        _patching.Site(
            _GRPO, "GRPOTrainer._generate_and_score_completions", _generate_processed, wraps=True
        ),
        _patching.Site(_GRPO, "GRPOTrainer._compute_loss", _loss_processed, wraps=True),
    ]


# --- patching TRL ---


@_patching.atomic
def patch_trl(
    *, out_dtype: torch.dtype | None = None, processed: bool = False
) -> _patching.PatchHandle:
    """Make TRL compute its log-probabilities and entropies with exactlogp.

    Replaces, in `trl.trainer.utils` and in every TRL module that bound them by name
    (the GRPO / RLOO / KTO / SFT / DPO / async-GRPO trainers' `add_fused_lm_head`, the
    experimental trainers' `selective_log_softmax`, the lazy `trl.trainer` export):
    `selective_log_softmax`, `selective_log_softmax_and_entropy`, `entropy_from_logits`,
    `add_fused_lm_head`, and `_ChunkedLogProbFunction` (the fused head of models patched
    before this call; also `trl.kernels.ChunkedLogProbFunction`). TRL modules imported
    later copy the patched names. `out_dtype` applies to the full-logits functions.

    `processed=True` also makes `GRPOTrainer` score the policy, old and reference logprobs
    as processed logprobs under its `top_k` / `top_p` / `min_p` / `temperature` (the
    module docstring): wrapped are `GRPOTrainer._get_per_token_logps_and_entropies`,
    `_generate_and_score_completions` and `_compute_loss`. Tokens outside the kept set are
    masked out of the loss and counted in the metrics `exactlogp/dropped_tokens/policy` and `/old_ref`.

    Opt-in and idempotent; undo with `unpatch_trl()` or `handle.undo()`. A TRL that moved
    one of these names raises ImportError / AttributeError naming it and changes nothing.
    """
    if not isinstance(processed, bool):
        raise TypeError(f"processed must be a bool, got {type(processed).__name__}")
    if processed:  # imported first, so that its by-name copies are found and swapped too
        importlib.import_module(_GRPO)
    full = _with_out_dtype(out_dtype)
    sites = [
        _patching.Site("trl.trainer.utils", name, fn, everywhere=True)
        for name, fn in (
            ("selective_log_softmax", full["selective_log_softmax"]),
            ("selective_log_softmax_and_entropy", full["selective_log_softmax_and_entropy"]),
            ("entropy_from_logits", full["entropy_from_logits"]),
            ("add_fused_lm_head", add_fused_lm_head),
            ("_ChunkedLogProbFunction", ChunkedLogProbFunction),
        )
    ]
    sites.append(_patching.Site("trl.trainer", "add_fused_lm_head", add_fused_lm_head))
    # TRL's Triton kernel (present where Triton is): its name in trl.kernels and its copy
    # in trl.trainer.utils (`_fused_logprob_entropy`, which TRL's own function calls on CUDA)
    sites.append(_patching.Site("trl.kernels", "selective_log_softmax_and_entropy",
                                kernel_selective_log_softmax_and_entropy, optional=True,
                                everywhere=True))  # fmt: skip
    options = {"out_dtype": out_dtype}
    if processed:
        sites.extend(_processed_sites())
        options["processed"] = True
    return _patching.apply(PATCH_KEY, sites, options, on_undo=_warn_left_behind)


def patch_from_env(vocab_size: int | None = None) -> _patching.PatchHandle:
    """EXACTLOGP_PATCH=trl (exactlogp.integrations.autopatch): `patch_trl()`."""
    del vocab_size  # TRL's logits carry their vocabulary
    return patch_trl()


@_patching.atomic
def unpatch_trl() -> bool:
    """Restore TRL's own functions; False if `patch_trl` was not applied.

    Restored: every binding `patch_trl` swapped (also copies made while patched), so models
    given TRL's head before the patch and everything built afterwards are TRL's again. Not
    restored: a model given exactlogp's fused head while patched (TRL's trainers do it at
    construction) keeps it; a RuntimeWarning names those still alive.
    """
    return _patching.undo(PATCH_KEY)


def _warn_left_behind() -> None:
    _patching.warn_kept(
        _HEADS_WHILE_PATCHED, "unpatch_trl",
        "exactlogp's fused LM head (given by add_fused_lm_head while patch_trl() was live): "
        "their forward(..., fused_lm_head=True) still computes with exactlogp",
        "Build the model (and its trainer) again after unpatch_trl() for TRL's head.",
    )  # fmt: skip


def _with_out_dtype(out_dtype) -> dict:
    fns = {
        "selective_log_softmax": selective_log_softmax,
        "selective_log_softmax_and_entropy": selective_log_softmax_and_entropy,
        "entropy_from_logits": entropy_from_logits,
    }
    if _rows.check_out_dtype(out_dtype) is None:
        return fns
    return {
        name: functools.wraps(fn)(functools.partial(fn, out_dtype=out_dtype))
        for name, fn in fns.items()
    }
