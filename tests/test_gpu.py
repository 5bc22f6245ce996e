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
        xd = x.to(device).detach().requires_grad_(True)  # a leaf of its own on each device
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


def test_warmed_up_call_is_captured_in_a_cuda_graph_with_the_eager_bits():
    """After exactlogp.warmup of the shapes and options, the forward and backward are
    captured in a CUDA graph (no compile, table copy or host sync inside the capture) and
    the replay gives the eager bits, read from a strided logits[:, :-1, :] view."""
    pytest.importorskip("triton", reason="Triton is not installed")
    full, _ = llm_like_logits(4 * 9, 4096, torch.bfloat16, seed=5)
    full = full.cuda().view(4, 9, 4096)
    t = torch.randint(0, 4096, (4, 8), device="cuda")
    exactlogp.warmup("cuda", (torch.bfloat16,), ((32, 4096),), with_entropy=(True,),
                     temperatures=(0.7,))  # fmt: skip
    leaf = full.clone().requires_grad_(True)

    def step():
        leaf.grad = None
        res = exactlogp.selected_logprobs(leaf[:, :-1], t, validate=False, with_entropy=True,
                                          temperature=0.7, backend="triton")  # fmt: skip
        (res.logprobs.sum() + res.entropy.sum()).backward()
        # detached: a graph kept alive keeps leaf's AccumulateGrad node, made on the stream
        # of the eager run, and the capture's backward would then accumulate on that stream
        return res.logprobs.detach(), leaf.grad

    eager = [v.clone() for v in step()]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(captured, eager, strict=True):
        assert_bitwise_equal(a, b)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_triton_runs_on_the_device_of_its_tensors():
    pytest.importorskip("triton", reason="Triton is not installed")
    x, t = llm_like_logits(8, 999, torch.bfloat16, seed=6)
    want = exactlogp.selected_logprobs(x.cuda(0), t.cuda(0), backend="triton").logprobs
    with torch.cuda.device(0):  # the current device is not the tensors' one
        got = exactlogp.selected_logprobs(x.cuda(1), t.cuda(1), backend="triton").logprobs
    assert got.device == torch.device("cuda", 1)
    assert_bitwise_equal(got.cpu(), want.cpu())
