"""Fail closed across ranks: what the ranks of a TP group must agree on, and the checks.

A call is only meaningful when every rank of the group runs it with the same rows, targets,
temperatures and options, on shards that tile the vocabulary. Two checks make a
disagreement visible on every rank at once instead of a silent wrong number, a hang or an
abort:

1. validate=True: before any collective whose size depends on the call, one all_gather
   of a fixed-size int64 vector per rank (`agree`): its status (did this rank's argument
   checks pass, and if not the start of its message), the call's shared fields, and its
   shard. Every rank reads the table (one host sync) and raises the same ValueError when a
   rank failed its checks, a field differs, or the shards overlap or leave a gap. Nothing
   is sized by the call before this, so different row counts never reach a collective.
2. Both modes: the per-row values ride the forward's all_reduce(MAX) as (v, -v) pairs,
   from which every rank reads max and min (`max_payload` / `read_max`): the target and
   the temperature's bits of every row, a 48-bit key of the call's fields, and every
   rank's shard (as a one-hot vector each rank fills at its own index). A row whose values
   differ, or any difference in the call or the shards, poisons every output of the call
   on every rank with NaN (validate=False, no host sync) or raises (validate=True).

Both checks cost no extra collective besides the all_gather of validate=True.
"""

from __future__ import annotations

import functools
import hashlib
import struct
from dataclasses import dataclass, fields
from typing import NamedTuple

import torch

from . import contract, distributed

# --- what every rank must agree on ---

KIND_LOGITS = 1  # selected_logprobs
KIND_LINEAR = 2  # linear_selected_logprobs
KIND_PROCESSED = 3  # processed_logprobs (the exact cut)
KIND_SAMPLE = 4  # sample (the exact cut)
KIND_SAMPLING_MASK = 5  # sampling_mask (the exact cut)
KIND_REPLAY = 6  # replay_logprobs
KIND_LINEAR_REPLAY = 7  # linear_replay_logprobs
KIND_NAMES = {
    KIND_LOGITS: "selected_logprobs",
    KIND_LINEAR: "linear_selected_logprobs",
    KIND_PROCESSED: "processed_logprobs",
    KIND_SAMPLE: "sample",
    KIND_SAMPLING_MASK: "sampling_mask",
    KIND_REPLAY: "replay_logprobs",
    KIND_LINEAR_REPLAY: "linear_replay_logprobs",
}
NUM_KINDS = 8  # the one-hot slots of the kinds in the MAX (room for more functions)
# functions that read nothing back on the host before their record's all_reduce(SUM):
# a rank of another function that stops after a poisoned MAX still makes that SUM
NO_SYNC_KINDS = (KIND_LOGITS, KIND_LINEAR, KIND_REPLAY, KIND_LINEAR_REPLAY)
# what the two words of each row's hash that rides the MAX stand for, per function
ROW_HASH_NAMES = {
    KIND_LINEAR: "hidden states",
    KIND_PROCESSED: "sampling parameters",
    KIND_SAMPLE: "sampling parameters or uniforms",
    KIND_SAMPLING_MASK: "sampling parameters",
    KIND_REPLAY: "kept set",
    KIND_LINEAR_REPLAY: "hidden states or kept set",
}
PHASE_FORWARD, PHASE_BACKWARD = 0, 1
# the inputs whose requires_grad is bit i of CallFields.grads, per function
GRAD_INPUTS = {
    KIND_LOGITS: ("vocab_parallel_logits",),
    KIND_LINEAR: ("hidden", "weight", "bias"),
    KIND_PROCESSED: ("vocab_parallel_logits",),
    KIND_REPLAY: ("vocab_parallel_logits",),
    KIND_LINEAR_REPLAY: ("hidden", "weight", "bias"),
}


def grads_field(*tensors) -> int:
    """CallFields.grads: bit i set when tensors[i] will get a gradient from this call."""
    if not torch.is_grad_enabled():
        return 0
    return sum(1 << i for i, t in enumerate(tensors) if t is not None and t.requires_grad)


