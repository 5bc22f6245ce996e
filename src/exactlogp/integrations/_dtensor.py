"""DTensor inputs (FSDP2, torchtitan tensor parallel): a tensor sharded on its vocabulary
dimension becomes (local shard, process group, vocab_start, global vocabulary) for
exactlogp, read from its placement; any other layout is gathered with `full_tensor()`.

`Shard(d)` splits like `torch.chunk`: with V columns over n ranks each holds
ceil(V / n) of them, the last ones fewer or none, so rank r starts at min(r * ceil(V / n), V).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class VocabShard:
    local: torch.Tensor  # this rank's columns (a plain tensor; differentiable to the DTensor)
    tp_group: object  # None when the tensor holds the whole vocabulary
    vocab_start: int | None
    vocab_size: int  # the global vocabulary of the tensor


def is_dtensor(value) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch built without distributed
        return False
    return isinstance(value, DTensor)


def vocab_shard(tensor: torch.Tensor, vocab_dim: int) -> VocabShard:
    """Where `tensor` (a DTensor) keeps its vocabulary dimension `vocab_dim`."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    ndim = tensor.dim()
    vocab_dim = vocab_dim % ndim
    vocab = tensor.shape[vocab_dim]
    mesh = tensor.device_mesh
    sharded = [
        i
        for i, p in enumerate(tensor.placements)
        if isinstance(p, Shard) and p.dim % ndim == vocab_dim
    ]
    others = [
        p
        for i, p in enumerate(tensor.placements)
        if i not in sharded and not isinstance(p, Replicate)
    ]
    if len(sharded) != 1 or others or any(isinstance(p, Partial) for p in tensor.placements):
        # sharded on another dimension too, or pending a reduction: gather it whole
        return VocabShard(tensor.full_tensor(), None, None, vocab)
    mesh_dim = sharded[0]
    ranks = mesh.size(mesh_dim)
    rank = mesh.get_local_rank(mesh_dim)
    width = -(-vocab // ranks)
    start = min(rank * width, vocab)
    if ranks == 1:
        return VocabShard(tensor.to_local(), None, None, vocab)
    return VocabShard(tensor.to_local(), mesh.get_group(mesh_dim), start, vocab)
