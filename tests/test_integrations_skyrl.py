"""exactlogp.integrations.skyrl: the drop-ins here, and against SkyRL 0.3.0's own code.

`make setup` installs SkyRL 0.3.0 into .venv/hosts/skyrl-0.3.0 (see the Makefile); one
subprocess (tests/real_hosts/skyrl_run.py, which names the two imports it stubs) runs
SkyRL's `torch_utils`, its FSDP `model_wrapper` bindings and its Megatron `model_utils`
unpatched, patched and unpatched again, and saves what they returned; the tests here
compare those outputs with the fp64 truth (SkyRL's) and with exactlogp called directly
(ours, bit for bit).
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

from exactlogp import selected_logprobs
from exactlogp.integrations import nemo_rl
from exactlogp.integrations import skyrl as ours
from exactlogp.testing import fp64_reference, llm_like_logits, ulp32
from real_host_runs import finish, start

VERSION = "0.3.0"  # the Makefile's SKYRL
VOCAB = 509
HOST_TOL = 2e-5  # SkyRL's fp32 logsumexp / log_softmax of logits up to ~30


def _logits(dtype=torch.float32, b=2, s=5):
    logits, target = llm_like_logits(b * s, VOCAB, dtype, seed=1)
    return logits.view(b, s, VOCAB), target.view(b, s)


@pytest.fixture
def torch_utils_flag(monkeypatch):
    """A loaded SkyRL torch_utils whose flash-attn flag the test sets."""
    module = types.ModuleType(ours.TORCH_UTILS)
    monkeypatch.setitem(sys.modules, ours.TORCH_UTILS, module)
    return module


# --- the drop-ins ---


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("flash", [False, True])
def test_logprobs_dtype_follows_skyrl(torch_utils_flag, dtype, flash):
    torch_utils_flag.FLASH_ATTN_CROSS_ENTROPY_LOSS_AVAILABLE = flash
    logits, labels = _logits(dtype)
    got = ours.logprobs_from_logits(logits, labels)
    direct = selected_logprobs(logits, labels).logprobs
    assert got.dtype == (torch.float32 if flash else dtype)
    assert torch.equal(got, direct.to(got.dtype))


def test_logprobs_fp64_and_ignored_labels(torch_utils_flag):
    torch_utils_flag.FLASH_ATTN_CROSS_ENTROPY_LOSS_AVAILABLE = False
    logits, labels = _logits(torch.float64)
    labels[0, 1] = -100
    got = ours.logprobs_from_logits(logits, labels)
    assert got.dtype == torch.float64 and got[0, 1] == 0
    ref = torch.log_softmax(logits, -1).gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    assert torch.allclose(got[labels != -100], ref[labels != -100], atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_entropy(dtype):
    logits, _ = _logits(dtype)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    got = ours.chunked_entropy_from_logits(logits, attention_mask=mask, chunk_size=2)
    zeros = torch.zeros(logits.shape[:2], dtype=torch.int64)
    direct = selected_logprobs(logits, zeros, with_entropy=True).entropy
    assert got.dtype == dtype and not got.requires_grad
    assert torch.equal(got, torch.where(mask == 0, 0.0, direct).to(dtype))
    leaf = logits.detach().requires_grad_(True)
    ours.chunked_entropy_from_logits(
        leaf, requires_grad=True, attention_mask=mask.bool()
    ).sum().backward()
    assert (leaf.grad[0, 3:] == 0).all() and (leaf.grad[0, :3] != 0).any()
    assert not ours.chunked_entropy_from_logits(leaf).requires_grad  # no_grad by default


def test_bad_calls_raise_naming_the_argument():
    logits, labels = _logits()
    with pytest.raises(ValueError, match=r"logits must be \[B, S, V\]"):
        ours.chunked_entropy_from_logits(logits[0])
    with pytest.raises(ValueError, match="attention_mask shape"):
        ours.chunked_entropy_from_logits(logits, attention_mask=torch.ones(2, 4))
    with pytest.raises(ValueError, match="chunk_size"):
        ours.chunked_entropy_from_logits(logits, chunk_size=0)
    with pytest.raises(TypeError, match="logits must be a torch.Tensor"):
        ours.logprobs_from_logits(logits.tolist(), labels)
    with pytest.raises(NotImplementedError, match="context parallelism"):
        two = types.SimpleNamespace(size=lambda: 2)
        ours.from_parallel_logits_to_logprobs(logits, labels, 0, VOCAB, None, cp_group=two)


def test_megatron_shares_the_nemo_rl_implementation():
    logits, labels = _logits()
    got = ours.from_parallel_logits_to_logprobs(logits, labels, 0, VOCAB, None, chunk_size=2)
    assert torch.equal(
        got, nemo_rl.from_parallel_logits_to_logprobs(logits, labels, 0, VOCAB, None)
    )
    assert torch.equal(got, selected_logprobs(logits[:, :-1], labels[:, 1:]).logprobs)
    assert ours.DistributedLogprob is nemo_rl.DistributedLogprob
    assert ours.ChunkedDistributedLogprob is nemo_rl.ChunkedDistributedLogprob


def test_patch_without_skyrl_names_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "skyrl", None)
    with pytest.raises(ImportError, match="patch_skyrl: cannot import skyrl"):
        ours.patch_skyrl()


# --- SkyRL 0.3.0's own code, in a subprocess ---


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    started = start("skyrl_run", f"skyrl-{VERSION}", tmp_path_factory.mktemp("skyrl_real"))
    return finish(started)


def _truth(logits, labels):
    flat = fp64_reference(logits.reshape(-1, VOCAB), labels.reshape(-1))
    return flat.logprobs.view(labels.shape), flat.entropy.view(labels.shape)


def _expected(inp):
    """What exactlogp called directly gives on each case of skyrl_run._run_all."""
    x32, x16, labels, mask = inp["logits32"], inp["logits16"], inp["labels"], inp["mask"]
    zeros = torch.zeros_like(labels)
    ent32 = selected_logprobs(x32, zeros, with_entropy=True).entropy
    ent16 = selected_logprobs(x16, zeros, with_entropy=True).entropy
    mg32 = selected_logprobs(x32[:, :-1], labels[:, 1:]).logprobs
    return {
        "lp32": selected_logprobs(x32, labels).logprobs,
        "lp16": selected_logprobs(x16, labels).logprobs.to(torch.bfloat16),
        "ent32": torch.where(mask == 0, 0.0, ent32),
        "ent16": torch.where(mask == 0, 0.0, ent16).to(torch.bfloat16),
        "wrapper_lp16": selected_logprobs(x16, labels).logprobs.to(torch.bfloat16),
        "wrapper_ent32": ent32,
        "mg32": mg32,
        "mg16": selected_logprobs(x16[:, :-1], labels[:, 1:]).logprobs,
        "mg_chunk": mg32,
        "mg_padded": mg32,
    }


def test_real_skyrl_unpatched_is_within_tolerance_of_fp64(real):
    assert real["version"] == VERSION and real["flash_ce"] is False
    inp, host = real["inputs"], real["unpatched"]
    lp, ent = _truth(inp["logits32"], inp["labels"])
    assert host["lp32"].dtype == torch.float32 and host["lp16"].dtype == torch.bfloat16
    assert host["ent16"].dtype == torch.bfloat16 and host["mg16"].dtype == torch.float32
    assert (host["lp32"].double() - lp).abs().max() <= HOST_TOL
    assert (host["ent32"].double() - ent * inp["mask"]).abs().max() <= HOST_TOL
    shifted, _ = _truth(inp["logits32"][:, :-1], inp["labels"][:, 1:])
    assert (host["mg32"].double() - shifted).abs().max() <= HOST_TOL
    assert host["mg32"].shape == host["mg_padded"].shape == (2, 5)


def test_real_skyrl_patched_gives_exactlogp_bits_in_skyrl_dtypes(real):
    inp, host, got = real["inputs"], real["unpatched"], real["patched"]
    for name, want in _expected(inp).items():
        assert got[name].dtype == host[name].dtype and got[name].shape == host[name].shape, name
        assert torch.equal(got[name], want), name
    lp, _ = _truth(inp["logits32"], inp["labels"])
    assert ((got["lp32"].double() - lp).abs() <= ulp32(lp)).all()
    leaf = inp["logits32"].clone().requires_grad_(True)
    mine = selected_logprobs(leaf[:, :-1], inp["labels"][:, 1:]).logprobs
    (mine * torch.linspace(0.5, 1.5, mine.numel()).view(mine.shape)).sum().backward()
    assert torch.equal(got["mg_grad"], leaf.grad)
    assert (got["mg_grad"] - host["mg_grad"]).abs().max() <= 1e-6


def test_real_skyrl_patch_reaches_every_binding_and_unpatches(real):
    sites = set(real["sites"])
    for name in ("logprobs_from_logits", "chunked_entropy_from_logits"):
        assert f"{ours.TORCH_UTILS}.{name}" in sites
        assert f"skyrl.backends.skyrl_train.workers.model_wrapper.{name}" in sites
    for name in ours.MEGATRON_SIGNATURES:
        assert f"{ours.MEGATRON_UTILS}.{name}" in sites
    assert real["skipped"] == {} and real["idempotent"]
    assert real["unpatch"] and not real["unpatch_again"] and real["restored"]
    for name, value in real["unpatched"].items():
        assert torch.equal(real["unpatched_again"][name], value), name