@dataclass(frozen=True)
class CallFields:
    """The arguments every rank must pass alike, as int64 values (checked in this order)."""

    phase: int = PHASE_FORWARD  # what the ranks are about to run: a call or its backward
    kind: int = KIND_LOGITS
    contract: int = 0  # 48-bit key of the contract version string(s)
    rows: int = 0
    vocab_size: int = -1  # -1: not given
    with_entropy: int = 0
    ignore_index: int = -100
    keep_mask: int = 0  # 1: a keep_mask was passed
    temperature: int = -1  # fp32 bits of a scalar temperature; -1: one per row
    validate: int = 1
    hidden: int = 0  # linear_selected_logprobs: H
    hidden_dtype: int = 0  # linear_selected_logprobs: dtype code of hidden
    logit_scale: int = 0  # linear_selected_logprobs: fp32 bits of logit_scale
    bias: int = 0  # linear_selected_logprobs: 1 when a bias was passed
    grads: int = 0  # which inputs require a gradient (GRAD_INPUTS bits of the function)
    top_k: int = 0  # sampling: k (0: no cut); -2: one per row
    top_p: int = 0  # sampling: fp32 bits of p (0: no cut); -1: one per row
    min_p: int = 0  # sampling: fp32 bits of min_p (0: no cut); -1: one per row

    def values(self) -> tuple[int, ...]:
        """The fields in order (dataclasses.astuple without its deep copies)."""
        return tuple(getattr(self, name) for name in FIELD_NAMES)

    def key(self) -> int:
        """48 bits that differ (but for a hash collision) whenever a field differs."""
        values = self.values()
        raw = struct.pack(f"<{len(values)}q", *values)
        return int.from_bytes(hashlib.sha256(raw).digest()[:6], "little")


FIELD_NAMES = tuple(f.name for f in fields(CallFields))
WIRE_DTYPE_CODES = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3, torch.float64: 4}


def dtype_code(dtype: torch.dtype) -> int:
    return WIRE_DTYPE_CODES.get(dtype, 99)


@functools.cache
def contract_key(*versions: str) -> int:
    return int.from_bytes(hashlib.sha256("\0".join(versions).encode()).digest()[:6], "little")


def _show(name: str, value: int, kind: int = KIND_LOGITS) -> str:
    """A field's value as the user wrote it (`kind`: the rank's function, for grads)."""
    if name == "phase":
        return {PHASE_FORWARD: "a call", PHASE_BACKWARD: "a backward"}.get(value, str(value))
    if name == "grads":
        names = [n for i, n in enumerate(GRAD_INPUTS.get(kind, ())) if value >> i & 1]
        return ", ".join(names) if names else "none"
    if name == "kind":
        return KIND_NAMES.get(value, str(value))
    if name in ("temperature", "logit_scale", "top_p", "min_p"):
        if name != "logit_scale" and value == -1:
            return "a per-row tensor"
        if name in ("top_p", "min_p") and value == 0:
            return "None"
        return fp32_text(value)
    if name == "top_k":
        return {0: "None", -2: "a per-row tensor"}.get(value, str(value))
    if name == "vocab_size" and value == -1:
        return "None"
    if name in ("with_entropy", "keep_mask", "validate", "bias"):
        return {"keep_mask": ("None", "a tensor"), "bias": ("None", "a tensor")}.get(
            name, ("False", "True")
        )[value]
    if name == "hidden_dtype":
        return next((str(d) for d, c in WIRE_DTYPE_CODES.items() if c == value), str(value))
    if name == "contract":
        return f"key {value:012x} (exactlogp.CONTRACT differs: another exactlogp version)"
    return str(value)


_FIELD_TEXT = {
    "kind": "the function called",
    "contract": "the contract version",
    "rows": "the number of rows",
    "hidden": "the hidden size",
    "hidden_dtype": "the dtype of hidden and weight",
    "grads": "which inputs require a gradient",
    "phase": "what runs now",
}


