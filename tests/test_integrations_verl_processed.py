"""exactlogp.integrations.verl processed logprobs (top-k / top-p / min-p) against the real
verl 0.9.1: the explicit functions, and patch_verl(top_k=, top_p=, min_p=) reaching verl's
own bindings (the FSDP engine's `logprobs_from_logits`, the Megatron engine's
`vocab_parallel_log_probs_from_logits`; its Megatron state stubbed to TP=1 -- the TP
invariance of the cut is tested in real gloo worlds in test_processed.py)."""

from __future__ import annotations

import importlib
import sys

import pytest
import torch
import verl.utils.torch_functional as verl_F

import exactlogp
from exactlogp.integrations import verl
from exactlogp.testing import llm_like_logits
from integration_stubs import install_megatron

CUT = {"top_k": 20, "top_p": 0.9, "min_p": 0.05}


def _case(dtype=torch.bfloat16):
    logits, labels = llm_like_logits(12, 333, dtype, seed=7)
    labels = labels.clone()
    labels[:4] = logits[:4].float().argmax(-1)  # kept under any cut
    return logits / 0.7, labels  # verl divides by the temperature before these functions


def test_processed_logprobs_from_logits_masks_and_counts():
    logits, labels = _case()
    exact = exactlogp.processed_logprobs(logits, labels, **CUT)
    assert bool(exact.dropped.any()) and not bool(exact.dropped[:4].any())
    verl.dropped_tokens(reset=True)
    mask = torch.ones_like(labels, dtype=torch.bool)
    mask[0] = False
    got = verl.processed_logprobs_from_logits(logits, labels, loss_mask=mask, **CUT)
    assert torch.equal(got.logprobs, exact.logprobs.masked_fill(exact.dropped, 0))
    assert torch.equal(got.loss_mask, ~exact.dropped & mask)
    assert int(got.num_dropped) == int(exact.num_dropped) == verl.dropped_tokens()
    # verl's "no cut" conventions give the plain logprobs
    plain = verl.processed_logprobs_from_logits(logits, labels, top_k=-1, top_p=1.0)
    assert torch.equal(
        plain.logprobs, verl.logprobs_from_logits(logits, labels, out_dtype=torch.float32)
    )


def test_vocab_parallel_processed_log_probs(monkeypatch):
    install_megatron(monkeypatch)
    logits, labels = _case()
    got = verl.vocab_parallel_processed_log_probs(logits, labels, **CUT)
    exact = exactlogp.processed_logprobs(logits, labels, **CUT)
    assert torch.equal(got.logprobs, exact.logprobs.masked_fill(exact.dropped, 0))
    assert torch.equal(got.loss_mask, ~exact.dropped)


def test_patch_verl_with_a_cut_reaches_verls_bindings(monkeypatch):
    install_megatron(monkeypatch)
    for name in (
        "verl.workers.engine.fsdp.transformer_impl",
        "verl.utils.megatron.tensor_parallel",
    ):
        importlib.import_module(name)
    fsdp = sys.modules["verl.workers.engine.fsdp.transformer_impl"]
    mcore_tp = sys.modules["verl.utils.megatron.tensor_parallel"]
    logits, labels = _case()
    logits.requires_grad_(True)
    exact = exactlogp.processed_logprobs(logits.detach(), labels, **CUT)
    handle = verl.patch_verl(**CUT)
    try:
        assert set(handle.options) == {"vocab_size", *CUT} and handle.options["top_k"] == 20
        got = fsdp.logprobs_from_logits(logits=logits, labels=labels, inplace_backward=False)
        assert got.dtype == logits.dtype  # verl's dtype (no flash-attn here)
        assert torch.equal(got, exact.logprobs.masked_fill(exact.dropped, 0).to(logits.dtype))
        got.float().sum().backward()
        assert bool((logits.grad[exact.dropped] == 0).all())
        assert bool((logits.grad[~exact.dropped] != 0).any())
        mc = mcore_tp.vocab_parallel_log_probs_from_logits(logits.detach(), labels)
        assert torch.equal(mc, exact.logprobs.masked_fill(exact.dropped, 0))
        fused = sys.modules["verl.utils.experimental.torch_functional"].FusedLinearForPPO()
        with pytest.raises(ValueError, match="use_fused_kernels"):
            fused(torch.randn(2, 4), torch.randn(9, 4), torch.zeros(2, dtype=torch.int64))
    finally:
        verl.unpatch_verl()
    assert fsdp.logprobs_from_logits is verl_F.logprobs_from_logits
    with pytest.raises(ValueError, match="top_p"):
        verl.patch_verl(top_p=0.0)
    assert not verl.unpatch_verl()
