"""The only module that talks to torch.distributed: one MAX and one int64 SUM per forward.

Neither collective can change a bit with the algorithm, protocol, channel count or rank
order: max is exact, and integer addition is associative. No float is ever summed here.
"""

from __future__ import annotations

import torch


def rank_and_world_size(group) -> tuple[int, int]:
    """(rank, world size) of this process in `group`; (0, 1) for None."""
    if group is None:
        return 0, 1
    import torch.distributed as dist

    return dist.get_rank(group), dist.get_world_size(group)


def all_reduce_max_(row_max: torch.Tensor, group) -> torch.Tensor:
    """In place: the exact maximum over ranks of an fp32 (N,) tensor."""
    if group is not None:
        import torch.distributed as dist

        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
    return row_max


def all_reduce_sum_(record: torch.Tensor, group) -> torch.Tensor:
    """In place: the exact sum over ranks of an int64 (N, k) record."""
    if record.dtype != torch.int64:
        raise TypeError(f"all_reduce_sum_ carries int64 only, got {record.dtype}")
    if group is not None:
        import torch.distributed as dist

        dist.all_reduce(record, op=dist.ReduceOp.SUM, group=group)
    return record
