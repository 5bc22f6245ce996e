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

import exactlogp
from exactlogp import selected_logprobs
from exactlogp.integrations import autopatch, sglang
from exactlogp.integrations.verl import processed_logprobs_from_logits
from exactlogp.testing import assert_bitwise_equal, llm_like_logits
from integration_stubs import STUB_ROOT, drop_stub_modules, use_stub_package

VOCAB = 700
F32_MIN = torch.finfo(torch.float32).min


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
    assert sglang.patch_sglang(cut="float") is handle
    assert "sglang.srt.speculative.eagle_worker_common.compute_spec_logprobs" in handle.sites
    assert sglang.unpatch_sglang() is True
    assert host.sampler.Sampler.__dict__["forward"] is original


def test_plugin_patches_a_spawned_scheduler_process():
    code = (
        f"import sys; sys.path.insert(0, {str(STUB_ROOT)!r})\n"
        "from sglang.srt.plugins import load_plugins; load_plugins()\n"
        "from sglang.srt.layers.sampler import Sampler\n"
        "from exactlogp.integrations._patching import active\n"
        "print(hasattr(Sampler.forward, '__wrapped__'), active('patch_sglang').options)\n"
    )
    env = dict(
        os.environ,
        EXACTLOGP_PATCH="sglang",
        SGLANG_PLUGINS="exactlogp",
        EXACTLOGP_SGLANG_CUT="exact",
    )
    run = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "True {'cut': 'exact'}"


# --- the exact cut (patch_sglang(cut="exact")) ---


@pytest.mark.parametrize("seeded", [False, True])
def test_exact_cut_draws_exactlogp_sample_from_the_kept_set(host, seeded):
    seeds = [3, 1 << 40, -5, 42, 42, 7] if seeded else None
    logits, info = _mixed_batch(host, seeds)
    positions = torch.tensor([9, 0, 31, 4, 5, 17])
    sglang.patch_sglang(cut="exact")
    ids, out = _run(host, logits, info, positions=positions, rng=123)
    params = sglang.exact_cut_params(
        info.temperatures, info.top_ks, info.top_ps, info.min_ps, VOCAB
    )
    if seeded:  # 53 bits of SGLang's hash at the counters V and V + 1, high word first
        cols = torch.tensor([VOCAB, VOCAB + 1])
        words = host.murmur.murmur_hash32(info.sampling_seed.to(torch.uint64), positions, cols)
        words = words.to(torch.int64)
        u = ((words[:, 0] << 21) | (words[:, 1] >> 11)).to(torch.float64) / 2.0**53
    else:  # torch's default generator, as SGLang's torch.multinomial
        torch.manual_seed(123)
        u = torch.rand(6, dtype=torch.float64)
    expected = exactlogp.sample(logits, uniforms=u, **params)
    assert ids.dtype == torch.int32
    assert torch.equal(ids.long(), expected)
    keep = exactlogp.sampling_mask(logits, **params).keep_mask
    assert bool(keep[torch.arange(6), ids.long()].all())
    assert keep.sum(-1).tolist() == [11, 4, 35, 7, VOCAB, VOCAB]  # rows 0-3 cut, 4-5 do not
    assert int(ids[5]) == int(logits[5].argmax())  # the greedy row (temperature 0)
    processed = exactlogp.processed_logprobs(logits, ids.long(), **params).logprobs
    assert torch.equal(out.next_token_logprobs, processed)
    assert torch.equal(out.next_token_logits, logits)  # drawn on the logits, left as they were


def test_exact_cut_rollout_replays_with_ratio_one(host):
    """The trainer's processed replay of the rollout's tokens gives r = 1 exactly: verl's
    FSDP replay on the logits divided as SGLang divides (temperature 1 on them), and
    processed_logprobs with exact_cut_params on the logits themselves."""
    logits, info = _mixed_batch(host)
    sglang.patch_sglang(cut="exact")
    ids, out = _run(host, logits, info, rng=7)
    rollout = out.next_token_logprobs
    ids = ids.long()
    sampled = slice(0, 5)  # the rows with a temperature (row 5 is greedy)
    divided = logits[sampled] / info.temperatures[sampled]
    replay = processed_logprobs_from_logits(
        divided, ids[sampled], top_k=info.top_ks[sampled].long().where(
            info.top_ks[sampled] < VOCAB, 0), top_p=info.top_ps[sampled],
        min_p=info.min_ps[sampled],
    )  # fmt: skip
    assert bool(replay.loss_mask.all())
    ratio = torch.exp(replay.logprobs - rollout[sampled])
    assert torch.equal(ratio, torch.ones_like(ratio))
    params = sglang.exact_cut_params(
        info.temperatures, info.top_ks, info.top_ps, info.min_ps, VOCAB
    )
    trainer = exactlogp.processed_logprobs(logits, ids, **params).logprobs
    ratio = torch.exp(trainer - rollout)
    assert torch.equal(ratio, torch.ones_like(ratio))