def fp32_text(bits: int) -> str:
    """The shortest decimal that rounds to this fp32 value (0.7, not 0.699999988...)."""
    value = struct.unpack("<f", struct.pack("<i", bits))[0]
    for digits in range(1, 10):
        text = f"{value:.{digits}g}"
        if struct.unpack("<f", struct.pack("<f", float(text)))[0] == value:
            return text
    return repr(value)  # NaN


@dataclass(frozen=True)
class Layout:
    """This rank's shard: where it starts (given or rank * width) and its width."""

    vocab_start: int
    num_cols: int
    start_given: bool


# --- 1. the agreement all_gather (validate=True) ---


def checked(group: distributed.Group, validate, device: torch.device, build, /, **arguments):
    """build(**arguments) -- this rank's argument checks, returning the call object -- made
    collective: with a TP group and validate=True every rank takes part in `agree` whatever
    its own checks found, so an error on one rank raises on all of them. Without a group
    (or with validate=False) a failed check raises here only."""
    try:
        call, error = build(**arguments), None
    except (TypeError, ValueError, RuntimeError) as exc:
        call, error = None, exc
    if group.distributed and validate is not False:
        agree(group, call and call.fields, call and call.layout, error, device)
    elif error is not None:
        raise error
    return call


_MAGIC = contract_key("exactlogp agreement v1", contract.CONTRACT)
_MSG_WORDS = 31
_HEAD = 2  # magic, status
_LAYOUT = len(FIELD_NAMES) + _HEAD
VECTOR_LEN = _LAYOUT + 3 + 1 + _MSG_WORDS


def _pack(call: CallFields | None, layout: Layout | None, error: BaseException | None):
    vec = [0] * VECTOR_LEN
    vec[0], vec[1] = _MAGIC, int(error is not None)
    if call is not None:
        vec[_HEAD:_LAYOUT] = call.values()
    if layout is not None:
        vec[_LAYOUT : _LAYOUT + 3] = [layout.vocab_start, layout.num_cols, int(layout.start_given)]
    if error is not None:
        text = f"{type(error).__name__}: {error}".encode()[: 8 * _MSG_WORDS]
        vec[_LAYOUT + 3] = len(text)
        words = text.ljust(8 * _MSG_WORDS, b"\0")
        vec[_LAYOUT + 4 :] = struct.unpack(f"<{_MSG_WORDS}q", words)
    return vec


def _message(row: list[int]) -> str:
    size = row[_LAYOUT + 3]
    raw = struct.pack(f"<{_MSG_WORDS}q", *row[_LAYOUT + 4 :])[:size]
    return raw.decode(errors="replace")


