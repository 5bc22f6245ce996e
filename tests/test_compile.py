"""torch.compile of a loss that calls exactlogp: the eager bits, forward and backward.

selected_logprobs is a graph break (torch.compiler.disable): Inductor never sees its
arithmetic, which it would otherwise fuse and reorder (a compiled reference backend gave
other bits before), so the compiled function runs it eagerly.
"""

import pytest
import torch

import exactlogp
from exactlogp.testing import assert_bitwise_equal, llm_like_logits


def loss(x, t, w, backend):
    res = exactlogp.selected_logprobs(x, t, with_entropy=True, temperature=0.9, backend=backend)
    return (res.logprobs * w).sum() + 0.01 * res.entropy.sum() - 0.1 * res.lse.mean()


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_compiled_loss_gives_the_eager_bits(backend):
    x, t = llm_like_logits(16, 300, torch.bfloat16, seed=5)
    t[3] = -100
    w = torch.linspace(-1.0, 1.0, 16)
    results = []
    for fn in (loss, torch.compile(loss)):
        xg = x.clone().requires_grad_(True)
        out = fn(xg, t, w, backend)
        out.backward()
        results.append((out.detach(), xg.grad))
    (eager, g_eager), (compiled, g_compiled) = results
    assert_bitwise_equal(compiled, eager, "loss")
    assert_bitwise_equal(g_compiled, g_eager, "gradient")
