"""exactlogp.warmup runs each requested variant once, forward and backward, so that later
calls (and a CUDA-graph capture, tests/test_gpu.py) only launch kernels."""

import pytest
import torch

import exactlogp
from exactlogp.testing import assert_bitwise_equal, llm_like_logits


def test_warmup_runs_every_combination_and_later_calls_keep_their_bits():
    x, t = llm_like_logits(3, 300, torch.float16, seed=1)
    before = exactlogp.selected_logprobs(x, t, temperature=0.5, with_entropy=True)
    n = exactlogp.warmup(
        "cpu", (torch.bfloat16, torch.float16), ((3, 300), (1, 64)),
        with_entropy=(False, True), temperatures=(1.0, 0.5, "per_row"), keep_mask=True,
    )  # fmt: skip
    assert n == 2 * 2 * 2 * 3
    after = exactlogp.selected_logprobs(x, t, temperature=0.5, with_entropy=True)
    for a, b in zip(before, after, strict=True):
        assert_bitwise_equal(a, b)


def test_warmup_of_the_triton_backend():
    pytest.importorskip("triton", reason="Triton is not installed: no Triton backend")
    from exactlogp.backends.triton import interpreted

    if not torch.cuda.is_available() and not interpreted():
        pytest.skip("Triton kernels run here only under TRITON_INTERPRET=1")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    assert exactlogp.warmup(device, (torch.bfloat16,), ((2, 64),), backend="triton") == 2