def agree(
    group: distributed.Group,
    call: CallFields | None,
    layout: Layout | None,
    error: BaseException | None,
    device: torch.device,
) -> None:
    """The validate=True agreement: raises on every rank, or returns on every rank.

    `error` is this rank's own argument error (then `call` and `layout` may be None); the
    rank still takes part, so that its peers learn of it instead of waiting."""
    vec = torch.tensor(_pack(call, layout, error), dtype=torch.int64, device=device)
    table = distributed.all_gather_int64(vec, group).cpu().tolist()  # the host sync
    if error is not None:
        raise error
    names = _rank_names(group)
    if any(row[0] != _MAGIC for row in table):
        bad = [names[r] for r, row in enumerate(table) if row[0] != _MAGIC]
        raise ValueError(
            f"{_join(bad)} of tp_group run{'s' if len(bad) == 1 else ''} an exactlogp with "
            f"another contract than this rank ({contract.CONTRACT}); every rank must run "
            "the same exactlogp version"
        )
    failed = [r for r, row in enumerate(table) if row[1] != 0]
    if failed:
        detail = "; ".join(f"{names[r]}: {_message(table[r])}" for r in failed)
        raise ValueError(
            f"{_join([names[r] for r in failed])} of tp_group rejected "
            f"{'its' if len(failed) == 1 else 'their'} arguments ({detail}); this rank "
            f"({names[group.rank]}) raises too, so that no rank waits in a collective"
        )
    for i, name in enumerate(FIELD_NAMES):
        values = [row[_HEAD + i] for row in table]
        if len(set(values)) > 1:
            kinds = [row[_HEAD + FIELD_NAMES.index("kind")] for row in table]
            per_rank = ", ".join(
                f"{names[r]}: {_show(name, v, kinds[r])}" for r, v in enumerate(values)
            )
            what = _FIELD_TEXT.get(name, name)
            must = f"pass the same {what.removeprefix('the ')}"
            if name == "grads":
                must = "make the same inputs require a gradient (requires_grad, no_grad)"
            if name == "phase":  # a call paired with another call's backward
                must = (
                    "run its calls and their backwards in the same order (threads that "
                    "share a group may interleave them differently on different ranks: give "
                    "each thread its own group)"
                )
            raise ValueError(
                f"the ranks of tp_group disagree on {what} ({per_rank}); every rank must {must}"
            )
    starts = [row[_LAYOUT] for row in table]
    widths = [row[_LAYOUT + 1] for row in table]
    given = [bool(row[_LAYOUT + 2]) for row in table]
    vocab_size = table[0][_HEAD + FIELD_NAMES.index("vocab_size")]
    problem = layout_problem(starts, widths, given, None if vocab_size < 0 else vocab_size, names)
    if problem:
        raise ValueError(problem)


def _rank_names(group: distributed.Group) -> list[str]:
    ranks = group.global_ranks()
    if ranks is None or ranks == list(range(group.size)):
        return [f"rank {r}" for r in range(group.size)]
    return [f"rank {r} (global rank {g})" for r, g in enumerate(ranks)]


