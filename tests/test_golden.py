"""Golden vectors: SHA-256 of the outputs and gradients of contract exactlogp-v2.

The inputs come from Python's `random` alone (stable across torch versions). Any change of
a single output or gradient bit, on any backend, fails here; such a change needs a new
CONTRACT string and new vectors, never an edit of these hashes alone.

Besides LLM-like rows the inputs hold two near-certain rows (the target's gradient
1 - p_t ~ 1e-13, computed from the exact S since v2), an ignored row, and a row with a NaN
logit that the loss leaves out (validate=False: NaN outputs there, an exact +0 gradient).
NaN outputs are hashed as their positions: the contract does not pin NaN payloads.
"""

import random

import pytest
import torch

import exactlogp
from exactlogp.backends import backend_names, get_backend
from exactlogp.backends.base import EXACT_GEMM_ROUTES
from exactlogp.testing import python_random_logits, sha256

INPUTS = {
    torch.bfloat16: "3d8eca19133f72f13839c7d57034ae2e2cb0196a936b41466c9a151ab1f090e6",
    torch.float16: "6dbc58ea903172a9002fe4c09848ebf5f464bb5a8366e3a03d39ad4dbb03f356",
    torch.float32: "2b3df90ad68da03c708fe1db20554252c6452794af16c525af7e593efe78b1ad",
}
# (dtype, temperature, keep_mask?) -> (sha256 of logprobs+entropy+lse, sha256 of the gradient)
GOLDEN = {
    (torch.bfloat16, 1.0, False): (
        "54d6572b4e8fc0274bd2c216f99c302182c3a12a5033a973aca9c6cf8961fa4c",
        "98f44c09a7c20853eb619f0c391958d9a76dd60b123e27b1b61b69e792c76ff1",
    ),
    (torch.bfloat16, 0.7, True): (
        "6cc5cfe34035c27c044ad655baaa8b27dca8b36862621dbfdbd685992750871d",
        "9a0c20c1e095e9d8b9460f74829bdb107166c0afe3f075db002f7f6f8a74aacc",
    ),
    (torch.float16, 1.0, False): (
        "326976170379582740763e03288f87471f40c00b61397bc939ff64582316459e",
        "9cf4120b3fa152908b5147db915dea2970ed09fbd3719859db98452df44421d3",
    ),
    (torch.float16, 0.7, True): (
        "7a7421c463a07d7b15703a3b2e29dc7e29daaab9ed011d82011334f673fd1e23",
        "b5c448283362a3f4fbd21243c3cf626f690af49815d17db966fc3c451b4eb399",
    ),
    (torch.float32, 1.0, False): (
        "06bd2541363839cff3f8c8127616a43f1a83d45b447bc386d07023e7f68c07a0",
        "863f0bf0d8d765aa46d4d527c6bd7ae4390fcf43547692b7e84093c514d7a1c8",
    ),
    (torch.float32, 0.7, True): (
        "8bc7cde4dbcb3a0f1dd5b277b9bdbfc0433d7beb7070552861c69a6dbae6f4a8",
        "54143f26fe113aa1f6d6e9eb2b329056f074f1fcef9405921cd753c69ce624de",
    ),
}


ROWS = 10
NAN_ROW = 6
NEAR_CERTAIN = (8, 9)
# loss = sum(w_lp logprobs + w_ent entropy + w_lse lse): the near-certain rows by their
# logprob alone (so their target gradient is 1 - p_t ~ 1e-13), the NaN row not at all
W_LP, W_ENT, W_LSE = (
    torch.tensor([0.0 if r == NAN_ROW else w if r not in NEAR_CERTAIN else float(w == 1.0)
                  for r in range(ROWS)])
    for w in (1.0, 0.5, -0.25)
)  # fmt: skip


def golden_inputs(dtype):
    x, t = python_random_logits(ROWS, 1000, dtype, seed=2024)
    t[5] = -100
    for row, lift in zip(NEAR_CERTAIN, (30.0, 36.0), strict=True):  # near-certain targets
        x[row, t[row]] = lift + float(x[row].max())
    x[NAN_ROW, 100] = float("nan")
    rng = random.Random(7)
    mask = torch.tensor([[rng.random() > 0.2 for _ in range(1000)] for _ in range(ROWS)])
    mask[torch.arange(ROWS), t.clamp(min=0)] = True
    return x, t, mask


def _positions_of_nan(t: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isnan(t), torch.full_like(t, 12345.0), t)


def usable_backends():
    """Every backend that loads here; the CPU backend once per value-table mode."""
    names = []
    for name in backend_names():
        try:
            get_backend(name, torch.device("cpu"))
        except ValueError:
            continue
        names += ["cpu:never", "cpu:always"] if name == "cpu" else [name]
    return names


