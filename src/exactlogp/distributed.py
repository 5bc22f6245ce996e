"""The only module that talks to torch.distributed.

Per forward: one all_reduce(MAX) of fp32 and one all_reduce(SUM) of int64, neither of which
can change a bit with the algorithm, protocol, channel count or rank order (max is exact,
integer addition is associative; no float is ever summed here). With validate=True a
small fixed-size all_gather of int64 agreement fields comes first (exactlogp.agreement).
The exact LM head's backward adds an int64 MAX and an int64 SUM, and its sequence-parallel
helper an all_gather of rows (linear.py).
"""

from __future__ import annotations

import threading
from contextlib import nullcontext
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Group:
    """The TP group of one call as this process sees it."""

    handle: object  # the ProcessGroup (or an object with rank() and size()); None: no TP
    rank: int
    size: int

    @property
    def distributed(self) -> bool:
        return self.size > 1

    def global_ranks(self) -> list[int] | None:
        """The group's ranks in the default group, where torch can tell them."""
        if self.handle is None:
            return None
        import torch.distributed as dist

        try:
            return list(dist.get_process_group_ranks(self.handle))
        except Exception:  # an object that is only rank()/size(), or no default group
            return None


NO_GROUP = Group(None, 0, 1)  # tp_group=None: the whole vocabulary in this process


def resolve(group) -> Group:
    """Group(handle, rank, size) of `group`: None is a group of one (no TP). Objects with
    rank() and size() methods (a ProcessGroup, or what Megatron's get_pg_rank accepts) are
    asked directly; a process that is not a member of `group` is refused here, since
    it can take part in none of the group's collectives."""
    if group is None:
        return NO_GROUP
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import GroupMember

    if group is GroupMember.NON_GROUP_MEMBER or (
        isinstance(group, int) and group == GroupMember.NON_GROUP_MEMBER
    ):
        raise ValueError(_not_a_member())
    if callable(getattr(group, "rank", None)) and callable(getattr(group, "size", None)):
        rank, size = int(group.rank()), int(group.size())
    else:
        if not dist.is_initialized():
            raise ValueError(
                "tp_group was given but torch.distributed is not initialized; call "
                "torch.distributed.init_process_group first, or pass tp_group=None"
            )
        rank, size = dist.get_rank(group), dist.get_world_size(group)
    if rank < 0 or size < 1 or rank >= size:
        raise ValueError(_not_a_member(rank, size))
    return Group(group, rank, size)


def _not_a_member(rank: int | None = None, size: int | None = None) -> str:
    where = ""
    try:
        import torch.distributed as dist

        if dist.is_initialized():
            where = f" (global rank {dist.get_rank()})"
    except Exception:
        pass
    seen = "" if rank is None else f"; it reports rank {rank} of {size}"
    return (
        f"this process{where} is not a member of tp_group{seen}: only the ranks of the "
        "group may call exactlogp with it (build tp_group with torch.distributed.new_group "
        "on every rank, and call with it only on its members)"
    )


def collective_device(group: Group) -> torch.device:
    """Where the group's collectives want their tensors: the current CUDA device for NCCL,
    else the CPU."""
    if group.handle is not None:
        import torch.distributed as dist

        try:
            if dist.get_backend(group.handle) == "nccl":
                return torch.device("cuda", torch.cuda.current_device())
        except Exception:  # an object that is only rank()/size()
            pass
    return torch.device("cpu")


# --- the collectives ---


def all_gather(t: torch.Tensor, group: Group) -> list[torch.Tensor]:
    """Every rank's `t` (all of one shape), in rank order: moves bytes only."""
    import torch.distributed as dist

    parts = [torch.empty_like(t) for _ in range(group.size)]
    dist.all_gather(parts, t.contiguous(), group=group.handle)
    return parts


def all_gather_int64(fields: torch.Tensor, group: Group) -> torch.Tensor:
    """(size, K) int64: every rank's (K,) `fields`, in rank order."""
    return torch.stack(all_gather(fields, group))


def all_reduce_max_(values: torch.Tensor, group: Group) -> torch.Tensor:
    """In place: the exact elementwise maximum over ranks (fp32 or int64: a max is exact
    in any order)."""
    if group.distributed:
        import torch.distributed as dist

        dist.all_reduce(values, op=dist.ReduceOp.MAX, group=group.handle)
    return values


def all_reduce_sum_(record: torch.Tensor, group: Group) -> torch.Tensor:
    """In place: the exact sum over ranks of an int64 tensor."""
    if record.dtype != torch.int64:
        raise TypeError(f"all_reduce_sum_ carries int64 only, got {record.dtype}")
    if group.distributed:
        import torch.distributed as dist

        dist.all_reduce(record, op=dist.ReduceOp.SUM, group=group.handle)
    return record


# --- one call at a time per group in this process ---

_locks: dict[int, threading.Lock] = {}
_locks_guard = threading.Lock()


_ALONE = nullcontext()  # a group of one: nothing to serialise


def serialized(group: Group):
    """Calls on one group from several threads of this process run one after another,
    so each call's collectives stay together. (Which thread goes first may still differ
    between ranks; the agreement fields then tell the calls apart, see agreement.py.)"""
    if not group.distributed:
        return _ALONE
    with _locks_guard:
        return _locks.setdefault(id(group.handle), threading.Lock())