def _join(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def layout_problem(
    starts: list[int],
    widths: list[int],
    given: list[bool],
    vocab_size: int | None,
    names: list[str],
) -> str | None:
    """What is wrong with the shards [start, start + width) of the ranks, or None when
    their real columns (below vocab_size) tile [0, vocab end) exactly once."""
    ends = [s + w for s, w in zip(starts, widths, strict=True)]
    vocab_end = vocab_size if vocab_size is not None else max(ends, default=0)
    held = sorted(
        (s, min(e, vocab_end), r) for r, (s, e) in enumerate(zip(starts, ends, strict=True))
        if min(e, vocab_end) > s
    )  # fmt: skip
    problem, covered, last = None, 0, None
    for s, e, r in held:
        if s > covered:
            problem = f"no rank holds token ids [{covered}, {s})"
        elif s < covered:
            problem = (
                f"{names[last]} holds [{starts[last]}, {ends[last]}) and {names[r]} holds "
                f"[{s}, {ends[r]}): token ids [{s}, {min(covered, e)}) are held twice"
            )
        if problem:
            break
        covered, last = max(covered, e), r
    if problem is None and covered < vocab_end:
        problem = f"no rank holds token ids [{covered}, {vocab_end})"
    if problem is None:
        return None
    text = f"the vocab shards of tp_group do not tile the vocabulary: {problem}"
    if not all(given):
        if len(set(widths)) > 1:
            per_rank = ", ".join(f"{names[r]}: {w}" for r, w in enumerate(widths))
            text += (
                "; vocab_start was not passed, so each shard was placed at rank * V_local, "
                f"which only holds for shards of equal width (here {per_rank} columns): "
                "pass vocab_start on every rank"
            )
        else:
            text += "; vocab_start was not passed, so each shard was placed at rank * V_local"
    elif vocab_size is not None and vocab_end > max(ends, default=0):
        text += f" (vocab_size={vocab_size} is larger than the columns all ranks hold)"
    return text


# --- 2. the values that ride the all_reduce(MAX) ---

_ROW_FIELDS = 5  # target, temperature bits (high 16, low 16), the row hash (two words)
_KEY_CHUNKS = 3  # the 48-bit call key in 16-bit pieces
_EXACT = float(1 << 24)  # integers up to 2^24 are exact in fp32
_constants: dict[tuple, torch.Tensor] = {}


class RankCheck(NamedTuple):
    """What every rank read from the reduced maxima."""

    poison: torch.Tensor  # (N,) bool: every row, when anything below disagrees
    rows: torch.Tensor  # (N,) bool: rows whose target or temperature differ between ranks
    call: torch.Tensor  # () bool: the call fields or the shards differ or do not tile
    target_max: torch.Tensor  # (N,) fp32: the largest and smallest target of each row
    target_min: torch.Tensor
    differs: torch.Tensor  # (k, N) bool: which per-row value differs (ROW_FIELD_NAMES)
    kinds: torch.Tensor  # (NUM_KINDS,) bool: the functions the ranks of the group run
    vocab_end: torch.Tensor  # () fp64: vocab_size, else the end of the last shard


# what each per-row value is, for the messages (the hash: ROW_HASH_NAMES of the function)
ROW_FIELD_NAMES = ("target", "temperature", "temperature", "row hash", "row hash")

# --- a strong hash of each row's bits, for the per-row values ---
#
# A row is read as 32-bit words (two 16-bit elements, or one 32-bit element, per word).
# Each word plus a value of its position k goes through a 32-bit finalizer (xor-shifts and
# multiplications by odd constants: a bijection of the 32-bit words); the row's first field
# is the sum of those words modulo 2^32, its second the sum of another mix of them. The sum
# makes it one pass over the row in any order; the finalizer makes it a hash of every
# element's bits and place (a checksum such as sum(u_k w_k) lets a few +-1 edits cancel,
# this does not). 24 bits of each field ride the MAX: a difference is missed with
# probability about 2^-48. Every intermediate is a non-negative integer below 2^63: exact
# in int64 on every device.
_SEED, _C1, _C2, _C3 = 0x9E3779B1, 0x7FEB352D, 0x1B873593, 0x27D4EB2F
HASH_FIELDS = 2
_HASH_BITS = 24  # per field: exact in the fp32 all_reduce(MAX)
HASH_CHUNK_WORDS = 1 << 22  # int64 temporaries per pass: at most 32 MiB each
_WORD = 0xFFFFFFFF


def _words(block: torch.Tensor) -> torch.Tensor:
    """(n, W) int64 in [0, 2^32): the rows' bits as 32-bit words (16-bit elements in
    pairs, the last one alone when the row length is odd)."""
    if block.element_size() == 4:
        return block.view(torch.int32).to(torch.int64) & _WORD
    u = block.view(torch.int16).to(torch.int64) & 0xFFFF
    if u.shape[-1] % 2:
        u = torch.cat([u, torch.zeros_like(u[:, :1])], dim=-1)  # position k says it is odd
    return u[:, 0::2] | (u[:, 1::2] << 16)


def _mix(words: torch.Tensor, pos: torch.Tensor, length) -> tuple[torch.Tensor, torch.Tensor]:
    """The two mixed words of each 32-bit word at position `pos` of a row of `length`
    words (int64 tensors, broadcast): each < 2^32, summed per row by the callers."""
    x = (words + pos * _SEED + length) & _WORD  # pos * seed < 2^54
    x = x ^ (x >> 16)
    x = (x * _C1) & _WORD
    x = x ^ (x >> 15)
    x = (x * _C2) & _WORD
    x = x ^ (x >> 16)
    y = (x * _C3) & _WORD
    return x, y ^ (y >> 13)


def row_hash(rows: torch.Tensor) -> torch.Tensor:
    """(HASH_FIELDS, N) int64 below 2^24: a strong hash of the bits of each row of `rows`
    ((N, K), any 16- or 32-bit dtype), position by position. Row blocks keep the
    temporaries small; nothing is synced with the host."""
    n, k = rows.shape[0], rows.shape[-1]
    out = torch.empty(HASH_FIELDS, n, dtype=torch.int64, device=rows.device)
    step = max(1, HASH_CHUNK_WORDS * (4 // rows.element_size()) // max(k, 1))
    mask = (1 << _HASH_BITS) - 1
    for r0 in range(0, n, step):
        words = _words(rows[r0 : r0 + step].contiguous())
        pos = torch.arange(words.shape[-1], dtype=torch.int64, device=rows.device)
        x, y = _mix(words, pos, k)  # k: the row length
        out[0, r0 : r0 + step] = x.sum(-1) & mask  # each x < 2^32: the sum < 2^54
        out[1, r0 : r0 + step] = y.sum(-1) & mask
    return out


def segment_hash(values: torch.Tensor, row: torch.Tensor, pos: torch.Tensor, n: int):
    """(HASH_FIELDS, n) int64 below 2^24: row_hash's hash of ragged rows -- element i of
    `values` ((M,) integers below 2^32) at position pos[i] of row row[i] -- the length of
    each row mixed in as row_hash does. Sums of fewer than 2^22 words per row stay exact."""
    dev = values.device
    length = torch.bincount(row, minlength=n)
    x, y = _mix(values.to(torch.int64) & _WORD, pos, length[row])
    out = torch.zeros(HASH_FIELDS, n, dtype=torch.int64, device=dev)
    out[0].index_add_(0, row, x)
    out[1].index_add_(0, row, y)
    return out & ((1 << _HASH_BITS) - 1)


def _row_values(target: torch.Tensor, temperature, row_hash) -> torch.Tensor:
    """(5, N) fp32, each value an integer exact in fp32 (`temperature`: a Temperature;
    `row_hash`: (2, N) int64 below 2^24, or None: zeros)."""
    t = target.clamp(-(1 << 24), 1 << 24).to(torch.float32)
    bits = temperature.row_bits(target.shape[0], target.device)
    if row_hash is None:
        row_hash = torch.zeros(HASH_FIELDS, target.shape[0], device=target.device)
    return torch.cat([
        torch.stack([t, (bits >> 16).to(torch.float32), (bits & 0xFFFF).to(torch.float32)]),
        row_hash.to(torch.float32),
    ])  # fmt: skip


def _call_values(key: int, kind: int, group: distributed.Group, layout: Layout, device):
    """(2 * 3 + NUM_KINDS + 2 * size,) fp32: the key chunks and their negations, a one
    at the function's kind among zeros, then this rank's start and width at its own index
    among -1s. Built once per distinct call on each device, and built on the device by
    fills, never copied from host memory: a first call inside CUDA graph capture may
    build it."""
    cache_key = (device, key, kind, group.rank, group.size, layout.vocab_start, layout.num_cols)
    found = _constants.get(cache_key)
    if found is None:
        chunks = [float((key >> (16 * i)) & 0xFFFF) for i in range(_KEY_CHUNKS)]
        found = torch.full((2 * _KEY_CHUNKS + NUM_KINDS + 2 * group.size,), -1.0, device=device)
        for i, chunk in enumerate(chunks):
            found[i].fill_(chunk)
            found[_KEY_CHUNKS + i].fill_(-chunk)
        kinds = found[2 * _KEY_CHUNKS : 2 * _KEY_CHUNKS + NUM_KINDS]
        kinds.fill_(0.0)
        kinds[kind].fill_(1.0)
        shards = found[2 * _KEY_CHUNKS + NUM_KINDS :]
        shards[group.rank].fill_(float(layout.vocab_start))
        shards[group.size + group.rank].fill_(float(layout.num_cols))
        if len(_constants) > 256:
            _constants.clear()
        _constants[cache_key] = found
    return found


def as_pairs(values: torch.Tensor) -> torch.Tensor:
    """values (any shape) flattened, then their negations: after an all_reduce(MAX) each
    half holds the max and minus the min over ranks (read with from_pairs)."""
    flat = values.reshape(-1)
    return torch.cat([flat, -flat])


def from_pairs(reduced: torch.Tensor, k: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(max, min) over ranks, each (k, n), of k x n values reduced as as_pairs' pairs."""
    return reduced[: k * n].view(k, n), -reduced[k * n : 2 * k * n].view(k, n)


def max_payload(
    row_max: torch.Tensor,  # (N,) fp32 local maxima
    target: torch.Tensor,  # (N,) int64
    temperature,  # Temperature of these rows
    key: int,
    kind: int,  # the function (KIND_*)
    group: distributed.Group,
    layout: Layout,
    row_hash: torch.Tensor | None = None,  # (2, N) int64 below 2^24: the function's extra
) -> torch.Tensor:
    """The fp32 tensor the forward all_reduces with MAX: row maxima and agreement fields.
    Its layout is the same for every function (a function without per-row extras sends
    zeros), so ranks that run different functions on the same rows meet in a MAX of one
    size and learn of it from the key and the kinds."""
    return torch.cat(
        [
            row_max.to(torch.float32),
            as_pairs(_row_values(target, temperature, row_hash)),
            _call_values(key, kind, group, layout, row_max.device),
        ]
    )


def read_max(
    reduced: torch.Tensor,
    num_rows: int,
    group: distributed.Group,
    vocab_size: int | None,
) -> tuple[torch.Tensor, RankCheck]:
    """(global row maxima, RankCheck) from the all_reduced payload; no host sync."""
    n, k = num_rows, _ROW_FIELDS
    row_max = reduced[:n]
    hi, lo = from_pairs(reduced[n:], k, n)
    differs = hi != lo
    rows = differs.any(dim=0)
    rest = reduced[n + 2 * k * n :]
    key_hi, key_lo = from_pairs(rest, 1, _KEY_CHUNKS)
    kinds = rest[2 * _KEY_CHUNKS : 2 * _KEY_CHUNKS + NUM_KINDS] > 0
    shards = rest[2 * _KEY_CHUNKS + NUM_KINDS :].to(torch.float64)
    starts, widths = shards[: group.size], shards[group.size :]
    call = (key_hi != key_lo).any() | ~_tiles(starts, widths, vocab_size)
    poison = (rows.any() | call).expand(n)
    end = (starts + widths).max() if vocab_size is None else torch.full_like(starts[0], vocab_size)
    return row_max, RankCheck(poison, rows, call, hi[0], lo[0], differs, kinds, end)


def _tiles(starts: torch.Tensor, widths: torch.Tensor, vocab_size: int | None) -> torch.Tensor:
    """() bool on the device: the real parts of [start, start + width) tile [0, vocab end)."""
    ends = starts + widths
    vocab_end = ends.max() if vocab_size is None else torch.full_like(ends[0], vocab_size)
    real_end = torch.minimum(ends, vocab_end)
    held = (real_end > starts) & (starts >= 0)
    width = torch.where(held, real_end - starts, torch.zeros_like(starts))
    a_s, a_e = starts.unsqueeze(0), real_end.unsqueeze(0)
    b_s, b_e = starts.unsqueeze(1), real_end.unsqueeze(1)
    both = held.unsqueeze(0) & held.unsqueeze(1)
    both &= ~torch.eye(starts.shape[0], dtype=torch.bool, device=starts.device)
    overlap = (both & (a_s < b_e) & (b_s < a_e)).any()
    return (width.sum() == vocab_end) & ~overlap & (starts >= 0).all()


# --- 3. naming what differs (validate=True, after the MAX found a row that differs) ---


def gather_row(group: distributed.Group, words: torch.Tensor) -> list[list[int]]:
    """Every rank's (K,) integer values of one row, in rank order: an all_gather that
    every rank makes together (the MAX told each of them the same row differs)."""
    vec = words.to(torch.int64).reshape(-1)
    return distributed.all_gather_int64(vec, group).cpu().tolist()


def rank_values_text(group: distributed.Group, values: list) -> str:
    """'rank 0: 0.9, rank 1: 0.25' for per-rank values already as text or numbers."""
    names = _rank_names(group)
    return ", ".join(f"{names[r]}: {v}" for r, v in enumerate(values))
