"""On a CUDA device the reference backend gives the CPU bits, and validate=False never
synchronizes with the host (reference and Triton backends). Skipped without a GPU."""

import pytest
import torch

import exactlogp
from exactlogp.testing import assert_bitwise_equal, llm_like_logits

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_cuda_reference_equals_cpu_bits_forward_and_backward():
    x, t = llm_like_logits(16, 4099, torch.bfloat16, seed=3)
    results = []
    for device in ("cpu", "cuda"):
        xd = x.to(device).requires_grad_(True)
        res = exactlogp.selected_logprobs(
            xd, t.to(device), with_entropy=True, temperature=0.7, backend="reference"
        )
        (res.logprobs.sum() + res.entropy.sum() + res.lse.sum()).backward()
        results.append([v.cpu() for v in (*res, xd.grad)])
    for a, b in zip(*results, strict=True):
        assert_bitwise_equal(a, b)


def test_validate_false_does_not_sync():
    x, t = llm_like_logits(8, 999, torch.bfloat16, seed=4)
    x, t = x.cuda(), t.cuda()
    exactlogp.selected_logprobs(x, t, validate=False, backend="reference")  # warm-up
    torch.cuda.set_sync_debug_mode("error")
    try:
        exactlogp.selected_logprobs(x, t, validate=False, with_entropy=True, backend="reference")
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_triton_validate_false_does_not_sync():
    pytest.importorskip("triton", reason="Triton is not installed")
    x, t = llm_like_logits(8, 999, torch.bfloat16, seed=4)
    x, t = x.cuda(), t.cuda()
    tau = torch.full((8,), 0.7, device="cuda")
    for temperature in (1.0, 0.7, tau):
        kwargs = dict(validate=False, with_entropy=True, temperature=temperature)
        exactlogp.selected_logprobs(x, t, backend="triton", **kwargs)  # warm-up: compiles
        torch.cuda.set_sync_debug_mode("error")
        try:
            exactlogp.selected_logprobs(x, t, backend="triton", **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("default")
