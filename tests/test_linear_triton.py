"""The Triton backend of the exact fused LM head: the reference's bits.

The exact integer GEMM runs as nine int8 dot products with int32 accumulation
(backends/triton/linear_kernels.py); without a GPU in Triton's interpreter, so every case
is small. Compared bit for bit with the reference backend's int64 arithmetic.
"""

import pytest
import torch

pytest.importorskip("triton", reason="Triton is not installed: no Triton backend")

import exactlogp  # noqa: E402
from exactlogp import linear_contract as lc  # noqa: E402
from exactlogp.backends.triton import linear_kernels  # noqa: E402
from exactlogp.testing import assert_bitwise_equal, lm_head_inputs  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def test_int8_slices_rebuild_every_operand():
    x = torch.tensor([[0, 1, -1, 63, 64, -64, -65, 127, 128, 2**20, -(2**20), 2**20 - 1, 12345]])
    s = linear_kernels.int8_slices(x.double()).to(torch.int64)
    assert s[:2].abs().max() <= 64 and s[2].abs().max() <= 64
    assert torch.equal(s[0] + 128 * s[1] + 16384 * s[2], x)


def test_exact_dot_is_the_integer_product_on_ragged_tiles():
    gen = torch.Generator().manual_seed(0)
    for m, p, k in ((1, 1, 1), (5, 70, 3), (65, 63, 129)):
        a = torch.randint(-(2**20), 2**20 + 1, (m, k), generator=gen).double()
        c = torch.randint(-(2**20), 2**20 + 1, (p, k), generator=gen).double()
        a[0, : min(k, 2)] = 2.0**20  # the extremes, where the top slice is +-64
        c[0, : min(k, 2)] = -(2.0**20)
        got = linear_kernels.exact_dot(a.to(DEVICE), c.to(DEVICE)).cpu()
        assert torch.equal(got, lc.exact_dot(a, c)), (m, p, k)


def test_fused_head_gives_the_reference_bits_forward_and_backward():
    h, w, t = lm_head_inputs(9, 40, 90, torch.bfloat16, seed=3)
    t[2] = -100
    bias = (0.1 * torch.randn(90, generator=torch.Generator().manual_seed(1))).bfloat16()
    results = []
    for backend, device in (("reference", "cpu"), ("triton", DEVICE)):
        hh, ww, bb = (x.to(device).requires_grad_(True) for x in (h, w, bias))
        res = exactlogp.linear_selected_logprobs(
            hh, ww, t.to(device), bias=bb, with_entropy=True, logit_scale=0.5, backend=backend
        )
        (res.logprobs.sum() + 0.5 * res.entropy.sum()).backward()
        results.append([x.detach().cpu() for x in (*res, hh.grad, ww.grad, bb.grad)])
    for a, b in zip(*results, strict=True):
        assert_bitwise_equal(a, b)
