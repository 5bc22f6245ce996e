"""Golden vectors: SHA-256 of the outputs and gradients of contract exactlogp-v1.

The inputs come from Python's `random` alone (stable across torch versions). Any change of
a single output or gradient bit, on any backend, fails here; such a change needs a new
CONTRACT string and new vectors, never an edit of these hashes alone.
"""

import random

import pytest
import torch

import exactlogp
from exactlogp.backends import backend_names, get_backend
from exactlogp.testing import python_random_logits, sha256

INPUTS = {
    torch.bfloat16: "7457599fd9b4cd6d581d811a8a1b2dc14fc3aa4c4958ede51cbd793bad08b519",
    torch.float16: "6ad821c2288318c54a3ce05c15873103dc7b3a4b22198f0c83b7b6d0d94158a4",
    torch.float32: "adb769bade550d4d0e42f75bd5ee3378a7788b899b69753643553645888f5fe6",
}
# (dtype, temperature, keep_mask?) -> (sha256 of logprobs+entropy+lse, sha256 of the gradient)
GOLDEN = {
    (torch.bfloat16, 1.0, False): (
        "7dbd49a858f8608a7abdee62eab6dd1de7e69e1c69693b41f53bacc7faeaa458",
        "dcfb544e4463d6b5f09905967db899a6b3214f15e71585dcdb503bbdd039f08d",
    ),
    (torch.bfloat16, 0.7, True): (
        "34c8a1e01bee628721d54ac4dfb5f9577e09d24cbd75700e4800946e223c1a7f",
        "02d654bda61996a08522ffb80f136cabf71d8724799cc831a0586255859ccdb4",
    ),
    (torch.float16, 1.0, False): (
        "2df538c0b27a1abd55232739c1963c7f95778c12e2a54686553bc95b2b7e521e",
        "abbecad9635f9e70c5351a1fc1ceb909456d5120bfa1ff6de6b8f62d6aaab684",
    ),
    (torch.float16, 0.7, True): (
        "408ff15353663e324204ff264c079830ddc9c01920051b24c8d2a654a055671c",
        "2ec29344214060d2b965b7bcd50bcd5be2045c5365ae835a2925ac03e5513b42",
    ),
    (torch.float32, 1.0, False): (
        "0f0770f963c67f04cb84cc05acdf221f5d364ea0a7475ec133703ed286f13776",
        "43fffa6f047ee15ca70c797f684dff3d1e0834e501abda6928654bd7a1f3d82e",
    ),
    (torch.float32, 0.7, True): (
        "062a9106d97af05bb855d71513bc97587be80d455e8082479171648d34e33531",
        "3fdada7a64710586947733b08c64ae6a6c55336f5306314027c14cf145bf1d64",
    ),
}


def golden_inputs(dtype):
    x, t = python_random_logits(8, 1000, dtype, seed=2024)
    t[5] = -100
    rng = random.Random(7)
    mask = torch.tensor([[rng.random() > 0.2 for _ in range(1000)] for _ in range(8)])
    mask[torch.arange(8), t.clamp(min=0)] = True
    return x, t, mask


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
    assert exactlogp.CONTRACT == "exactlogp-v1"


@pytest.mark.parametrize("dtype", list(INPUTS))
def test_inputs_are_the_recorded_ones(dtype):
    assert sha256(*golden_inputs(dtype)) == INPUTS[dtype]


@pytest.mark.parametrize("backend", usable_backends())
@pytest.mark.parametrize("key", list(GOLDEN), ids=lambda k: f"{k[0]}-tau{k[1]}-mask{k[2]}")
def test_golden_vectors(key, backend, monkeypatch):
    backend, _, value_tables = backend.partition(":")
    if value_tables:  # direct loops or value tables: the same vectors
        monkeypatch.setattr(get_backend(backend, torch.device("cpu")), "value_tables", value_tables)
    dtype, tau, use_mask = key
    x, t, mask = golden_inputs(dtype)
    x = x.requires_grad_(True)
    res = exactlogp.selected_logprobs(
        x, t, with_entropy=True, temperature=tau, keep_mask=mask if use_mask else None,
        backend=backend,
    )  # fmt: skip
    (res.logprobs.sum() + 0.5 * res.entropy.sum() - 0.25 * res.lse.sum()).backward()
    assert (sha256(res.logprobs, res.entropy, res.lse), sha256(x.grad)) == GOLDEN[key]
