"""exactlogp.integrations.vllm without vLLM: the keep-mask, `rollout_logprobs` (also over a
gloo tensor-parallel group) and the patch's error paths. The patch against vLLM's own
sampler and logprob code (0.34's V2 runner, 0.33's V1 sampler) is in
test_integrations_vllm_real.py.
"""

from __future__ import annotations

import types

import pytest
import torch

from exactlogp import selected_logprobs
from exactlogp.integrations import autopatch, vllm
from exactlogp.integrations.megatron import megatron_padded_vocab_size
from exactlogp.testing import assert_bitwise_equal, llm_like_logits, run_gloo_world, simulate_shards
from integration_stubs import install_vllm_sampler

VOCAB = 1000


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


# --- patch_vllm_sampler's error paths (vLLM's own code: test_integrations_vllm_real.py) ---


def test_patch_names_a_moved_symbol(monkeypatch):
    """A vLLM whose vllm.v1.sample.sampler lost Sampler.forward (a module built here)."""

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


def test_exact_cut_bad_values_and_a_v1_only_vllm_are_refused(monkeypatch):
    """cut is checked before vLLM is imported; cut="exact" needs the V2 model runner (a
    vLLM with only vllm.v1.sample.sampler, built here, is refused and left unpatched);
    EXACTLOGP_VLLM_CUT is checked by name. The exact cut itself runs against vLLM's own
    sampler in test_integrations_vllm_real.py."""
    import sys

    monkeypatch.setitem(sys.modules, "vllm", None)
    with pytest.raises(ValueError, match=r"cut must be one of \('vllm', 'exact'\), got 'fast'"):
        vllm.patch_vllm_sampler(cut="fast")
    monkeypatch.setenv("EXACTLOGP_VLLM_CUT", "sort")
    with pytest.raises(ValueError, match=r"EXACTLOGP_VLLM_CUT='sort' must be one of vllm, exact"):
        vllm.requested_cut()
    for raw, cut in (("", "vllm"), (" exact ", "exact"), ("vllm", "vllm")):
        monkeypatch.setenv("EXACTLOGP_VLLM_CUT", raw)
        assert vllm.requested_cut() == cut

    class Sampler:
        def forward(self, logits, sampling_metadata):
            return None

    install_vllm_sampler(monkeypatch, Sampler)
    with pytest.raises(RuntimeError, match=r"cannot take the exact cut: it has no V2 model runner"):
        vllm.patch_vllm_sampler(cut="exact")
    assert Sampler.__dict__["forward"].__name__ == "forward"
    assert not hasattr(Sampler.forward, "__wrapped__")


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


def test_token_logprobs_ids_outside_the_vocabulary_and_cut_tokens_give_minus_inf():
    logits, _ = llm_like_logits(8, VOCAB, torch.bfloat16, seed=3)
    x = logits.float()
    x[:, 10:] = float("-inf")
    ids = torch.tensor([[3, 20, -1, VOCAB]] * 8)
    got = vllm.token_logprobs(x, ids)
    assert bool(torch.isinf(got[:, 1:]).all()) and bool(torch.isfinite(got[:, 0]).all())
    assert_bitwise_equal(got[:, 0], selected_logprobs(x, ids[:, 0]).logprobs, "column 0")


def test_unknown_vllm_layout_is_refused_with_its_version(monkeypatch):
    import sys

    fake = types.ModuleType("vllm")
    fake.__version__ = "0.99.0"
    monkeypatch.setitem(sys.modules, "vllm", fake)
    for name in ("vllm.v1", "vllm.v1.worker", "vllm.v1.sample"):
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(RuntimeError, match=r"vLLM 0\.99\.0 has neither .* nothing was patched"):
        vllm.patch_vllm_sampler()


def test_plugin_without_the_variable_does_nothing_and_imports_nothing(monkeypatch):
    """vLLM calls the plugin in every process; unless EXACTLOGP_PATCH names vllm it returns
    without importing vLLM (vLLM's own loader patching: test_integrations_vllm_real.py)."""
    import sys

    monkeypatch.delenv("EXACTLOGP_PATCH", raising=False)
    monkeypatch.setitem(sys.modules, "vllm", None)  # importing vLLM would raise
    assert autopatch.vllm_plugin() is None
    monkeypatch.setenv("EXACTLOGP_PATCH", "trl")
    assert autopatch.vllm_plugin() is None
