"""exactlogp.integrations.sglang, tested against a stand-in of SGLang's sampler (its real
module needs CUDA-built torchvision here).

SGLang's sampler module does not import on a CPU machine (its import chain needs
torchvision, which exists for torch 2.13 only as a CUDA build: tests/host_stubs/README.md
has the errors), so tests/host_stubs/sglang reproduces SGLang 0.5.23's module layout,
`SamplingBatchInfo`'s fields and `Sampler.forward`'s paths (greedy, standard,
deterministic with seeds, RL bf16, the logprob lists), written from SGLang's source, with
torch arithmetic in place of its CUDA kernels.
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
    import sglang.kernels.ops.sampling.murmur_hash as murmur
    import sglang.srt.layers.sampler as sampler
    import sglang.srt.sampling.sampling_batch_info as info
    import sglang.srt.sampling.sampling_params as params
    import sglang.srt.speculative.eagle_worker_common as spec

    yield types.SimpleNamespace(sampler=sampler, spec=spec, info=info, params=params,
                                murmur=murmur)  # fmt: skip
    sglang.unpatch_sglang()
    drop_stub_modules("sglang")


def _info(host, temperature, top_k, top_p=None, min_p=None, seeds=None):
    """A SamplingBatchInfo from per-request values, normalised as SGLang's
    SamplingParams.normalize and flagged as SamplingBatchInfo.from_schedule_batch does:
    temperature below 1e-6 -> 1.0 with top_k 1, top_k -1 -> TOP_K_ALL."""
    n = len(temperature)
    top_p = [1.0] * n if top_p is None else top_p
    min_p = [0.0] * n if min_p is None else min_p
    all_k = host.params.TOP_K_ALL
    greedy = [t < host.params.SAMPLING_EPS for t in temperature]
    t = [1.0 if g else v for g, v in zip(greedy, temperature, strict=True)]
    k = [1 if g else (all_k if v == -1 else v) for g, v in zip(greedy, top_k, strict=True)]
    return host.info.SamplingBatchInfo(
        temperatures=torch.tensor(t, dtype=torch.float32).view(-1, 1),
        top_ps=torch.tensor(top_p, dtype=torch.float32),
        top_ks=torch.tensor(k, dtype=torch.int32),
        min_ps=torch.tensor(min_p, dtype=torch.float32),
        is_all_greedy=all(v <= 1 for v in k),
        is_any_greedy=any(v <= 1 for v in k),
        need_top_p_sampling=any(v != 1.0 for v in top_p),
        need_top_k_sampling=any(v != all_k for v in k),
        need_min_p_sampling=any(v > 0 for v in min_p),
        vocab_size=VOCAB,
        sampling_seed=None if seeds is None else torch.tensor(seeds, dtype=torch.int64),
        device="cpu",
    )


def _float_batch(host, greedy=False, seeded=False):
    logits, _ = llm_like_logits(6, VOCAB, torch.float32, seed=2)
    temps = [0.0] * 6 if greedy else [0.7, 1.0, 1.3, 0.9, 2.0, 0.5]
    seeds = [11, 12, 13, 14, 15, 16] if seeded else None
    return logits, _info(host, temps, [50, -1, 5, 1, 200, 20], seeds=seeds)


def _mixed_batch(host, seeds=None):
    """Rows: min-p + top-k + top-p, min-p, top-p, top-k, no cut, greedy (temperature 0)."""
    logits, _ = llm_like_logits(6, VOCAB, torch.float32, seed=5)
    info = _info(
        host,
        temperature=[3.0, 2.5, 3.0, 0.6, 1.1, 0.0],
        top_k=[40, -1, -1, 7, -1, -1],
        top_p=[0.95, 1.0, 0.8, 1.0, 1.0, 1.0],
        min_p=[0.003, 0.1, 0.0, 0.0, 0.0, 0.0],
        seeds=seeds,
    )
    return logits, info


def _run(host, logits, info, *, lists=None, positions=None, rng=0, logprob=True, **init):
    out = types.SimpleNamespace(next_token_logits=logits.clone())
    n = logits.shape[0]
    tops, ids = lists if lists is not None else ([0] * n, [None] * n)
    torch.manual_seed(rng)
    token_ids = host.sampler.Sampler(**init)(out, info, logprob, tops, ids, positions)
    return token_ids, out


@pytest.mark.parametrize(
    "init", [{}, {"enable_deterministic": True}, {"rl_on_policy_target": "fsdp"}]
)
def test_patched_sampler_reports_exact_temperature_scaled_logprobs(host, init):
    logits, info = _float_batch(host, seeded="enable_deterministic" in init)
    positions = torch.arange(6)
    ids, theirs = _run(host, logits, info, positions=positions, **init)
    sglang.patch_sglang()
    ids2, ours = _run(host, logits, info, positions=positions, **init)
    assert torch.equal(ids, ids2)  # sampling untouched
    ours, theirs = ours.next_token_logprobs, theirs.next_token_logprobs
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
    logits, info = _float_batch(host)
    logits = logits.bfloat16().float()
    sglang.patch_sglang()
    ids, out = _run(host, logits, info, rl_on_policy_target="fsdp")
    trainer = selected_logprobs(logits.bfloat16(), ids, temperature=info.temperatures.view(-1))
    assert_bitwise_equal(out.next_token_logprobs, trainer.logprobs, "rollout vs trainer")


def test_all_greedy_batches_are_scored_at_temperature_one(host):
    logits, info = _float_batch(host, greedy=True)
    sglang.patch_sglang()
    ids, out = _run(host, logits, info)
    assert_bitwise_equal(out.next_token_logprobs, selected_logprobs(logits, ids).logprobs, "greedy")


def test_refusals_are_loud(host):
    logits, info = _float_batch(host)
    sglang.patch_sglang()
    info.has_custom_logit_processor = True
    with pytest.raises(NotImplementedError, match="custom logit processors"):
        _run(host, logits, info)
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
