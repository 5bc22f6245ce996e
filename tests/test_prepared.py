"""prepare_lm_head: a weight prepared once gives the bits of the weight itself, slices the
weight once on the fused route, and refuses to serve a weight that changed."""

import pytest
import torch

import exactlogp
from exactlogp.backends.triton import linear_kernels
from exactlogp.backends.triton.launch import TritonBackend
from exactlogp.testing import assert_bitwise_equal, lm_head_inputs

BACKENDS = ["reference", "cpu", TritonBackend(exact_gemm="int8_fused")]


def _outputs(h, weight, w, t, bias, backend):
    """Logits, logprobs, entropy, lse and the three gradients; `weight` is w or its handle."""
    hh, bb = h.detach().requires_grad_(True), bias.detach().requires_grad_(True)
    w.grad = None
    z = exactlogp.linear_logits(h, weight, bias, logit_scale=0.5, backend=backend)
    res = exactlogp.linear_selected_logprobs(
        hh, weight, t, bias=bb, logit_scale=0.5, with_entropy=True, backend=backend
    )
    (res.logprobs.sum() + 0.25 * res.entropy.sum()).backward()
    return [x.detach().clone() for x in (z, *res, hh.grad, w.grad, bb.grad)]


@pytest.mark.parametrize("backend", BACKENDS, ids=str)
def test_a_prepared_head_gives_the_bits_of_its_weight(backend):
    h, w, t = lm_head_inputs(7, 24, 70, torch.bfloat16, seed=11)
    t[3] = -100
    bias = (0.1 * torch.randn(70, generator=torch.Generator().manual_seed(2))).bfloat16()
    w.requires_grad_(True)
    head = exactlogp.prepare_lm_head(w, backend=backend)
    plain = _outputs(h, w, w, t, bias, backend)
    for _ in range(2):  # and again: nothing of the first call is left in the handle
        for a, b in zip(_outputs(h, head, w, t, bias, backend), plain, strict=True):
            assert_bitwise_equal(a, b)


def test_the_fused_route_slices_a_prepared_weight_once(monkeypatch):
    sliced = []
    real = linear_kernels.head_slices
    monkeypatch.setattr(linear_kernels, "head_slices",
                        lambda x, e, f, reverse: sliced.append(reverse) or real(x, e, f, reverse))  # fmt: skip
    h, w, t = lm_head_inputs(4, 16, 40, torch.float32, seed=12)
    # on L2's grid (multiples of 2^-6, 2^-8 below 2): the fused kernel takes every block
    h, w = (h * 64).round().clamp(-120, 120) / 64, (w * 256).round().clamp(-500, 500) / 256
    fused = TritonBackend(exact_gemm="int8_fused")
    head = exactlogp.prepare_lm_head(w, backend=fused)
    assert sliced == [False] and "int8 layout" in repr(head)
    for _ in range(3):
        exactlogp.linear_selected_logprobs(h, head, t, backend=fused)
    assert sliced == [False, True, True, True]  # the hidden states only
    exactlogp.linear_selected_logprobs(h, w, t, backend=fused)
    assert sliced[-2:] == [False, True]  # without the handle: the weight each call
    # a handle prepared for a backend without the layout makes it on first fused use
    other = exactlogp.prepare_lm_head(w, backend="reference")
    exactlogp.linear_logits(h, other, backend=fused)
    exactlogp.linear_logits(h, other, backend=fused)
    assert sliced[-3:] == [True, False, True]


def test_a_changed_weight_is_refused_until_refresh():
    h, w, t = lm_head_inputs(3, 16, 30, torch.float32, seed=13)
    head = exactlogp.prepare_lm_head(w)
    with torch.no_grad():
        w.mul_(2.0)  # what an optimizer step does: the version counter moves
    with pytest.raises(ValueError, match=r"changed after it was prepared .*refresh\(\)"):
        exactlogp.linear_selected_logprobs(h, head, t)
    with pytest.raises(ValueError, match=r"refresh\(\)"):
        exactlogp.linear_logits(h, head)
    assert head.refresh() is head
    assert_bitwise_equal(exactlogp.linear_logits(h, head), exactlogp.linear_logits(h, w))


def test_writes_through_data_are_not_detected_as_documented():
    """`p.data.copy_` (how weight syncs write) bypasses the version counter: the handle
    cannot see it, which its docstring says; refresh() is the caller's part."""
    h, w, _ = lm_head_inputs(3, 16, 30, torch.float32, seed=14)
    head = exactlogp.prepare_lm_head(w)
    w.data.copy_(4.0 * w)
    exactlogp.linear_logits(h, head)  # no error: stale, as documented
    head.refresh()
    assert_bitwise_equal(exactlogp.linear_logits(h, head), exactlogp.linear_logits(h, w))


def test_prepare_lm_head_checks_its_weight():
    with pytest.raises(TypeError, match="weight must be a torch.Tensor, got list"):
        exactlogp.prepare_lm_head([[1.0]])
    with pytest.raises(TypeError, match="weight must be bfloat16, float16 or float32"):
        exactlogp.prepare_lm_head(torch.zeros(3, 2, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"weight must be \(V_local, H\), got shape \(3,\)"):
        exactlogp.prepare_lm_head(torch.zeros(3))
    with pytest.raises(ValueError, match="backend"):
        exactlogp.prepare_lm_head(torch.zeros(3, 2), backend="nope")
