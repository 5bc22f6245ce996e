"""DTensor inputs (FSDP2 / torchtitan tensor parallel) in a gloo world of 2 CPU ranks:
logits sharded on the vocabulary give the TP = 1 bits, with the group and vocab_start
read from the placement (509 columns split like torch.chunk: 255 + 254). TRL's fused head
takes an LM-head weight sharded on its rows (FSDP2) as TRL does: gathered whole, each rank
computing its own rows of data -- which may differ between ranks."""

from __future__ import annotations

import torch

import exactlogp
from exactlogp.integrations import trl, verl
from exactlogp.testing import assert_bitwise_equal, llm_like_logits, run_gloo_world

VOCAB = 509


def _inputs():
    logits, target = llm_like_logits(10, VOCAB, torch.float32, seed=8)
    g = torch.Generator().manual_seed(8)
    hidden = torch.randn(10, 24, generator=g)
    weight = torch.randn(VOCAB, 24, generator=g) / 24**0.5
    return logits, target, hidden, weight


def _worker(rank, world_size, group, logits, target, hidden, weight):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    out = {}
    dlogits = distribute_tensor(logits, mesh, [Shard(1)])
    out["logprobs"] = verl.logprobs_from_logits(dlogits, target)
    out["entropy"] = verl.entropy_from_logits(dlogits)
    dweight = distribute_tensor(weight.clone(), mesh, [Shard(0)]).requires_grad_()
    h = hidden.clone().requires_grad_()
    lp, ent, *_ = trl.ChunkedLogProbFunction.apply(
        h, dweight, None, target, 0.7, 64, None, 1.0, ("entropy",)
    )
    (lp.sum() + 0.5 * ent.sum()).backward()
    out["fused"] = (lp.detach(), ent.detach(), h.grad, dweight.grad.full_tensor())
    # FSDP2: each rank its own rows of data (here: its own scale of the hidden states)
    dweight = distribute_tensor(weight.clone(), mesh, [Shard(0)]).requires_grad_()
    h = (hidden * (1 + rank)).requires_grad_()
    lp, ent, *_ = trl.ChunkedLogProbFunction.apply(
        h, dweight, None, target, 0.7, 64, None, 1.0, ("entropy",)
    )
    (lp.sum() + 0.5 * ent.sum()).backward()
    out["data_parallel"] = (lp.detach(), ent.detach(), h.grad, dweight.grad.to_local())
    # verl's Megatron fused forward: Megatron's even split (rank r from r * V_local)
    width = (VOCAB - 1) // world_size
    rows = weight[rank * width : (rank + 1) * width]
    out["megatron_fused"] = verl.linear_cross_entropy(
        hidden, rows, target % (VOCAB - 1), 0.7, "none", group
    )
    return out


def test_dtensor_inputs_give_the_tp1_bits():
    logits, target, hidden, weight = _inputs()
    full = exactlogp.selected_logprobs(logits, target, with_entropy=True)
    h = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    ref = exactlogp.linear_selected_logprobs(h, w, target, temperature=0.7, with_entropy=True)
    (ref.logprobs.sum() + 0.5 * ref.entropy.sum()).backward()
    even = exactlogp.linear_selected_logprobs(
        hidden, weight[:-1], target % (VOCAB - 1), temperature=0.7
    )
    for rank, out in enumerate(
        run_gloo_world(2, _worker, logits, target, hidden, weight, timeout=300)
    ):
        assert_bitwise_equal(out["logprobs"], full.logprobs, f"rank {rank} logits logprobs")
        assert_bitwise_equal(out["entropy"], full.entropy, f"rank {rank} logits entropy")
        lp, ent, gh, gw = out["fused"]
        assert_bitwise_equal(lp, ref.logprobs.detach(), f"rank {rank} fused logprobs")
        assert_bitwise_equal(ent, ref.entropy.detach(), f"rank {rank} fused entropy")
        assert_bitwise_equal(gh, h.grad, f"rank {rank} hidden gradient")
        assert_bitwise_equal(gw, w.grad, f"rank {rank} weight gradient")
        assert_bitwise_equal(out["megatron_fused"][0], even.logprobs, f"rank {rank} verl mcore")
        # data parallel: this rank's rows alone, over the whole weight; its rows of the
        # weight gradient are the rows of its own data's gradient (full_tensor's backward)
        own_h = (hidden * (1 + rank)).requires_grad_()
        own_w = weight.clone().requires_grad_()
        own = exactlogp.linear_selected_logprobs(
            own_h, own_w, target, temperature=0.7, with_entropy=True
        )
        (own.logprobs.sum() + 0.5 * own.entropy.sum()).backward()
        lp, ent, gh, gw = out["data_parallel"]
        rows = slice(0, 255) if rank == 0 else slice(255, VOCAB)  # torch.chunk's split
        assert_bitwise_equal(lp, own.logprobs.detach(), f"rank {rank} data-parallel logprobs")
        assert_bitwise_equal(ent, own.entropy.detach(), f"rank {rank} data-parallel entropy")
        assert_bitwise_equal(gh, own_h.grad, f"rank {rank} data-parallel hidden gradient")
        assert_bitwise_equal(gw, own_w.grad[rows], f"rank {rank} data-parallel weight rows")
