"""exactlogp.integrations.vllm: the rollout side, against a stand-in for vLLM's v1 sampler.

vLLM does not run here. `StubSampler` follows the published structure of
`vllm.v1.sample.sampler.Sampler.forward` (fp32 logits edited in place, temperature with
greedy rows at 1.0, sort-based top-k / top-p, the sampled token's logprob in column 0),
written independently of the code under test.
"""

from __future__ import annotations

import types
from typing import NamedTuple

import pytest
import torch

from exactlogp import selected_logprobs
from exactlogp.integrations import vllm
from exactlogp.integrations.megatron import megatron_padded_vocab_size
from exactlogp.testing import assert_bitwise_equal, llm_like_logits, run_gloo_world, simulate_shards
from integration_stubs import install_vllm_sampler

VOCAB = 1000


class LogprobsTensors(NamedTuple):
    logprob_token_ids: torch.Tensor
    logprobs: torch.Tensor
    selected_token_ranks: torch.Tensor


def _sort_based_cut(logits, k, p):
    """vLLM's published top-k / top-p: sort ascending, fill -inf, scatter back."""
    ascending, order = logits.sort(dim=-1)
    if k is not None:
        threshold = ascending.gather(1, (ascending.size(1) - k.long()).unsqueeze(1))
        ascending.masked_fill_(ascending < threshold, float("-inf"))
    if p is not None:
        running = ascending.softmax(dim=-1).cumsum(dim=-1)
        drop = running <= 1 - p.unsqueeze(1)
        drop[:, -1] = False
        ascending.masked_fill_(drop, float("-inf"))
    return ascending.scatter(dim=-1, index=order, src=ascending)


class StubSampler:
    def __init__(self, logprobs_mode="raw_logprobs"):
        self.logprobs_mode = logprobs_mode

    def forward(self, logits, sampling_metadata, predict_bonus_token=False):
        md = sampling_metadata
        logits = logits.to(torch.float32)  # no copy for fp32: edits below reach the caller
        raw = logits.log_softmax(-1) if self.logprobs_mode == "raw_logprobs" else None
        if md.all_greedy:
            sampled = logits.argmax(-1)
            processed = logits.log_softmax(-1)
        else:
            temp = (
                md.temperature
                if md.all_random
                else torch.where(md.temperature < 1e-5, 1.0, md.temperature)
            )
            logits.div_(temp.unsqueeze(1))
            logits = _sort_based_cut(logits, md.top_k, md.top_p)
            processed = logits.log_softmax(-1)
            q = torch.empty_like(logits).exponential_(generator=md.generator)
            sampled = (logits.softmax(-1) / q).argmax(-1)
            greedy = md.temperature < 1e-5
            sampled = torch.where(greedy, logits.argmax(-1), sampled)
        sampled_ids = sampled.int()[:, None]
        if md.max_num_logprobs is None:
            return types.SimpleNamespace(sampled_token_ids=sampled_ids, logprobs_tensors=None)
        lp = raw if raw is not None else processed
        token_lp = lp.gather(-1, sampled[:, None])
        top_lp, top_ids = lp.topk(max(md.max_num_logprobs, 1), -1)
        tensors = LogprobsTensors(
            torch.cat([sampled[:, None], top_ids], 1).int(),
            torch.cat([token_lp, top_lp], 1),
            (lp > token_lp).sum(-1),
        )
        return types.SimpleNamespace(sampled_token_ids=sampled_ids, logprobs_tensors=tensors)


def _metadata(n, *, temperature=None, top_k=None, top_p=None, all_greedy=False, seed=0, **extra):
    fields = dict(
        temperature=temperature, all_greedy=all_greedy,
        all_random=temperature is not None and bool((temperature >= 1e-5).all()),
        top_k=top_k, top_p=top_p, max_num_logprobs=2, no_penalties=True,
        allowed_token_ids_mask=None, bad_words_token_ids={}, logprobs_mode_override=None,
        generator=torch.Generator().manual_seed(seed),
    )  # fmt: skip
    fields.update(extra)
    return types.SimpleNamespace(**fields)


