"""exactlogp.integrations.verl on one process (Megatron state stubbed to TP=1).

The same functions on real Megatron tensor-parallel groups of 1, 2 and 4 are checked in
test_integrations_megatron.py (one gloo world serves both).
"""

from __future__ import annotations

import pytest
import torch

from exactlogp import selected_logprobs
from exactlogp.integrations import verl
from exactlogp.testing import assert_bitwise_equal, llm_like_logits
from integration_stubs import install_megatron


@pytest.fixture
def case(monkeypatch):
    install_megatron(monkeypatch)
    return llm_like_logits(12, 333, torch.bfloat16, seed=3)


def test_log_probs_shape_and_bits(case):
    logits, labels = case
    got = verl.vocab_parallel_log_probs_from_logits(logits, labels)
    assert got.shape == labels.shape and got.dtype == torch.float32
    assert_bitwise_equal(got, selected_logprobs(logits, labels).logprobs, "log probs")


def test_entropy_shape_and_bits(case):
    logits, labels = case
    got = verl.vocab_parallel_entropy(logits.view(3, 4, -1))
    assert got.shape == (3, 4)
    expected = selected_logprobs(logits, labels, with_entropy=True).entropy
    assert_bitwise_equal(got.view(-1), expected, "entropy")


def test_combined_call_equals_the_two_calls(case):
    logits, labels = case
    logp, entropy = verl.vocab_parallel_log_probs_and_entropy(logits, labels)
    assert_bitwise_equal(logp, verl.vocab_parallel_log_probs_from_logits(logits, labels), "logp")
    assert_bitwise_equal(entropy, verl.vocab_parallel_entropy(logits), "entropy")


def test_gradients_flow_through_both(case):
    logits, labels = case
    x = logits.float().requires_grad_()
    logp, entropy = verl.vocab_parallel_log_probs_and_entropy(x, labels)
    (logp.sum() + entropy.sum()).backward()
    y = logits.double().requires_grad_()
    ref_logp = torch.log_softmax(y, -1).gather(-1, labels[:, None]).squeeze(-1)
    p = torch.softmax(y, -1)
    ref_entropy = -(p * torch.log_softmax(y, -1)).sum(-1)
    (ref_logp.sum() + ref_entropy.sum()).backward()
    torch.testing.assert_close(x.grad.double(), y.grad, atol=1e-6, rtol=0)


def test_vocab_size_leaves_padding_out(case):
    logits, labels = case
    padded = torch.cat([logits, torch.full((12, 19), 50.0, dtype=logits.dtype)], -1)
    got = verl.vocab_parallel_entropy(padded, vocab_size=333)
    assert_bitwise_equal(got, verl.vocab_parallel_entropy(logits), "padded entropy")


def test_uninitialized_megatron_state_is_a_clear_error(monkeypatch):
    install_megatron(monkeypatch, initialized=False)
    logits, labels = llm_like_logits(2, 10, torch.float32)
    with pytest.raises(RuntimeError, match="not initialized"):
        verl.vocab_parallel_entropy(logits)


def test_bad_logits_type(case):
    with pytest.raises(TypeError, match="logits must be a torch.Tensor, got list"):
        verl.vocab_parallel_log_probs_from_logits([1.0], torch.tensor(0))
