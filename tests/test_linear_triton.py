"""The Triton backend of the exact fused LM head: the reference's bits.

The exact integer GEMM runs as nine int8 dot products with int32 accumulation
(backends/triton/linear_kernels.py; without a GPU in Triton's interpreter, so every case
is small) or as fp64 GEMMs over K-chunks (cuBLAS DGEMM on a GPU), the backend's
exact_gemm option. Compared bit for bit with the reference backend's int64 arithmetic.
"""

import pytest
import torch

pytest.importorskip("triton", reason="Triton is not installed: no Triton backend")

import exactlogp  # noqa: E402
from exactlogp import linear_contract as lc  # noqa: E402
from exactlogp.backends import get_backend  # noqa: E402
from exactlogp.backends.triton import linear_kernels  # noqa: E402
from exactlogp.backends.triton.launch import FP64_RICH_CAPABILITIES, TritonBackend  # noqa: E402
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


def test_exact_gemm_option_picks_a_path_and_refuses_unknown_modes():
    rich = DEVICE.type == "cuda" and torch.cuda.get_device_capability() in FP64_RICH_CAPABILITIES
    assert TritonBackend().gemm_path(DEVICE) == ("fp64" if rich else "int8")
    assert TritonBackend().gemm_path(torch.device("cpu")) == "int8"
    assert TritonBackend(exact_gemm="fp64").gemm_path(torch.device("cpu")) == "fp64"
    with pytest.raises(ValueError, match=r"exact_gemm must be one of .*, got 'bf16'"):
        TritonBackend(exact_gemm="bf16")
    impl = get_backend("triton", DEVICE)
    with pytest.raises(ValueError, match=r"exact_gemm must be one of .*, got 'fp32'"):
        impl.with_options(exact_gemm="fp32")
    with pytest.raises(AttributeError, match="immutable"):
        impl.exact_gemm = "fp64"
    assert impl.exact_gemm == "auto" and impl.with_options(exact_gemm="fp64").exact_gemm == "fp64"


def test_exact_dot_takes_the_path_its_option_names(monkeypatch):
    calls = []

    def spy(name):
        # the integers on the CPU (torch has no int64 GEMM on CUDA), back on a's device
        return lambda a, c: calls.append(name) or lc.exact_dot(a.cpu(), c.cpu()).to(a.device)

    monkeypatch.setattr(linear_kernels, "exact_dot", spy("int8"))
    monkeypatch.setattr(linear_kernels, "diagonal_dot", spy("int8_mm"))
    monkeypatch.setattr(lc, "float_exact_dot", spy("fp64"))
    a = torch.ones(2, 3, dtype=torch.float64, device=DEVICE)
    for mode in ("int8", "fp64", "int8_mm"):
        assert torch.equal(TritonBackend(exact_gemm=mode).exact_dot(a, a).cpu(),
                           torch.full((2, 2), 3, dtype=torch.int64))  # fmt: skip
    assert calls == ["int8", "fp64", "int8_mm"]


@pytest.mark.parametrize("gemm", ["int8", "fp64", "int8_mm"])
def test_fused_head_gives_the_reference_bits_forward_and_backward(gemm):
    h, w, t = lm_head_inputs(9, 40, 90, torch.bfloat16, seed=3)
    t[2] = -100
    bias = (0.1 * torch.randn(90, generator=torch.Generator().manual_seed(1))).bfloat16()
    results = []
    triton = TritonBackend(exact_gemm=gemm)
    for backend, device in (("reference", "cpu"), (triton, DEVICE)):
        hh, ww, bb = (x.to(device).detach().requires_grad_(True) for x in (h, w, bias))
        res = exactlogp.linear_selected_logprobs(
            hh, ww, t.to(device), bias=bb, with_entropy=True, logit_scale=0.5, backend=backend
        )
        (res.logprobs.sum() + 0.5 * res.entropy.sum()).backward()
        results.append([x.detach().cpu() for x in (*res, hh.grad, ww.grad, bb.grad)])
    for a, b in zip(*results, strict=True):
        assert_bitwise_equal(a, b)
