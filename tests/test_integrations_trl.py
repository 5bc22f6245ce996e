"""exactlogp.integrations.trl: TRL's helpers on full logits, bitwise the operator's bits."""

from __future__ import annotations

import pytest
import torch

from exactlogp import selected_logprobs
from exactlogp.integrations import trl
from exactlogp.testing import (
    assert_bitwise_equal,
    error_bound,
    fp64_reference,
    llm_like_logits,
    simulate_shards,
    ulp32,
)

VOCAB = 509


@pytest.fixture(params=[torch.bfloat16, torch.float16, torch.float32])
def case(request):
    logits, index = llm_like_logits(12, VOCAB, request.param, seed=5)
    return logits.view(3, 4, VOCAB), index.view(3, 4)


def test_selective_log_softmax_bits_shape_and_accuracy(case):
    logits, index = case
    got = trl.selective_log_softmax(logits, index)
    assert got.shape == index.shape and got.dtype == torch.float32
    assert_bitwise_equal(got, selected_logprobs(logits, index).logprobs, "selective_log_softmax")
    ref = fp64_reference(logits.view(-1, VOCAB), index.view(-1))
    err = (got.view(-1).double() - ref.logprobs).abs()
    assert bool(
        (err <= 0.5 * ulp32(ref.logprobs) + error_bound(ref.scale["logprobs"], VOCAB)).all()
    )


def test_selective_log_softmax_equals_a_sharded_trainer(case):
    logits, index = case
    got = trl.selective_log_softmax(logits, index).view(-1)
    sharded = simulate_shards(logits.view(-1, VOCAB), index.view(-1), [0, 1, 200, 200, 400, VOCAB])
    assert_bitwise_equal(got, sharded.logprobs, "TRL full logits vs 5 uneven shards")


def test_selective_log_softmax_does_not_depend_on_the_batch(case):
    logits, index = case
    whole = trl.selective_log_softmax(logits, index)
    for i in range(logits.shape[0]):
        row = trl.selective_log_softmax(logits[i : i + 1], index[i : i + 1])
        assert_bitwise_equal(row[0], whole[i], f"row {i} alone")


def test_selective_log_softmax_k_ids_per_row(case):
    logits, index = case
    ids = torch.stack([index, (index + 7) % VOCAB, torch.zeros_like(index)], -1)  # (3, 4, 3)
    got = trl.selective_log_softmax(logits, ids)
    assert got.shape == ids.shape
    for k in range(3):
        assert_bitwise_equal(got[..., k], trl.selective_log_softmax(logits, ids[..., k]), f"k={k}")
    empty = trl.selective_log_softmax(logits, ids[..., :0])
    assert empty.shape == (3, 4, 0)


def test_ignore_index_rows_are_zero(case):
    logits, index = case
    index = index.clone()
    index[0, 1] = -100
    got = trl.selective_log_softmax(logits, index)
    assert got[0, 1].item() == 0.0


def test_selective_log_softmax_gradient(case):
    logits, index = case
    x = logits.float().requires_grad_()
    trl.selective_log_softmax(x, index).sum().backward()
    p = torch.softmax(logits.double(), -1)
    expected = torch.nn.functional.one_hot(index, VOCAB).double() - p
    torch.testing.assert_close(x.grad.double(), expected, atol=1e-7, rtol=0)


def test_entropy_from_logits_bits_and_accuracy(case):
    logits, index = case
    got = trl.entropy_from_logits(logits)
    assert got.shape == index.shape and got.dtype == torch.float32
    expected = selected_logprobs(logits, index, with_entropy=True).entropy
    assert_bitwise_equal(got, expected, "entropy")
    for chunk_size in (1, 5, 1000):
        assert_bitwise_equal(
            trl.entropy_from_logits(logits, chunk_size), got, f"chunk {chunk_size}"
        )
    ref = fp64_reference(logits.view(-1, VOCAB), index.view(-1))
    err = (got.view(-1).double() - ref.entropy).abs()
    assert bool((err <= 0.5 * ulp32(ref.entropy) + error_bound(ref.scale["entropy"], VOCAB)).all())


def test_bad_arguments():
    logits, index = llm_like_logits(4, 11, torch.float32)
    with pytest.raises(ValueError, match=r"index shape \(2,\) must be logits shape"):
        trl.selective_log_softmax(logits, index[:2])
    with pytest.raises(ValueError, match=r"index shape \(4, 2, 1\)"):
        trl.selective_log_softmax(logits, index.view(4, 1, 1).expand(4, 2, 1))
    with pytest.raises(TypeError, match="must be torch.Tensors, got Tensor and list"):
        trl.selective_log_softmax(logits, [1, 2])
    with pytest.raises(TypeError, match="bfloat16, float16 or float32, got torch.float64"):
        trl.selective_log_softmax(logits.double(), index)
    with pytest.raises(ValueError, match="chunk_size must be >= 1, got 0"):
        trl.entropy_from_logits(logits, 0)
    with pytest.raises(TypeError, match="chunk_size must be an int, got float"):
        trl.entropy_from_logits(logits, 2.0)