def test_exact_cut_seeded_draws_do_not_depend_on_the_batch(host):
    seeds = [3, 1 << 40, -5, 42, 42, 7]
    logits, info = _mixed_batch(host, seeds)
    positions = torch.tensor([9, 0, 31, 4, 5, 17])
    sglang.patch_sglang(cut="exact")
    ids, _ = _run(host, logits, info, positions=positions, rng=1)
    again, _ = _run(host, logits, info, positions=positions, rng=2)
    assert torch.equal(ids, again)  # the seeds decide, not torch's generator
    order = torch.tensor([4, 2, 0, 5, 1, 3])
    shuffled = dataclass_rows(info, order)
    ids2, _ = _run(host, logits[order], shuffled, positions=positions[order], rng=3)
    assert torch.equal(ids2, ids[order])


def dataclass_rows(info, order):
    import dataclasses

    return dataclasses.replace(
        info, temperatures=info.temperatures[order], top_ps=info.top_ps[order],
        top_ks=info.top_ks[order], min_ps=info.min_ps[order],
        sampling_seed=info.sampling_seed[order],
    )  # fmt: skip


def test_exact_cut_logprob_lists_are_the_kept_sets(host):
    logits, info = _mixed_batch(host)
    sglang.patch_sglang(cut="exact")
    tops = [3, 0, 5, 2, 1, 4]
    first, _ = _run(host, logits, info, rng=4, logprob=False)
    params = sglang.exact_cut_params(
        info.temperatures, info.top_ks, info.top_ps, info.min_ps, VOCAB
    )
    keep = exactlogp.sampling_mask(logits, **params).keep_mask
    dropped = int((~keep[0]).nonzero()[0])
    asked = [[int(first[0]), dropped], None, [int(first[2])], None, [0, 1, 2], None]
    ids, out = _run(host, logits, info, lists=(tops, asked), rng=4)
    assert torch.equal(ids, first)

    def exact(row_ids, i):  # processed_logprobs of token t in row i, one full row per id
        target = torch.zeros(6, dtype=torch.int64)
        values = []
        for t in row_ids:
            target[i] = int(t)
            values.append(exactlogp.processed_logprobs(logits, target, **params).logprobs[i])
        return torch.stack(values).clamp(min=F32_MIN)

    for i, k in enumerate(tops):
        idx, val = out.next_token_top_logprobs_idx[i], out.next_token_top_logprobs_val[i]
        assert len(idx) == len(val) == k
        if k:
            assert bool(keep[i, idx].all())
            assert torch.equal(val, exact(idx.tolist(), i))
            assert bool((val[:-1] >= val[1:]).all())
    vals, idxs = out.next_token_token_ids_logprobs_val, out.next_token_token_ids_logprobs_idx
    assert idxs == [a if a is not None else [] for a in asked]
    assert vals[1].numel() == 0
    assert torch.equal(vals[0][0], out.next_token_logprobs[0])  # the sampled token, same bits
    assert float(vals[0][1]) == F32_MIN  # outside the kept set
    assert torch.equal(vals[2][0], out.next_token_logprobs[2])
    assert torch.equal(vals[4], exact([0, 1, 2], 4))
    with pytest.raises(ValueError, match=r"token_ids_logprobs\[1\] holds 700"):
        _run(host, logits, info, lists=(tops, [None, [VOCAB], None, None, None, None]))


def test_exact_cut_keeps_sglang_for_all_greedy_batches(host):
    logits, info = _float_batch(host, greedy=True)
    ids, theirs = _run(host, logits, info)
    sglang.patch_sglang(cut="exact")
    ids2, ours = _run(host, logits, info)
    assert torch.equal(ids, ids2) and ids2.dtype == ids.dtype  # SGLang's argmax
    expected = selected_logprobs(logits, ids).logprobs
    assert_bitwise_equal(ours.next_token_logprobs, expected, "greedy")


def test_exact_cut_with_original_logprobs_reports_them(host, monkeypatch):
    monkeypatch.setattr(host.sampler, "SGLANG_RETURN_ORIGINAL_LOGPROB", True)
    logits, info = _mixed_batch(host)
    sglang.patch_sglang(cut="exact")
    ids, out = _run(host, logits, info, lists=([2] * 6, [None] * 6))
    raw = selected_logprobs(logits, ids.long()).logprobs
    assert torch.equal(out.next_token_logprobs, raw)
    top = torch.stack(out.next_token_top_logprobs_idx)
    assert torch.equal(top[:, 0], logits.argmax(-1))


