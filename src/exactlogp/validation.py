"""Errors that name the argument, the offending value and the first bad row.

Argument checks run before any collective and look at this rank's arguments only; with a
TP group, exactlogp.agreement then makes every rank raise when any rank's checks failed or
the ranks disagree. Data checks run after the int64 all_reduce on the combined record,
which is identical on every rank, so a bad row is reported by all ranks at once instead
of hanging the group.
"""

from __future__ import annotations

import math
import numbers

import torch

from . import contract, linear_contract
from .agreement import ROW_FIELD_NAMES, ROW_HASH_NAMES, gather_row, rank_values_text
from .temperature import Temperature

LOGIT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
# Shard starts and widths ride the fp32 all_reduce(MAX) of the agreement: exact up to 2^24.
MAX_COLUMN = 1 << 24


def check_real(name: str, t: torch.Tensor) -> None:
    """Values, not only shapes: a meta tensor has none to compute with."""
    if t.device.type == "meta":
        raise ValueError(
            f"{name} is a meta tensor (shape {tuple(t.shape)}, no values): exactlogp computes "
            "values; pass tensors on a real device"
        )


def check_logits(logits) -> None:
    if not isinstance(logits, torch.Tensor):
        raise TypeError(
            f"vocab_parallel_logits must be a torch.Tensor, got {type(logits).__name__}"
        )
    if logits.dtype not in LOGIT_DTYPES:
        raise TypeError(
            f"vocab_parallel_logits must be bfloat16, float16 or float32, got {logits.dtype}"
        )
    if logits.dim() < 1:
        raise ValueError("vocab_parallel_logits must have a vocabulary dimension, got a 0-d tensor")
    check_real("vocab_parallel_logits", logits)


def check_target(target, source: torch.Tensor, name: str = "vocab_parallel_logits") -> None:
    """Integer ids shaped like `source` (the logits, or the hidden states) without its
    last dimension, on its device."""
    if not isinstance(target, torch.Tensor):
        raise TypeError(f"target must be a torch.Tensor, got {type(target).__name__}")
    if target.dtype == torch.bool or target.is_floating_point() or target.is_complex():
        raise TypeError(f"target must hold integer token ids, got dtype {target.dtype}")
    if not target.dtype.is_signed:
        raise TypeError(
            f"target must hold signed integer token ids (int64 or int32), got dtype "
            f"{target.dtype}: unsigned ids cannot be ignore_index, and uint64 ids above "
            "2^63 would wrap around"
        )
    if tuple(target.shape) != tuple(source.shape[:-1]):
        raise ValueError(
            f"target shape {tuple(target.shape)} must equal {name} shape "
            f"without its last dimension, {tuple(source.shape[:-1])}"
        )
    _same_device("target", target, source)


def check_keep_mask(keep_mask, logits: torch.Tensor) -> None:
    if keep_mask is None:
        return
    if not isinstance(keep_mask, torch.Tensor) or keep_mask.dtype != torch.bool:
        kind = keep_mask.dtype if isinstance(keep_mask, torch.Tensor) else type(keep_mask).__name__
        raise TypeError(f"keep_mask must be a bool tensor, got {kind}")
    if keep_mask.shape != logits.shape:
        raise ValueError(
            f"keep_mask shape {tuple(keep_mask.shape)} must equal vocab_parallel_logits "
            f"shape {tuple(logits.shape)}"
        )
    _same_device("keep_mask", keep_mask, logits)


def check_temperature(temperature, target: torch.Tensor, greedy: bool = False) -> Temperature:
    """The public API's float or tensor as a Temperature: a valid float rounded to fp32, or
    the tensor flattened to fp32 (N,) (its values are checked per row, in finalize).
    greedy=True (the exact cut): a temperature of exactly 0 as given -- the scalar, or a
    row's value before its rounding to fp32 -- is a greedy row (Temperature.greedy, tau 1);
    a value that only rounds to 0 in fp32 (1e-50) stays 0, a bad temperature."""
    if isinstance(temperature, torch.Tensor):
        if not temperature.is_floating_point():
            raise TypeError(f"temperature tensor must be floating point, got {temperature.dtype}")
        if temperature.dim() != 0 and temperature.shape != target.shape:
            raise ValueError(
                f"temperature tensor shape {tuple(temperature.shape)} must be () or equal "
                f"target shape {tuple(target.shape)}"
            )
        _same_device("temperature", temperature, target)
        if temperature.requires_grad and torch.is_grad_enabled():
            raise ValueError(
                "temperature is a tensor that requires grad, but exactlogp does not "
                "differentiate with respect to the temperature (the gradient would be "
                "silently missing); pass temperature.detach()"
            )
        tau = Temperature.of(temperature.expand(target.shape))
        if not greedy:
            return tau
        zero = temperature.detach().expand(target.shape).reshape(-1) == 0
        return Temperature(1.0, torch.where(zero, 1.0, tau.rows).contiguous(), zero)
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real):
        raise TypeError(
            f"temperature must be a float or a tensor, got {type(temperature).__name__}"
        )
    if greedy and temperature == 0:
        return Temperature(1.0, None, torch.ones(target.shape, dtype=torch.bool,
                                                 device=target.device).reshape(-1))  # fmt: skip
    tau = contract.fp32_temperature(temperature)
    if not (math.isfinite(tau) and tau > 0.0):
        zero = " (0: a greedy row)" if greedy else ""
        raise ValueError(
            f"temperature must be finite and > 0 in float32{zero}, got {temperature!r} "
            f"(float32: {tau!r})"
        )
    return Temperature(tau)


