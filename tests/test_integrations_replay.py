"""The engines' kept sets into the trainer-side drop-ins: kept_csr and replaying.

vLLM's SamplingMask (and its scheduler's CSR) and SGLang's output_token_sampling_mask
become CSR without a dense mask; inside `replaying`, the patched TRL and verl functions
(the real packages) and the Megatron cross entropy (a 2-rank gloo world) return the bits
of exactlogp.replay_logprobs, a target outside its set 0 and counted.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from exactlogp import replay_logprobs
from exactlogp.integrations import kept_csr, replaying
from exactlogp.integrations import megatron as megatron_dropin
from exactlogp.integrations import trl as trl_dropin
from exactlogp.integrations import verl as verl_dropin
from exactlogp.testing import assert_bitwise_equal, llm_like_logits, run_gloo_world

VOCAB = 300


class VllmSamplingMask:  # the shape of vllm.outputs.SamplingMask: one list per token
    def __init__(self, token_ids):
        self.token_ids = token_ids


class VllmSamplingMaskLists:  # the shape of vllm.v1.outputs.SamplingMaskLists
    def __init__(self, token_ids, offsets=None):
        self.token_ids, self.offsets = token_ids, offsets


def _sets(t: torch.Tensor, seed: int, drop=()):
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for r, target in enumerate(t.reshape(-1).tolist()):
        ids = set(torch.randint(0, VOCAB, (20,), generator=gen).tolist()) - {target}
        rows.append(sorted(ids if r in drop else ids | {target}))
    return rows


def test_kept_csr_takes_what_the_engines_return():
    rows = [[3, 9, 40], [7], [1, 2, 299]]
    want = (torch.tensor([3, 9, 40, 7, 1, 2, 299]), torch.tensor([0, 3, 4, 7]))
    forms = {
        "vLLM SamplingMask per sequence": [VllmSamplingMask(rows[:2]), VllmSamplingMask(rows[2:])],
        "vLLM SamplingMaskLists": VllmSamplingMaskLists(
            np.array([3, 9, 40, 7, 1, 2, 299], dtype=np.int32), np.array([0, 3, 4, 7])
        ),
        "a CSR pair": (torch.tensor([3, 9, 40, 7, 1, 2, 299]), torch.tensor([0, 3, 4, 7])),
        "SGLang lists, by probability": [[40, 3, 9], [7], [299, 1, 2]],
        "numpy rows": [np.array(r) for r in rows],
    }
    for name, form in forms.items():
        got = kept_csr(form, sort=name.startswith("SGLang"))
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), name
    single = kept_csr(VllmSamplingMaskLists(np.array([5, 6], dtype=np.int32)))  # one position
    assert single[0].tolist() == [5, 6] and single[1].tolist() == [0, 2]
    with pytest.raises(TypeError, match="kept token ids must be integers"):
        kept_csr([[1.5, 2.0]])
    with pytest.raises(ValueError, match="offsets must start at 0, never decrease"):
        kept_csr((torch.tensor([1, 2]), torch.tensor([0, 3])))
    unsorted = kept_csr([[40, 3]])  # left for replay_logprobs to name
    with pytest.raises(ValueError, match="not strictly increasing .* sort an SGLang row"):
        replay_logprobs(torch.randn(1, VOCAB), torch.tensor([3]), *unsorted)


def test_trl_and_verl_drop_ins_replay_inside_the_block():
    """The real TRL and verl functions, patched: inside `replaying` their logprobs are
    replay_logprobs' (a dropped target 0 and counted); outside, the full vocabulary."""
    import trl.trainer.utils as trl_utils
    import verl.utils.torch_functional as verl_F

    x, t = llm_like_logits(6, VOCAB, torch.bfloat16, seed=3)
    x, t = x.view(2, 3, VOCAB), t.view(2, 3)
    rows = _sets(t, seed=1, drop=(4,))
    ids, offsets = kept_csr(rows)
    want = replay_logprobs(x, t, ids, offsets)
    trl_dropin.patch_trl()
    verl_dropin.patch_verl()
    try:
        with replaying(rows) as replay:
            got_trl = trl_utils.selective_log_softmax(x, t)
            got_verl = verl_F.logprobs_from_logits(x.reshape(6, VOCAB), t.reshape(6))
        outside = trl_utils.selective_log_softmax(x, t)
    finally:
        trl_dropin.unpatch_trl()
        verl_dropin.unpatch_verl()
    expected = torch.where(want.dropped, 0.0, want.logprobs)
    # each in its host's output dtype (TRL: the logits', bf16 here)
    assert_bitwise_equal(got_trl, expected.to(got_trl.dtype), "TRL's selective_log_softmax")
    assert_bitwise_equal(got_verl.view(2, 3), expected.to(got_verl.dtype), "verl's log-probs")
    assert replay.num_dropped == 2 and [bool(d.view(-1)[4]) for d in replay.dropped] == [True] * 2
    assert not torch.equal(outside.float(), expected)  # the full vocabulary outside the block
    with replaying(rows[:5]), pytest.raises(ValueError, match="computes 6 rows but the kept "
                                                              "sets .* hold 5"):  # fmt: skip
        trl_dropin.selective_log_softmax(x, t)


def _megatron_worker(rank, world, group, data):
    x, t, rows = data
    width = -(-VOCAB // world)
    shard = x[:, rank * width : (rank + 1) * width]
    with replaying(rows) as replay:
        loss = megatron_dropin.vocab_parallel_cross_entropy(shard, t, 0.0, group)
    return loss, replay.num_dropped


def test_megatron_cross_entropy_replays_on_every_tp_degree():
    x, t = llm_like_logits(5, VOCAB, torch.bfloat16, seed=4)
    rows = _sets(t, seed=2, drop=(1,))
    want = replay_logprobs(x, t, *kept_csr(rows))
    expected = -torch.where(want.dropped, 0.0, want.logprobs)
    for loss, dropped in run_gloo_world(2, _megatron_worker, (x, t, rows), timeout=120):
        assert_bitwise_equal(loss, expected, "Megatron's vocab_parallel_cross_entropy at TP 2")
        assert dropped == 1