def test_exact_cut_refusals_and_custom_processors(host):
    logits, info = _mixed_batch(host)
    sglang.patch_sglang(cut="exact")
    forced = 123

    def only(rows, params):
        out = torch.full_like(rows, float("-inf"))
        out[:, forced] = 0.0
        return out

    info.has_custom_logit_processor = True
    info.custom_logit_processor = {0: host.info.ProcessorEntry(only, [1, 4], torch.tensor([1, 4]))}
    info.custom_params = [None] * 6
    ids, _ = _run(host, logits, info, logprob=False)  # SGLang's own preprocessing ran
    assert ids[1] == forced and ids[4] == forced
    with pytest.raises(NotImplementedError, match="custom logit processors"):
        _run(host, logits, info)
    info.has_custom_logit_processor = False
    out = types.SimpleNamespace(next_token_logits=logits.clone())
    sampler = host.sampler.Sampler()
    with pytest.raises(NotImplementedError, match="watermark"):
        sampler(out, info, True, [0] * 6, [None] * 6, None, logprob_logits=logits.clone())
    info.sampling_mask_batch_indices = torch.tensor([0])
    with pytest.raises(NotImplementedError, match="return_sampling_mask"):
        _run(host, logits, info, logprob=False)
    info.sampling_mask_batch_indices = None
    info.sampling_seed = torch.ones(6, dtype=torch.int64)
    with pytest.raises(ValueError, match="positions"):
        _run(host, logits, info, positions=None)


def test_cut_argument_and_environment(host, monkeypatch):
    with pytest.raises(ValueError, match=r"cut must be one of \('float', 'exact'\), got 'vllm'"):
        sglang.patch_sglang(cut="vllm")
    sglang.patch_sglang()
    with pytest.raises(ValueError, match="already applied"):
        sglang.patch_sglang(cut="exact")
    sglang.unpatch_sglang()
    monkeypatch.setenv("EXACTLOGP_PATCH", "sglang")
    monkeypatch.setenv("EXACTLOGP_SGLANG_CUT", "exactly")
    with pytest.raises(ValueError, match="EXACTLOGP_SGLANG_CUT='exactly'"):
        autopatch.sglang_plugin()
    monkeypatch.setenv("EXACTLOGP_SGLANG_CUT", " exact ")
    autopatch.sglang_plugin()
    assert exactlogp.integrations._patching.active("patch_sglang").options == {"cut": "exact"}
    sglang.unpatch_sglang()
    monkeypatch.setenv("EXACTLOGP_SGLANG_CUT", "")
    autopatch.sglang_plugin()
    assert exactlogp.integrations._patching.active("patch_sglang").options == {}


def test_exact_cut_undo_restores_sglang(host):
    logits, info = _mixed_batch(host)
    original = host.sampler.Sampler.__dict__["forward"]
    ids, theirs = _run(host, logits, info, rng=9)
    sglang.patch_sglang(cut="exact")
    _run(host, logits, info, rng=9)
    assert sglang.unpatch_sglang() is True
    assert host.sampler.Sampler.__dict__["forward"] is original
    ids2, again = _run(host, logits, info, rng=9)
    assert torch.equal(ids, ids2)
    assert torch.equal(theirs.next_token_logprobs, again.next_token_logprobs)


def test_exact_cut_needs_the_sampler_hooks(host, monkeypatch):
    monkeypatch.delattr(host.sampler, "murmur_hash32")
    original = host.sampler.Sampler.__dict__["forward"]
    with pytest.raises(RuntimeError, match=r"SGLang 0\.5\.23 cannot take the exact cut.*murmur"):
        sglang.patch_sglang(cut="exact")
    assert host.sampler.Sampler.__dict__["forward"] is original
    sglang.patch_sglang()  # the default cut needs none of them


def test_exact_cut_params_maps_sglang_conventions():
    p = sglang.exact_cut_params(
        torch.tensor([[0.7], [1.0], [1.0]]), torch.tensor([1 << 30, 1, 5], dtype=torch.int32),
        torch.tensor([0.9, 0.5, 1.0]), torch.tensor([0.0, 0.2, 0.1]), VOCAB,
    )  # fmt: skip
    assert p["temperature"].tolist() == pytest.approx([0.7, 0.0, 1.0])
    assert p["top_k"].tolist() == [0, 0, 5]
    assert p["top_p"].tolist() == pytest.approx([0.9, 1.0, 1.0])
    assert p["min_p"].tolist() == pytest.approx([0.0, 0.0, 0.1])
    with pytest.raises(ValueError, match="top_ps has shape"):
        sglang.exact_cut_params(torch.ones(3, 1), torch.ones(3, dtype=torch.int32),
                                torch.ones(2), torch.zeros(3), VOCAB)  # fmt: skip
    with pytest.raises(TypeError, match="top_ks must have an integer dtype"):
        sglang.exact_cut_params(torch.ones(3), torch.ones(3), torch.ones(3), torch.zeros(3), VOCAB)
