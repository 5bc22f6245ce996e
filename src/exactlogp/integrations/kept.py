"""The kept sets rollout engines return, as the CSR `exactlogp.replay_logprobs` takes.

- vLLM (>= 0.28, `--return-sampling-mask`): `CompletionOutput.sampling_mask`, a
  `vllm.outputs.SamplingMask` whose `token_ids` holds one list of kept ids per generated
  token, each sorted (its scheduler's CSR, `SamplingMaskLists(token_ids, offsets)`, is
  taken as it is).
- SGLang (`return_sampling_mask`): `meta_info["output_token_sampling_mask"]`, one list
  per output token, in order of probability: `sort=True`.
- slime: `rollout_top_p_token_ids` / `rollout_top_p_token_offsets` per sample (CSR already).

`kept_csr` concatenates any of them, in order, into (kept_ids, kept_offsets) int64
tensors; `replaying` hands them to the trainer-side drop-ins (TRL, verl, Megatron) for
the calls made inside it. Nothing here builds a dense [N, V] mask.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from ..api import LogprobResult
from ..replay import replay_logprobs


def kept_csr(masks, *, sort: bool = False, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(kept_ids (nnz,) int64, kept_offsets (N + 1,) int64) of the kept sets in `masks`:
    a vLLM SamplingMask (or anything with `token_ids` as a list of lists), a list of
    them (one per sequence, concatenated in order), a CSR pair (ids, offsets) given as a
    tuple of 1-D arrays or tensors (vLLM's SamplingMaskLists, slime's ids / offsets), or a
    list of per-token lists / arrays (SGLang). sort=True sorts each row (SGLang's rows are
    in order of probability); without it an unsorted row is left as it is, for
    replay_logprobs to name. On `device` (default: the CPU)."""
    parts = list(_pieces(masks))
    flat = torch.cat([p[0] for p in parts]) if parts else torch.zeros(0, dtype=torch.int64)
    lengths = torch.cat([p[1] for p in parts]) if parts else torch.zeros(0, dtype=torch.int64)
    offsets = torch.zeros(lengths.shape[0] + 1, dtype=torch.int64)
    torch.cumsum(lengths, 0, out=offsets[1:])
    if sort and flat.numel():
        row = torch.repeat_interleave(torch.arange(lengths.shape[0]), lengths)
        flat = flat[torch.argsort(row * (1 << 40) + flat)]  # rows in place, ids ascending
    return flat.to(device or "cpu"), offsets.to(device or "cpu")