@pytest.fixture(autouse=True)
def _no_patch_left_behind():
    yield
    vllm.unpatch_vllm_sampler()


@pytest.fixture
def batch():
    logits, _ = llm_like_logits(8, VOCAB, torch.bfloat16, seed=11)
    n = logits.shape[0]
    md = _metadata(
        n,
        temperature=torch.tensor([0.7, 1.0, 1.3, 0.0, 0.9, 2.0, 1.0, 0.5]),
        top_k=torch.tensor([50, VOCAB, 5, VOCAB, 1, 200, VOCAB, 20]),
        top_p=torch.tensor([0.9, 1.0, 0.8, 1.0, 1.0, 0.95, 0.5, 1.0]),
    )
    return logits, md


# --- the keep mask ---


def test_top_k_keeps_values_at_or_above_the_kth_largest():
    logits, _ = llm_like_logits(6, VOCAB, torch.float32, seed=1)
    k = torch.tensor([1, 2, 10, 999, VOCAB, 3])
    mask = vllm.vllm_keep_mask(logits, top_k=k)
    for i in range(6):
        kth = logits[i].topk(int(k[i])).values[-1]
        assert torch.equal(mask[i], logits[i] >= kth)
    assert bool(mask[4].all())


def test_top_k_keeps_ties():
    y = torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0]])
    assert vllm.vllm_keep_mask(y, top_k=2).tolist() == [[False, True, True, False, True]]


def test_keep_mask_matches_the_sort_based_sampler(batch):
    logits, md = batch
    y = logits.float() / torch.where(md.temperature < 1e-5, 1.0, md.temperature)[:, None]
    cut = _sort_based_cut(y.clone(), md.top_k, md.top_p)
    mask = vllm.vllm_keep_mask(y, md.top_k, md.top_p)
    assert torch.equal(mask, cut != float("-inf"))


def test_top_p_against_fp64_nucleus():
    # Away from ties and from the boundary, vLLM's rule keeps the smallest set of
    # largest tokens whose probability exceeds p.
    logits, _ = llm_like_logits(16, VOCAB, torch.float32, seed=2)
    p = 0.8
    mask = vllm.vllm_keep_mask(logits, top_p=p)
    probs = torch.softmax(logits.double(), -1)
    for i in range(16):
        desc, order = probs[i].sort(descending=True)
        before = desc.cumsum(0) - desc  # mass strictly above each token
        expected = torch.zeros(VOCAB, dtype=torch.bool)
        expected[order[before < p]] = True
        assert (before - p).abs().min() > 1e-5  # no boundary case in this data
        assert torch.equal(mask[i], expected), i


def test_shard_keep_mask_pads_with_false():
    full = torch.tensor([[True, False, True, True, False]])
    assert vllm.shard_keep_mask(full, 0, 3).tolist() == [[True, False, True]]
    assert vllm.shard_keep_mask(full, 3, 3).tolist() == [[True, False, False]]
    assert vllm.shard_keep_mask(full, 6, 3).tolist() == [[False, False, False]]


def test_padded_vocab_sizes():
    assert vllm.vllm_padded_vocab_size(151936) == 151936  # 2374 * 64
    assert vllm.vllm_padded_vocab_size(151937) == 152000
    assert megatron_padded_vocab_size(151936, 4) == 152064


# --- rollout_logprobs ---


def test_raw_logprobs_are_the_operator_bits(batch):
    logits, _ = batch
    tokens = torch.arange(8) * 7
    got = vllm.rollout_logprobs(logits, tokens)
    assert_bitwise_equal(got.logprobs, selected_logprobs(logits, tokens).logprobs, "raw")


