"""Collective settings: real NCCL knobs on CUDA, emulated reduction orders on gloo.

NCCL's algorithm, protocol and channel count change the order in which an all_reduce
adds the ranks' values, and so the bits of a float SUM. gloo has no such knobs, so on
gloo the harness replays the orders those algorithms use: while a setting is active,
every floating-point `torch.distributed.all_reduce` any candidate issues becomes an
all_gather (exact copies) followed by the reduction in that setting's order:

  as_is        the process group's own all_reduce, untouched (only counted)
  ring_from_k  ((x_k + x_k+1) + x_k+2) + ...   a ring that starts at rank k
  tree         pairwise binary tree ((x_0 + x_1) + (x_2 + x_3))
  reversed     ((x_W-1 + x_W-2) + ...) + x_0

Integer all_reduces are exact in every order and are left alone.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

NCCL_KNOBS = ("NCCL_ALGO", "NCCL_PROTO", "NCCL_MAX_NCHANNELS")
NCCL_ALGOS = ("Ring", "Tree")
NCCL_PROTOS = ("LL", "LL128", "Simple")
NCCL_CHANNELS = ("1", None)  # None: NCCL's default


@dataclass(frozen=True)
class Setting:
    name: str
    description: str
    env: tuple[tuple[str, str | None], ...] = ()  # NCCL environment of a fresh world

    def as_dict(self) -> dict:
        out = {"name": self.name, "description": self.description}
        if self.env:
            out.update(dict(self.env))
        return out


def emulated_settings(world_size: int) -> list[Setting]:
    settings = [Setting("as_is", "the gloo process group's own all_reduce")]
    settings += [
        Setting(f"ring_from_{k}", f"emulated ring reduction starting at rank {k}")
        for k in range(world_size)
    ]
    settings += [
        Setting("tree", "emulated pairwise binary-tree reduction"),
        Setting("reversed", "emulated sequential reduction from the last rank to rank 0"),
    ]
    return settings


def nccl_settings() -> list[Setting]:
    out = [Setting("nccl_default", "NCCL defaults", tuple((k, None) for k in NCCL_KNOBS))]
    for algo in NCCL_ALGOS:
        for proto in NCCL_PROTOS:
            for channels in NCCL_CHANNELS:
                env = tuple(zip(NCCL_KNOBS, (algo, proto, channels), strict=True))
                name = f"{algo}/{proto}/{channels or 'default'}"
                out.append(Setting(name, f"fresh NCCL world with {name}", env))
    return out


def rank_order(setting: Setting, world_size: int) -> list:
    """The reduction as a nested list of rank indices: [a, b] means (a + b)."""
    if setting.name.startswith("ring_from_"):
        start = int(setting.name.removeprefix("ring_from_"))
        order = [(start + i) % world_size for i in range(world_size)]
    elif setting.name == "reversed":
        order = list(range(world_size - 1, -1, -1))
    elif setting.name == "tree":
        level: list = list(range(world_size))
        while len(level) > 1:
            level = [
                level[i : i + 2] if i + 1 < len(level) else level[i]
                for i in range(0, len(level), 2)
            ]
        return level[0]
    else:
        raise ValueError(f"setting {setting.name!r} has no emulated order")
    tree = order[0]
    for r in order[1:]:
        tree = [tree, r]
    return tree


def _combine(node, parts: list[torch.Tensor], op) -> torch.Tensor:
    if isinstance(node, int):
        return parts[node]
    left, right = (_combine(n, parts, op) for n in node)
    return op(left, right)


class _Done:
    """What an async all_reduce returns once it has already completed."""

    def wait(self, *args, **kwargs) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class FloatAllReduceCounter:
    def __init__(self):
        self.count = 0


@contextlib.contextmanager
def emulate(setting: Setting | None):
    """Within the block, float all_reduces follow `setting` (None or as_is: unchanged);
    yields a counter of the float all_reduces issued."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    original = dist.all_reduce
    counter = FloatAllReduceCounter()
    ops = {
        dist.ReduceOp.SUM: torch.add,
        dist.ReduceOp.MAX: torch.maximum,
        dist.ReduceOp.MIN: torch.minimum,
        dist.ReduceOp.PRODUCT: torch.mul,
    }

    def patched(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if not tensor.is_floating_point():
            return original(tensor, op=op, group=group, async_op=async_op)
        counter.count += 1
        if setting is None or setting.name == "as_is" or op not in ops:
            return original(tensor, op=op, group=group, async_op=async_op)
        world = dist.get_world_size(group)
        parts = [torch.empty_like(tensor) for _ in range(world)]
        dist.all_gather(parts, tensor.contiguous(), group=group)
        tensor.copy_(_combine(rank_order(setting, world), parts, ops[op]))
        return _Done() if async_op else None

    dist.all_reduce = patched
    c10d.all_reduce = patched
    try:
        yield counter
    finally:
        dist.all_reduce = original
        c10d.all_reduce = original