def test_contract_version_is_the_one_the_vectors_belong_to():
    assert exactlogp.CONTRACT == "exactlogp-v2"


@pytest.mark.parametrize("dtype", list(INPUTS))
def test_inputs_are_the_recorded_ones(dtype):
    assert sha256(*golden_inputs(dtype)) == INPUTS[dtype]


@pytest.mark.parametrize("backend", usable_backends())
@pytest.mark.parametrize("key", list(GOLDEN), ids=lambda k: f"{k[0]}-tau{k[1]}-mask{k[2]}")
def test_golden_vectors(key, backend):
    name, _, value_tables = backend.partition(":")
    backend = get_backend(name, torch.device("cpu"))
    if value_tables:  # direct loops or value tables: the same vectors
        backend = backend.with_options(value_tables=value_tables)
    dtype, tau, use_mask = key
    x, t, mask = golden_inputs(dtype)
    x = x.requires_grad_(True)
    res = exactlogp.selected_logprobs(
        x, t, with_entropy=True, temperature=tau, keep_mask=mask if use_mask else None,
        backend=backend, validate=False,
    )  # fmt: skip
    out = [_positions_of_nan(v) for v in res]
    (W_LP * out[0] + W_ENT * out[1] + W_LSE * out[2]).sum().backward()
    assert torch.isfinite(x.grad).all()
    assert (sha256(*out), sha256(x.grad)) == GOLDEN[key]


# --- contract exactlogp-linear-v2: the exact LM head (these inputs: on L2's grid, v1's bits) ---
#
# H = 1 holds -0 hidden states and -0 weights, so that single products are -0 and exact
# zero dot products arise: the contract's logit of an exact 0 is +0 on every backend and
# GEMM route. H = 5 mixes signed zeros with ordinary values (their sums are exact zeros
# too: 3 - 3, -0 + 0). Pinned: the logits, the three outputs and the three gradients.
LINEAR_GOLDEN = {
    1: "05cca93b1c4edb8cd3115bf517c09eaa64d950eed13c5438bc24f6f5021e5414",
    5: "c5fe462ba245ba008d34ef4ba3335fa690e5e5c9eacb388379f23ff5f99c6a54",
}


def linear_golden_inputs(hidden: int):
    rng = random.Random(11 + hidden)
    pick = [-0.0, 0.0, 0.0, 1.5, -2.0, 3.0, -3.0, 0.25]
    h = torch.tensor([[rng.choice(pick) for _ in range(hidden)] for _ in range(6)])
    w = torch.tensor([[rng.choice(pick) for _ in range(hidden)] for _ in range(9)])
    h[0], w[0] = -0.0, 1.0  # a -0 product in every column of row 0
    b = torch.tensor([rng.choice([-0.0, 0.0, 0.5]) for _ in range(9)])
    t = torch.tensor([rng.randrange(9) for _ in range(6)])
    return h, w, b, t


def linear_backends():
    """Every backend that loads here; Triton on every exact-GEMM route."""
    out = []
    for name in backend_names():
        try:
            impl = get_backend(name, torch.device("cpu"))
        except ValueError:
            continue
        if name == "triton":
            out += [impl.with_options(exact_gemm=m) for m in EXACT_GEMM_ROUTES]
        else:
            out.append(impl)
    return out


def linear_outputs(hidden: int, backend):
    h, w, b, t = linear_golden_inputs(hidden)
    h, w, b = (x.requires_grad_(True) for x in (h, w, b))
    z = exactlogp.linear_logits(h.detach(), w.detach(), b.detach(), backend=backend)
    res = exactlogp.linear_selected_logprobs(
        h, w, t, bias=b, with_entropy=True, logit_scale=0.5, backend=backend
    )
    (res.logprobs.sum() - 0.5 * res.entropy.sum() + 0.25 * res.lse.sum()).backward()
    return z, (*res, h.grad, w.grad, b.grad)


@pytest.mark.parametrize("hidden", list(LINEAR_GOLDEN))
@pytest.mark.parametrize("backend", linear_backends(), ids=repr)
def test_linear_golden_vectors(hidden, backend):
    h, w, b, _ = linear_golden_inputs(hidden)
    z, outs = linear_outputs(hidden, backend)
    exact = (h.double() @ w.double().T + b.double()) * 0.5  # exact in fp64 at these values
    zero = exact == 0
    assert zero.any() and torch.equal(z[zero], exact[zero].float())
    assert not torch.signbit(z[zero]).any(), "an exact zero logit must be +0"
    assert sha256(z, *outs) == LINEAR_GOLDEN[hidden]