def test_processed_logprobs_equal_a_padded_tp4_trainer(batch):
    logits, md = batch
    tokens = logits.float().argmax(-1)  # always kept by any cut
    got = vllm.rollout_logprobs(
        logits,
        tokens,
        temperature=md.temperature,
        top_k=md.top_k,
        top_p=md.top_p,
        with_entropy=True,
    )
    # The trainer: Megatron-padded TP=4 shards, the rollout's keep mask, same temperature.
    tau = torch.where(md.temperature < 1e-5, 1.0, md.temperature)
    mask = vllm.vllm_keep_mask(logits.float() / tau[:, None], md.top_k, md.top_p)
    width = megatron_padded_vocab_size(VOCAB, 4, divisible_by=8)
    padded = torch.cat([logits, torch.zeros(8, width - VOCAB, dtype=logits.dtype)], -1)
    trainer = simulate_shards(
        padded, tokens, [0, width // 4, width // 2, 3 * width // 4, width],
        vocab_size=VOCAB, temperature=tau, keep_mask=vllm.shard_keep_mask(mask, 0, width),
    )  # fmt: skip
    assert_bitwise_equal(got.logprobs, trainer.logprobs, "rollout vs trainer")
    assert_bitwise_equal(got.entropy, trainer.entropy, "entropy")


def test_greedy_rows_are_scored_at_temperature_one(batch):
    logits, _ = batch
    tokens = logits.float().argmax(-1)
    greedy = vllm.rollout_logprobs(logits, tokens, temperature=torch.zeros(8))
    assert_bitwise_equal(greedy.logprobs, vllm.rollout_logprobs(logits, tokens).logprobs, "greedy")


def test_float_and_tensor_temperature_agree(batch):
    logits, _ = batch
    tokens = logits.float().argmax(-1)
    a = vllm.rollout_logprobs(logits, tokens, temperature=0.7)
    b = vllm.rollout_logprobs(logits, tokens, temperature=torch.full((8,), 0.7))
    assert_bitwise_equal(a.logprobs, b.logprobs, "float vs tensor temperature")


def test_keep_mask_is_combined_with_the_cut(batch):
    logits, _ = batch
    tokens = logits.float().argmax(-1)
    allowed = torch.ones(8, VOCAB, dtype=torch.bool)
    allowed[:, 500:] = False
    allowed[torch.arange(8), tokens] = True
    got = vllm.rollout_logprobs(logits, tokens, top_k=100, keep_mask=allowed)
    both = allowed & vllm.vllm_keep_mask(logits.float(), top_k=100)
    expected = selected_logprobs(logits, tokens, keep_mask=both).logprobs
    assert_bitwise_equal(got.logprobs, expected, "mask & cut")


def test_bad_arguments(batch):
    logits, _ = batch
    tokens = torch.zeros(8, dtype=torch.int64)
    with pytest.raises(ValueError, match="logits must be a 2-D"):
        vllm.rollout_logprobs(logits[0], tokens[0])
    with pytest.raises(ValueError, match="top_k must be >= 1"):
        vllm.rollout_logprobs(logits, tokens, top_k=0)
    with pytest.raises(ValueError, match=r"top_p must be in \(0.0, 1.0\]"):
        vllm.rollout_logprobs(logits, tokens, top_p=1.5)
    with pytest.raises(ValueError, match=r"temperature tensor shape \(3,\)"):
        vllm.rollout_logprobs(logits, tokens, temperature=torch.ones(3))
    with pytest.raises(TypeError, match="temperature must be a float or a tensor, got str"):
        vllm.rollout_logprobs(logits, tokens, temperature="1")
    with pytest.raises(ValueError, match="top_k / top_p / min_p need whole rows"):
        vllm.rollout_logprobs(logits, tokens, top_k=5, tp_group=object())
    with pytest.raises(ValueError, match=r"min_p must be in \[0, 1\], got -0.1"):
        vllm.rollout_logprobs(logits, tokens, min_p=-0.1)


# --- patch_vllm_sampler ---


def _run_sampler(mode, logits, md, patched):
    vllm.unpatch_vllm_sampler()
    if patched:
        vllm.patch_vllm_sampler()
    md.generator.manual_seed(0)
    return StubSampler(mode).forward(logits, md)


@pytest.mark.parametrize("mode", ["raw_logprobs", "processed_logprobs"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_patched_sampler_reports_exact_logprobs(monkeypatch, batch, mode, dtype):
    install_vllm_sampler(monkeypatch, StubSampler)
    logits, md = batch
    logits = logits.to(dtype)
    theirs = _run_sampler(mode, logits.clone(), md, patched=False)
    pristine = logits.clone()
    out = _run_sampler(mode, logits, md, patched=True)
    sampled = out.sampled_token_ids[:, 0].long()
    assert torch.equal(sampled, theirs.sampled_token_ids[:, 0].long())  # sampling untouched
    if mode == "raw_logprobs":
        expected = vllm.rollout_logprobs(pristine, sampled).logprobs
    else:
        expected = vllm.rollout_logprobs(
            pristine, sampled, temperature=md.temperature, top_k=md.top_k, top_p=md.top_p
        ).logprobs
    values, ids = out.logprobs_tensors.logprobs, out.logprobs_tensors.logprob_token_ids
    assert_bitwise_equal(values[:, 0], expected, f"{mode} column 0")
    same = ids.long() == sampled[:, None]
    assert bool(same[:, 1:].any())  # the sampled token is also among the top-k somewhere
    assert_bitwise_equal(values[same], expected[:, None].expand_as(values)[same], "repeats")
    assert torch.equal(values[~same], theirs.logprobs_tensors.logprobs[~same])  # the others
    torch.testing.assert_close(
        out.logprobs_tensors.logprobs[:, 0],
        theirs.logprobs_tensors.logprobs[:, 0],
        atol=1e-5,
        rtol=1e-5,
    )


def test_patched_sampler_all_greedy_processed(monkeypatch, batch):
    install_vllm_sampler(monkeypatch, StubSampler)
    logits, _ = batch
    md = _metadata(8, all_greedy=True)
    out = _run_sampler("processed_logprobs", logits, md, patched=True)
    sampled = out.sampled_token_ids[:, 0].long()
    expected = vllm.rollout_logprobs(logits, sampled).logprobs
    assert_bitwise_equal(out.logprobs_tensors.logprobs[:, 0], expected, "all greedy")


def test_patched_sampler_leaves_other_modes_alone(monkeypatch, batch):
    install_vllm_sampler(monkeypatch, StubSampler)
    logits, md = batch
    md.max_num_logprobs = None
    vllm.patch_vllm_sampler()
    calls = []
    original = vllm.rollout_logprobs
    monkeypatch.setattr(
        vllm, "rollout_logprobs", lambda *a, **k: calls.append(1) or original(*a, **k)
    )
    StubSampler("raw_logprobs").forward(logits, md)
    md.max_num_logprobs = 2
    StubSampler("processed_logits").forward(logits, md)
    assert calls == []


def test_patched_sampler_refuses_unsupported_processing(monkeypatch, batch):
    install_vllm_sampler(monkeypatch, StubSampler)
    logits, md = batch
    md.no_penalties = False
    md.bad_words_token_ids = {0: [[3]]}
    vllm.patch_vllm_sampler()
    with pytest.raises(ValueError, match="processed_logprobs with penalties, bad_words is not"):
        StubSampler("processed_logprobs").forward(logits, md)


def test_patch_is_idempotent_and_reversible(monkeypatch):
    install_vllm_sampler(monkeypatch, StubSampler)
    original = StubSampler.__dict__["forward"]
    handle = vllm.patch_vllm_sampler()
    assert vllm.patch_vllm_sampler() is handle
    assert StubSampler.__dict__["forward"].__wrapped__ is original
    assert handle.sites == ("vllm.v1.sample.sampler.Sampler.forward",)
    assert vllm.unpatch_vllm_sampler() is True
    assert StubSampler.__dict__["forward"] is original
    assert vllm.unpatch_vllm_sampler() is False


def test_patch_names_a_moved_symbol(monkeypatch):
    class Elsewhere:
        pass

    install_vllm_sampler(monkeypatch, Elsewhere)
    with pytest.raises(
        AttributeError, match=r"vllm\.v1\.sample\.sampler\.Sampler\.forward does not exist"
    ):
        vllm.patch_vllm_sampler()


def test_patch_without_vllm_is_a_clear_error(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "vllm", None)
    with pytest.raises(ImportError, match=r"patch_vllm_sampler: cannot import vllm"):
        vllm.patch_vllm_sampler()


# --- logits still split over vLLM's tensor-parallel group (gloo world of 2) ---


def _sharded_rollout(rank, world_size, group, logits, tokens, temperature, mask):
    width = logits.shape[-1] // world_size
    cols = slice(rank * width, (rank + 1) * width)
    return vllm.rollout_logprobs(
        logits[:, cols], tokens, temperature=temperature, vocab_size=VOCAB, tp_group=group,
        keep_mask=vllm.shard_keep_mask(mask, rank * width, width), with_entropy=True,
    )  # fmt: skip


def test_sharded_rollout_equals_gathered(batch):
    logits, md = batch
    tokens = logits.float().argmax(-1)
    padded_width = vllm.vllm_padded_vocab_size(VOCAB)  # 1024 = 2 * 512
    padded = torch.cat([logits, torch.zeros(8, padded_width - VOCAB, dtype=logits.dtype)], -1)
    tau = torch.where(md.temperature < 1e-5, 1.0, md.temperature)
    mask = vllm.vllm_keep_mask(logits.float() / tau[:, None], md.top_k, md.top_p)
    gathered = vllm.rollout_logprobs(
        logits,
        tokens,
        temperature=md.temperature,
        top_k=md.top_k,
        top_p=md.top_p,
        with_entropy=True,
    )
    results = run_gloo_world(2, _sharded_rollout, padded, tokens, md.temperature, mask)
    for rank, got in enumerate(results):
        assert_bitwise_equal(got.logprobs, gathered.logprobs, f"rank {rank} logprobs")
        assert_bitwise_equal(got.entropy, gathered.entropy, f"rank {rank} entropy")


# --- vLLM 0.34's V2 model runner (a stand-in package with its module layout) ---


@pytest.fixture
def v2(monkeypatch):
    """vLLM 0.34's V2 sampler modules from tests/host_stubs (vLLM has no CPU wheel)."""
    from integration_stubs import drop_stub_modules, use_stub_package

    use_stub_package(monkeypatch, "vllm")
    import vllm.v1.worker.gpu.sample.prompt_logprob as prompt
    import vllm.v1.worker.gpu.sample.sampler as sampler
    import vllm.v1.worker.gpu.spec_decode.rejection_sampler as spec

    yield types.SimpleNamespace(sampler=sampler, prompt=prompt, spec=spec)
    vllm.unpatch_vllm_sampler()
    drop_stub_modules("vllm")


def _v2_batch(n=8, processing=True, seed=3, **overrides):
    logits, _ = llm_like_logits(n, VOCAB, torch.bfloat16, seed=seed)
    fields = dict(
        needs_processing=processing, logit_bias=None, repetition_penalty=None, bad_words=None,
        temperature=torch.tensor([0.7, 1.0, 1.3, 0.0, 0.9, 2.0, 1.0, 0.5])[:n],
        min_p=torch.tensor([0.0, 0.05, 0.0, 0.0, 0.1, 0.0, 0.0, 0.2])[:n],
        top_k=torch.tensor([50, VOCAB, 5, VOCAB, 1, 200, VOCAB, 20])[:n],
        top_p=torch.tensor([0.9, 1.0, 0.8, 1.0, 1.0, 0.95, 0.5, 1.0])[:n],
        num_logprobs=3, generator=torch.Generator().manual_seed(seed),
    )  # fmt: skip
    fields.update(overrides)
    return logits, types.SimpleNamespace(**fields)


def _trainer_view(logits, batch):
    """What a trainer recomputes: the logits as the processors left them before the
    temperature (bias, penalties, bad words), the temperature as exactlogp takes it
    (greedy rows at 1), and the keep-mask of the tokens that survived min-p / top-k / top-p."""
    from vllm.v1.worker.gpu.sample.sampler import Sampler

    untempered = types.SimpleNamespace(**{
        **vars(batch), "temperature": torch.ones_like(batch.temperature),
        "min_p": torch.zeros_like(batch.min_p), "top_k": torch.full_like(batch.top_k, VOCAB),
        "top_p": torch.ones_like(batch.top_p),
    })  # fmt: skip
    edited = Sampler().apply_sampling_params(logits, untempered)
    processed = Sampler().apply_sampling_params(logits, batch)
    tau = torch.where(batch.temperature == 0, 1.0, batch.temperature)
    return edited, tau, torch.isfinite(processed)


@pytest.mark.parametrize("mode", ["raw_logprobs", "processed_logprobs"])
def test_v2_sampler_reports_exact_logprobs(v2, mode):
    logits, batch = _v2_batch()
    theirs = v2.sampler.Sampler(mode)(logits, batch)
    handle = vllm.patch_vllm_sampler()
    assert handle.sites[0] == "vllm.v1.worker.gpu.sample.logprob.compute_token_logprobs"
    batch.generator.manual_seed(3)
    ours = v2.sampler.Sampler(mode)(logits, batch)
    assert torch.equal(ours.sampled_token_ids, theirs.sampled_token_ids)  # sampling untouched
    ids = ours.logprobs_tensors.logprob_token_ids
    assert torch.equal(ids, theirs.logprobs_tensors.logprob_token_ids)
    got = ours.logprobs_tensors.logprobs
    torch.testing.assert_close(got, theirs.logprobs_tensors.logprobs, atol=1e-5, rtol=1e-5)
    if mode == "raw_logprobs":
        for k in range(ids.shape[1]):
            assert_bitwise_equal(
                got[:, k], selected_logprobs(logits, ids[:, k]).logprobs, f"col {k}"
            )
        return
    # processed: the trainer's raw logits + temperature + keep-mask give the same bits
    edited, tau, keep = _trainer_view(logits, batch)
    for k in range(ids.shape[1]):
        kept = keep.gather(1, ids[:, k : k + 1])[:, 0]  # top-k columns may be cut tokens
        target = torch.where(kept, ids[:, k], -100)
        exact = selected_logprobs(edited, target, temperature=tau, keep_mask=keep).logprobs
        assert_bitwise_equal(got[kept, k], exact[kept], f"processed col {k}")
        assert bool((got[~kept, k] == float("-inf")).all())
    sampled = ids[:, 0]
    rebuilt = vllm.rollout_logprobs(
        logits, sampled, temperature=batch.temperature, top_k=batch.top_k, top_p=batch.top_p,
        min_p=batch.min_p,
    ).logprobs  # fmt: skip
    assert_bitwise_equal(got[:, 0], rebuilt, "rollout_logprobs rebuilds min-p, top-k, top-p")


def test_v2_bias_penalties_and_bad_words_come_before_the_operator(v2):
    """They edit the logits; the arithmetic stays exactlogp's on the edited logits."""
    g = torch.Generator().manual_seed(9)
    counts = torch.randint(0, 3, (8, VOCAB), generator=g).float()
    bad = torch.zeros(8, VOCAB, dtype=torch.bool)
    bad[:, 7] = True
    logits, batch = _v2_batch(
        logit_bias=torch.randn(8, VOCAB, generator=g), repetition_penalty=torch.full((8,), 1.2),
        frequency_penalty=torch.full((8,), 0.1), presence_penalty=torch.full((8,), 0.2),
        output_counts=counts, bad_words=bad,
    )  # fmt: skip
    vllm.patch_vllm_sampler()
    out = v2.sampler.Sampler("processed_logprobs")(logits, batch)
    edited, tau, keep = _trainer_view(logits, batch)
    assert not bool(keep[:, 7].any())
    ids = out.logprobs_tensors.logprob_token_ids
    exact = selected_logprobs(edited, ids[:, 0], temperature=tau, keep_mask=keep).logprobs
    assert_bitwise_equal(out.logprobs_tensors.logprobs[:, 0], exact, "edited logits")


def test_v2_spec_decode_and_prompt_logprobs_are_covered(v2):
    logits, batch = _v2_batch()
    vllm.patch_vllm_sampler()
    drafts = logits.float().argmax(-1)
    sampler = v2.sampler.Sampler("processed_logprobs")
    got = v2.spec.RejectionSampler(sampler).draft_logprobs(logits, batch, drafts).logprobs[:, 0]
    edited, tau, keep = _trainer_view(logits, batch)
    exact = selected_logprobs(edited, drafts, temperature=tau, keep_mask=keep).logprobs
    assert_bitwise_equal(got, exact, "spec decode")
    ids = torch.stack([drafts, torch.zeros_like(drafts)], -1)
    prompt = v2.prompt.compute_prompt_token_id_logprobs(logits, ids)
    assert_bitwise_equal(prompt[:, 1], selected_logprobs(logits, ids[:, 1]).logprobs, "prompt")


def test_v2_ids_outside_the_vocabulary_and_cut_tokens_give_minus_inf(v2):
    logits, _ = _v2_batch()
    x = logits.float()
    x[:, 10:] = float("-inf")
    ids = torch.tensor([[3, 20, -1, VOCAB]] * 8)
    got = vllm.token_logprobs(x, ids)
    assert bool(torch.isinf(got[:, 1:]).all()) and bool(torch.isfinite(got[:, 0]).all())


def test_v2_many_columns_keep_the_sampled_one_exact(v2):
    logits, batch = _v2_batch(processing=False, num_logprobs=vllm.EXACT_COLUMNS + 4)
    vllm.patch_vllm_sampler()
    out = v2.sampler.Sampler("raw_logprobs")(logits, batch)
    ids = out.logprobs_tensors.logprob_token_ids
    exact = selected_logprobs(logits, ids[:, 0]).logprobs
    assert_bitwise_equal(out.logprobs_tensors.logprobs[:, 0], exact, "column 0")


def test_v2_refuses_a_runner_it_cannot_reach(v2, monkeypatch):
    import vllm.v1.worker.gpu.sample.logprob as logprob

    def compute_topk_scores(logits, num_logprobs, sampled_token_ids, **_):
        return torch.log_softmax(logits.float(), -1)  # no longer calls compute_token_logprobs

    monkeypatch.setattr(logprob, "compute_topk_scores", compute_topk_scores)
    with pytest.raises(RuntimeError, match=r"vLLM 0\.34\.0's .* would not take effect"):
        vllm.patch_vllm_sampler()
    assert not hasattr(logprob.compute_token_logprobs, "__wrapped__")  # nothing changed


def test_unknown_vllm_layout_is_refused_with_its_version(monkeypatch):
    import sys

    fake = types.ModuleType("vllm")
    fake.__version__ = "0.99.0"
    monkeypatch.setitem(sys.modules, "vllm", fake)
    for name in ("vllm.v1", "vllm.v1.worker", "vllm.v1.sample"):
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(RuntimeError, match=r"vLLM 0\.99\.0 has neither .* nothing was patched"):
        vllm.patch_vllm_sampler()


_CHILD = """
import os, sys
sys.path.insert(0, {stubs!r})
from vllm.plugins import load_general_plugins
load_general_plugins()  # what vLLM's engine core and each worker do at start-up
import vllm.v1.worker.gpu.sample.logprob as logprob
print("patched" if hasattr(logprob.compute_token_logprobs, "__wrapped__") else "not patched")
""".strip()


@pytest.mark.parametrize("requested", ["vllm", ""])
def test_plugin_patches_a_spawned_worker_when_asked(requested):
    import os
    import subprocess
    import sys

    from integration_stubs import STUB_ROOT

    env = dict(os.environ, EXACTLOGP_PATCH=requested, VLLM_PLUGINS="exactlogp")
    code = _CHILD.format(stubs=str(STUB_ROOT))
    run = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == ("patched" if requested else "not patched")