def _check_float_tensor(name: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in LOGIT_DTYPES:
        raise TypeError(f"{name} must be bfloat16, float16 or float32, got {t.dtype}")


def check_weight(weight) -> None:
    """An LM-head weight shard: a real (V_local, H) bf16/fp16/fp32 tensor."""
    _check_float_tensor("weight", weight)
    if weight.dim() != 2:
        raise ValueError(f"weight must be (V_local, H), got shape {tuple(weight.shape)}")
    check_real("weight", weight)


def check_linear(hidden, weight, bias, logit_scale) -> float:
    """The hidden states, the weight shard and the bias; returns logit_scale in fp32."""
    _check_float_tensor("hidden", hidden)
    _check_float_tensor("weight", weight)
    if hidden.dim() < 1:
        raise ValueError("hidden must have a hidden dimension (..., H), got a 0-d tensor")
    if weight.dim() == 2 and weight.dtype != hidden.dtype:
        raise TypeError(f"weight dtype {weight.dtype} must equal hidden dtype {hidden.dtype}")
    check_real("hidden", hidden)
    check_weight(weight)
    h = hidden.shape[-1]
    if h == 0:
        raise ValueError(
            f"hidden has a hidden size of 0 (shape {tuple(hidden.shape)}): the logits are dot "
            "products over H >= 1 values"
        )
    if weight.shape[1] != h:
        raise ValueError(
            f"weight shape {tuple(weight.shape)} must be (V_local, H) with H = {h}, the last "
            "dimension of hidden"
        )
    if h > linear_contract.MAX_HIDDEN:
        raise ValueError(
            f"the hidden size {h} is larger than {linear_contract.MAX_HIDDEN} (int64 sums)"
        )
    if weight.device != hidden.device:
        raise ValueError(f"weight is on {weight.device} but must be on {hidden.device}")
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or bias.dtype not in LOGIT_DTYPES:
            kind = bias.dtype if isinstance(bias, torch.Tensor) else type(bias).__name__
            raise TypeError(f"bias must be None or a bf16/fp16/fp32 tensor, got {kind}")
        if tuple(bias.shape) != (weight.shape[0],):
            raise ValueError(
                f"bias shape {tuple(bias.shape)} must be (V_local,) = ({weight.shape[0]},)"
            )
        if bias.device != hidden.device:
            raise ValueError(f"bias is on {bias.device} but must be on {hidden.device}")
    if isinstance(logit_scale, bool) or not isinstance(logit_scale, numbers.Real):
        raise TypeError(f"logit_scale must be a float, got {type(logit_scale).__name__}")
    scale = contract.fp32_temperature(logit_scale)  # the same rounding to fp32
    if not (math.isfinite(scale) and scale > 0.0):
        raise ValueError(
            f"logit_scale must be finite and > 0 in float32, got {logit_scale!r} (float32: "
            f"{scale!r}); a model with a softcap (Gemma's final_logit_softcapping) is not "
            "covered by the logits contract"
        )
    return scale


def check_int(name: str, value, minimum: int = INT64_MIN, maximum: int = INT64_MAX):
    """`value` as an int (None stays None), within [minimum, maximum] (int64 at most)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int or None, got {type(value).__name__} {value!r}")
    value = int(value)
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if value > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {value}")
    return value


def check_bool(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return value


def check_shard(
    num_cols: int,
    vocab_start: int | None,
    vocab_size: int | None,
    rank: int,
    world: int,
    logits_name: str = "vocab_parallel_logits",
) -> tuple[int, bool]:
    """(this shard's vocab_start, whether it was given). Without a TP group the logits hold
    the whole vocabulary, so vocab_start must be 0 and vocab_size fit in the columns; with
    one, the agreement checks that the shards of all ranks tile the vocabulary."""
    if num_cols > MAX_COLUMN:
        raise ValueError(
            f"{logits_name} has {num_cols} columns; at most 2^24 = {MAX_COLUMN} are supported"
        )
    if world == 1:
        if vocab_start not in (None, 0):
            raise ValueError(
                f"vocab_start={vocab_start} but there is no tensor-parallel group (tp_group "
                "is None or has one rank), so these logits hold the whole vocabulary and "
                "start at id 0: pass tp_group for a vocab shard, or vocab_start=None"
            )
        if vocab_size is not None and vocab_size > num_cols:
            raise ValueError(
                f"vocab_size={vocab_size} is larger than the {num_cols} columns of "
                f"{logits_name}, and there is no tensor-parallel group to hold the "
                "rest: pass tp_group for a vocab shard, or the real vocabulary size"
            )
        check_vocab_extent(vocab_size, num_cols)
        return 0, vocab_start is not None
    if vocab_start is None:
        check_vocab_extent(vocab_size, world * num_cols)
        return rank * num_cols, False
    check_vocab_extent(vocab_size, vocab_start + num_cols)
    return vocab_start, True


def check_vocab_extent(vocab_size: int | None, shard_end: int) -> None:
    if vocab_size is None and shard_end > contract.MAX_VOCAB:
        raise ValueError(
            f"the vocabulary ends at column {shard_end} > 2^20 = {contract.MAX_VOCAB}; "
            f"contract {contract.CONTRACT} supports at most 2^20 columns (int64 limb sums): "
            "pass vocab_size if the columns past it are padding"
        )


def _same_device(name: str, tensor: torch.Tensor, other: torch.Tensor) -> None:
    if tensor.device != other.device:
        raise ValueError(f"{name} is on {tensor.device} but must be on {other.device}")


# --- data checks on the combined record (one host sync) ---

_MESSAGES = (  # flag, message; the first flag set on the first bad row is reported
    (
        contract.BAD_KEPT_SET,
        "kept_ids of row{idx} hold an id outside the vocabulary (past the end of the last "
        "shard; pass vocab_size to have it named before any collective)",
    ),
    (contract.BAD_TEMPERATURE, "temperature{idx} = {tau} must be finite and > 0 in float32"),
    (
        contract.BAD_TARGET_RANGE,
        "target{idx} = {t} is outside [0, vocab_size={vocab}) and is not ignore_index={ignore}",
    ),
    (contract.BAD_TARGET_OWNER, None),  # _owner_message
    (contract.BAD_TARGET_MASKED, "target{idx} = {t} is a column that keep_mask drops"),
    (
        contract.BAD_NONFINITE,
        "{logits} row{idx} has {nonfinite} NaN or +inf value(s) (after the "
        "temperature) in real, kept columns",
    ),
    (
        contract.BAD_NO_VALID_COLUMN,
        "{logits} row{idx} has no valid column: every real, kept column is -inf",
    ),
)


def index_text(row: int, shape: tuple[int, ...]) -> str:
    """`[i, j]`: a flat row's index in the caller's shape, for the messages."""
    idx = list(torch.unravel_index(torch.tensor(row), shape)) if shape else []
    return "[" + ", ".join(str(int(i)) for i in idx) + "]"


def _owner_message(idx: str, t: int, owners: int, call) -> str:
    world = call.group.size
    if world == 1:
        return (
            f"target{idx} = {t} is not a column of {call.logits_name}, which holds the "
            f"whole vocabulary [0, {call.num_cols}) (there is no tensor-parallel group)"
        )
    if owners == 0:
        return (
            f"target{idx} = {t} is held by none of the {world} vocab shards: it is "
            "past the end of the last shard"
        )
    return (
        f"target{idx} = {t} is held by {owners} of {world} vocab shards (must be "
        "exactly 1): the shards overlap"
    )


def ranks_message(check, call, row_words=None) -> str:
    """A disagreement found in the all_reduce(MAX) (`check`: agreement.RankCheck): the
    first row that differs, if any. Where it is the function's own per-row values (their
    hash rode the MAX) and `row_words` = (names, row -> this rank's (K,) words, words ->
    {name: text}) is given, every rank gathers that row's values to name the one that
    differs and each rank's value (a collective: every rank of the call comes here)."""
    shape = call.target_shape
    rows = torch.nonzero(check.rows).flatten()
    if not len(rows):
        return "the ranks of tp_group disagree on the call (its options or the vocab shards)"
    r = int(rows[0])
    field = ROW_FIELD_NAMES[int(torch.nonzero(check.differs[:, r])[0])]
    idx = index_text(r, shape)
    if field == "target":
        hi, lo = int(check.target_max[r]), int(check.target_min[r])
        what = f"target{idx} is {hi} on some ranks and {lo} on others"
    elif field == "temperature":
        what = f"the temperature of row{idx}"
    elif row_words is None:
        what = f"the {ROW_HASH_NAMES.get(call.fields.kind, 'per-row values')} of row{idx}"
    else:
        names, words_of, text_of = row_words
        table = [text_of(w) for w in gather_row(call.group, words_of(r))]
        name = next((n for n in names if len({t[n] for t in table}) > 1), names[0])
        values = rank_values_text(call.group, [t[name] for t in table])
        what = f"the {name} of row{idx} ({values})"
    must = "rows, targets and temperatures (are the ranks on different micro-batches?)"
    if call.cut is not None:
        must = "rows, targets, temperatures and sampling parameters"
    return f"the ranks of tp_group disagree on {what}: every rank must pass the same {must}"


_FEW = 64  # up to this many values, a host list is read faster than a reduction


def any_set(flags: torch.Tensor) -> bool:
    """Whether any element is nonzero: one host read. A few values on the CPU are read as
    a list (~0.2 us against ~2 us for .any() and its item on a 1-row call)."""
    if flags.device.type == "cpu" and flags.numel() <= _FEW:
        return any(flags.tolist())
    return bool(flags.any())


def raise_for_bad_rows(
    bad: torch.Tensor,  # (N,) int64 flags
    record: torch.Tensor,  # (N, NUM_COLS) int64
    target: torch.Tensor,  # (N,)
    call,  # exactlogp.call.Call
    ranks=None,  # agreement.RankCheck, with a TP group
) -> None:
    if not any_set(bad):  # the one host sync of validation
        return
    rows = torch.nonzero(bad).flatten()
    row = int(rows[0])
    flags = int(bad[row])
    if flags & contract.BAD_RANKS:  # poisons every row: nothing else of the call holds
        raise ValueError(ranks_message(ranks, call))
    idx = index_text(row, call.target_shape)
    t, owners = int(target[row]), int(record[row, contract.COL_OWNERS])
    vocab_size = call.plan.vocab_size
    fields = dict(
        idx=idx,
        t=t,
        tau=call.temperature.at(row),
        vocab="end of the last shard" if vocab_size is None else vocab_size,
        ignore=call.plan.ignore_index,
        logits=call.logits_name,
        nonfinite=int(record[row, contract.COL_NONFINITE]),
    )
    for flag, message in _MESSAGES:
        if flags & flag:
            text = message.format(**fields) if message else _owner_message(idx, t, owners, call)
            break
    more = len(rows) - 1
    if more:
        text += f" ({more} more bad row{'s' if more > 1 else ''})"
    raise ValueError(text + "; pass validate=False to get NaN in such rows instead")


_CUT_MESSAGES = (  # sample / sampling_mask: the rows they cannot serve (cut/driver.Cut.bad)
    (contract.BAD_TEMPERATURE, "temperature{idx} = {tau} must be finite and > 0 in float32 "
                               "(exactly 0: a greedy row)"),
    (contract.BAD_NONFINITE, "{logits} row{idx} has NaN or +inf values (after the temperature) "
                             "in real columns"),
    (contract.BAD_NO_VALID_COLUMN, "{logits} row{idx} has no valid column: every real column "
                                   "is -inf"),
)  # fmt: skip


def raise_for_bad_cut_rows(bad: torch.Tensor, call) -> None:
    """The first row sample or sampling_mask cannot draw from or cut (`bad`: (N,) int64
    contract.BAD_* flags, alike on every rank), as a ValueError on every rank."""
    rows = torch.nonzero(bad).flatten()
    row = int(rows[0])
    flags = int(bad[row])
    idx = index_text(row, call.target_shape)
    text = next(
        msg.format(idx=idx, tau=call.temperature.at(row), logits=call.logits_name)
        for flag, msg in _CUT_MESSAGES
        if flags & flag
    )
    more = len(rows) - 1
    if more:
        text += f" ({more} more bad row{'s' if more > 1 else ''})"
    raise ValueError(text + "; pass validate=False to get -1 (sample) or an empty keep mask")