def _pieces(masks) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(ids, row lengths) of each part of `masks`, in order."""
    if hasattr(masks, "token_ids") and not isinstance(masks, (list, tuple)):
        offsets = getattr(masks, "offsets", None)
        if offsets is not None or _is_flat(masks.token_ids):  # a CSR (SamplingMaskLists)
            yield _csr(masks.token_ids, offsets)
        else:
            yield _rows(masks.token_ids)
        return
    if _is_pair(masks):
        yield _csr(*masks)
        return
    if (
        isinstance(masks, Sequence)
        and masks
        and not _is_flat(masks)
        and (hasattr(masks[0], "token_ids") or _is_pair(masks[0]))
    ):  # one mask per sequence
        for m in masks:
            yield from _pieces(m)
        return
    yield _rows(masks)


def _is_flat(value) -> bool:
    """A 1-D array or tensor of ids (not a list of rows)."""
    return getattr(value, "ndim", None) == 1 and not isinstance(value, (list, tuple))


def _is_pair(value) -> bool:
    return isinstance(value, tuple) and len(value) == 2 and all(map(_is_flat, value))


def _ids(value) -> torch.Tensor:
    """(n,) int64 on the CPU of a list, an array or a tensor of integer ids."""
    t = torch.as_tensor(value).detach().cpu().reshape(-1)
    if t.numel() and (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool):
        raise TypeError(f"kept token ids must be integers, got dtype {t.dtype}")
    return t.to(torch.int64)


def _csr(ids, offsets) -> tuple[torch.Tensor, torch.Tensor]:
    ids = _ids(ids)
    if offsets is None:  # vLLM's single position
        return ids, torch.tensor([ids.shape[0]])
    offsets = _ids(offsets)
    lengths = offsets.diff()
    if (
        offsets.numel() == 0
        or offsets[0] != 0
        or offsets[-1] != ids.shape[0]
        or (lengths < 0).any()
    ):
        raise ValueError(
            f"kept-set offsets must start at 0, never decrease and end at len(ids) = "
            f"{ids.shape[0]}, got {offsets.tolist()[:4]}..."
        )
    return ids, lengths


def _rows(rows) -> tuple[torch.Tensor, torch.Tensor]:
    ids = [_ids(r) for r in rows]
    lengths = torch.tensor([t.shape[0] for t in ids], dtype=torch.int64)
    return (torch.cat(ids) if ids else torch.zeros(0, dtype=torch.int64)), lengths


# --- handing kept sets to the trainer-side drop-ins ---


@dataclass
class Replay:
    """The kept sets of the rows a drop-in call computes, in their order, and what the
    calls inside `replaying` found: per call, which targets lay outside their set."""

    kept_ids: torch.Tensor
    kept_offsets: torch.Tensor
    dropped: list = field(default_factory=list)  # per call: bool, the labels' shape

    @property
    def num_rows(self) -> int:
        return self.kept_offsets.shape[0] - 1

    @property
    def num_dropped(self) -> int:
        return int(sum(int(d.sum()) for d in self.dropped))

    def on(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        return self.kept_ids.to(device), self.kept_offsets.to(device)


_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("exactlogp_replay", default=None)


@contextlib.contextmanager
def replaying(kept_ids, kept_offsets=None, *, sort: bool = False):
    """Within this block, the patched log-prob drop-ins (TRL's selective_log_softmax,
    verl's logprobs_from_logits, megatron-core's vocab_parallel_cross_entropy) replay the
    rollout's kept sets: the log-softmax over each row's kept set (replay_logprobs), a
    target outside it 0 with a zero gradient, counted in the yielded Replay's `dropped`.
    Rows are the drop-in's rows in order (its labels flattened); a call with another
    number of rows raises. `kept_ids`: the CSR ids, with `kept_offsets`; or anything
    kept_csr takes (then no offsets)."""
    if kept_offsets is None:
        kept_ids, kept_offsets = kept_csr(kept_ids, sort=sort)
    replay = Replay(kept_ids, kept_offsets)
    token = _ACTIVE.set(replay)
    try:
        yield replay
    finally:
        _ACTIVE.reset(token)


def active() -> Replay | None:
    """The Replay of the enclosing `replaying` block, or None."""
    return _ACTIVE.get()


def replay_rows(replay: Replay, num_rows: int, what: str) -> None:
    """A drop-in's rows must be the kept sets' rows."""
    if num_rows != replay.num_rows:
        raise ValueError(
            f"{what} computes {num_rows} rows but the kept sets given to "
            f"exactlogp.integrations.replaying hold {replay.num_rows}: pass one kept set per "
            "row of the call, in the order of its labels flattened (padding rows included)"
        )


def replayed(logits, target, what: str, **options) -> LogprobResult | None:
    """Inside `replaying`: replay_logprobs of these rows (`logits` and `target` as the
    drop-in holds them; `options` those of replay_logprobs) over the active kept sets,
    a target outside its set 0 with a zero gradient (recorded in Replay.dropped); else
    None, and the drop-in computes as usual. `what` names the drop-in in messages."""
    replay = active()
    if replay is None:
        return None
    replay_rows(replay, target.numel(), what)
    res = replay_logprobs(logits, target, *replay.on(logits.device), **options)
    replay.dropped.append(res.dropped)
    return LogprobResult(torch.where(res.dropped, 0.0, res.logprobs), res.entropy, res.lse)
