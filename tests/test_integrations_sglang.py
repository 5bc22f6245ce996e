"""exactlogp.integrations.sglang against a stand-in for SGLang 0.5.23's sampler.

SGLang's sampler module does not import on a CPU machine (its import chain needs
torchvision, which exists for torch 2.13 only as a CUDA build: tests/host_stubs/README.md
has the errors), so tests/host_stubs/sglang reproduces the module layout and
`Sampler.forward`'s logprob paths (greedy, standard, deterministic, RL bf16), written
from SGLang's source, with torch arithmetic in place of its CUDA kernels.
"""

from __future__ import annotations

import os
import subprocess
import sys
import types

import pytest
import torch

from exactlogp import selected_logprobs
from exactlogp.integrations import sglang
from exactlogp.testing import assert_bitwise_equal, llm_like_logits
from integration_stubs import STUB_ROOT, drop_stub_modules, use_stub_package

VOCAB = 700


@pytest.fixture
def host(monkeypatch):
    use_stub_package(monkeypatch, "sglang")
    import sglang.srt.layers.sampler as sampler
    import sglang.srt.speculative.eagle_worker_common as spec

    yield types.SimpleNamespace(sampler=sampler, spec=spec)
    sglang.unpatch_sglang()
    drop_stub_modules("sglang")


def _batch(greedy=False, seed=2):
    logits, _ = llm_like_logits(6, VOCAB, torch.float32, seed=seed)
    info = types.SimpleNamespace(
        is_all_greedy=greedy,
        temperatures=torch.tensor([0.7, 1.0, 1.3, 0.9, 2.0, 0.5]).view(-1, 1),
        top_ks=torch.tensor([50, VOCAB, 5, 1, 200, 20]),
        generator=torch.Generator().manual_seed(seed),
    )
    return logits, info


def _run(sampler, logits, info, **init):
    out = types.SimpleNamespace(next_token_logits=logits.clone())
    info.generator.manual_seed(0)
    ids = sampler.Sampler(**init)(out, info, True, [0] * 6, [None] * 6, None)
    return ids, out.next_token_logprobs


@pytest.mark.parametrize(
    "init", [{}, {"enable_deterministic": True}, {"rl_on_policy_target": "fsdp"}]
)
def test_patched_sampler_reports_exact_temperature_scaled_logprobs(host, init):
    logits, info = _batch()
    ids, theirs = _run(host.sampler, logits, info, **init)
    sglang.patch_sglang()
    ids2, ours = _run(host.sampler, logits, info, **init)
    assert torch.equal(ids, ids2)  # sampling untouched
    expected = selected_logprobs(logits, ids, temperature=info.temperatures.view(-1)).logprobs
    assert ours.dtype == torch.float32
    assert_bitwise_equal(ours, expected, "sampled logprobs")
    # SGLang's RL mode rounds the logits and logits / T to bf16 (a bf16 ulp of a logit near 16
    # is 0.125), so its logprobs are that far from the exact ones
    tol = 0.2 if "rl_on_policy_target" in init else 1e-5
    torch.testing.assert_close(ours, theirs.float(), atol=tol, rtol=tol)


def test_rl_mode_equals_a_trainer_on_bf16_logits(host):
    """In RL mode the LM head runs in bf16: a trainer scoring its bf16 logits with
    exactlogp and the same temperature gets the rollout's bits."""
    logits, info = _batch()
    logits = logits.bfloat16().float()
    sglang.patch_sglang()
    ids, ours = _run(host.sampler, logits, info, rl_on_policy_target="fsdp")
    trainer = selected_logprobs(logits.bfloat16(), ids, temperature=info.temperatures.view(-1))
    assert_bitwise_equal(ours, trainer.logprobs, "rollout vs trainer")


def test_all_greedy_batches_are_scored_at_temperature_one(host):
    logits, info = _batch(greedy=True)
    sglang.patch_sglang()
    ids, ours = _run(host.sampler, logits, info)
    assert_bitwise_equal(ours, selected_logprobs(logits, ids).logprobs, "greedy")


def test_refusals_are_loud(host):
    logits, info = _batch()
    sglang.patch_sglang()
    info.has_custom_logit_processor = True
    with pytest.raises(NotImplementedError, match="custom logit processors"):
        _run(host.sampler, logits, info)
    out = types.SimpleNamespace(next_token_logits=logits)
    with pytest.raises(NotImplementedError, match="speculative-decoding logprobs"):
        host.spec.draft_logprobs(None, out, logits.argmax(-1))


def test_patch_is_idempotent_and_reversible(host):
    original = host.sampler.Sampler.__dict__["forward"]
    handle = sglang.patch_sglang()
    assert sglang.patch_sglang() is handle
    assert "sglang.srt.speculative.eagle_worker_common.compute_spec_logprobs" in handle.sites
    assert sglang.unpatch_sglang() is True
    assert host.sampler.Sampler.__dict__["forward"] is original


def test_plugin_patches_a_spawned_scheduler_process():
    code = (
        f"import sys; sys.path.insert(0, {str(STUB_ROOT)!r})\n"
        "from sglang.srt.plugins import load_plugins; load_plugins()\n"
        "from sglang.srt.layers.sampler import Sampler\n"
        "print(hasattr(Sampler.forward, '__wrapped__'))\n"
    )
    env = dict(os.environ, EXACTLOGP_PATCH="sglang", SGLANG_PLUGINS="exactlogp")
    run = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "True"
