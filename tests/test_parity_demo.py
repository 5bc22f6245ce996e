"""examples/train_rollout_parity.py at a small size: what the demo claims, checked so that
each check can fail.

The small run: 6 prompts x 4 tokens, decoding 4, 3, 2, 1, 1, 1 tokens (batch 6 -> 1), a
2-layer Qwen3-Next model (hidden 256) with a 5000-token vocabulary (the LM head's cost grows with it, the
claims do not), bf16 body, LM head in bf16 and fp32; the trainer is a real gloo TP=4
world with megatron-core. The same run has the processed-logprobs part (a second rollout
sampled by exactlogp.sample at top-k 50 / top-p 0.9 / min-p 0.05, replayed at TP=4).
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
import types
from pathlib import Path

import pytest
import torch

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
SMALL = [
    "--batch", "6", "--prompt-len", "4", "--new-tokens", "4", "--stagger", "1",
    "--layers", "2", "--hidden", "256", "--vocab", "5000", "--bodies", "bf16", "--scored", "bf16",
]  # fmt: skip


@pytest.fixture(scope="module")
def demo():
    pytest.importorskip("transformers")
    pytest.importorskip("megatron.core")
    sys.path.insert(0, str(EXAMPLES))  # spawned trainer ranks inherit sys.path
    try:
        yield importlib.import_module("train_rollout_parity")
    finally:
        sys.path.remove(str(EXAMPLES))


@pytest.fixture(scope="module")
def result(demo):
    return demo.main(SMALL)


def test_report_names_every_method_and_both_groups(demo, result):
    text = demo.format_report(result)
    rows = {(r.head, r.method, r.group) for r in result.rows}
    methods = [demo.EXACT, demo.TORCH, demo.BASELINE, demo.LOGITS]
    if result.trl is None:
        methods.append(demo.TRL)
    else:
        assert f"(d) TRL: not run, {result.trl}" in text
    for head in ("bf16", "fp32"):
        for method in methods:
            assert {(head, method, demo.EQUAL), (head, method, demo.DIFFER)} <= rows
            assert f"bf16 {head} {method}" in text
    assert result.num_tokens == 12 and result.padded_vocab == 5120
    assert result.config.lengths() == [4, 3, 2, 1, 1, 1]


def test_hidden_states_are_counted_token_by_token(demo, result):
    agreement = result.hidden["bf16"]
    assert agreement.tokens == result.num_tokens
    for head in ("bf16", "fp32"):
        equal = result.stats("bf16", head, demo.EXACT, demo.EQUAL).tokens
        differ = result.stats("bf16", head, demo.EXACT, demo.DIFFER).tokens
        assert (equal, differ) == (agreement.equal, agreement.tokens - agreement.equal)
    # the first token of each sequence is sampled right after the prompt prefill; whether
    # the trainer's prefill repeats it bit for bit is the CPU's matmul kernels' choice,
    # outside exactlogp (all 6 on an AVX-512 Zen 5, 3 of 6 on an AVX2 Zen 3): counted, and
    # the table keeps those tokens apart either way
    assert agreement.first_tokens == 6 and 0 <= agreement.first_equal <= 6
    assert agreement.first_equal <= agreement.equal


def test_exact_head_agrees_on_every_token_with_equal_hidden_states(demo, result):
    for head in ("bf16", "fp32"):
        stats = result.stats("bf16", head, demo.EXACT, demo.EQUAL)
        assert stats.tokens > 0
        assert stats.equal == stats.tokens and stats.max_abs_diff == 0.0
        assert stats.mean_ratio_dev == 0.0 and stats.mean_k3 == 0.0
    assert demo.exact_holds(result)


def test_torch_head_disagrees_on_some_of_those_same_tokens(demo, result):
    # each side's own fp32 matmul: the rollout's rows come 6, 3, 2, 1 at a time, the
    # trainer's 12 at a time on a quarter of the vocabulary, so some logits differ (this
    # depends on the CPU BLAS choosing other kernels for other shapes, as MKL does here)
    logits = result.stats("bf16", "fp32", demo.LOGITS, demo.EQUAL)
    torch_head = result.stats("bf16", "fp32", demo.TORCH, demo.EQUAL)
    assert logits.equal < logits.tokens
    assert 0 < torch_head.tokens and torch_head.equal < torch_head.tokens
    assert torch_head.max_abs_diff > 0.0


def test_the_check_fails_if_the_exact_path_is_the_torch_head(demo, result):
    def as_torch_head(row):
        if row.method != demo.EXACT:
            return row
        return dataclasses.replace(
            row, stats=result.stats(row.body, row.head, demo.TORCH, row.group)
        )

    swapped = dataclasses.replace(result, rows=[as_torch_head(r) for r in result.rows])
    assert not demo.exact_holds(swapped)
    assert "DIFFERS" in demo.format_report(swapped)


def test_the_rollout_scores_are_batch_invariant_only_with_the_exact_head(demo):
    # the rollout's own scorer on the same rows, all at once vs one at a time: the exact
    # head gives the same bits, the torch matmul (fp32) does not, so swapping one for the
    # other in the demo would show on the trainer's side too
    score, _, _ = demo.rollout_scorers(5000)
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(8, 128, generator=gen)
    weight = torch.randn(5000, 128, generator=gen) * 0.2
    tokens = torch.randint(0, 5000, (8,), generator=gen)
    logits, whole = score(hidden, weight, tokens)
    rows = [score(hidden[i : i + 1], weight, tokens[i : i + 1]) for i in range(8)]
    one_by_one = {m: torch.cat([r[1][m] for r in rows]) for m in whole}
    assert torch.equal(whole[demo.EXACT], one_by_one[demo.EXACT])
    assert not torch.equal(logits, torch.cat([r[0] for r in rows]))
    assert not torch.equal(whole[demo.TORCH], one_by_one[demo.TORCH])


def test_statistics_are_consistent(demo, result):
    for r in result.rows:
        s = r.stats
        assert 0 <= s.equal <= s.tokens
        if r.method == demo.LOGITS or s.tokens == 0:
            continue
        if s.equal == s.tokens:  # (+0 vs -0 may differ in bits at diff 0)
            assert s.max_abs_diff == 0.0 and s.mean_k3 == 0.0 and s.max_ratio_dev == 0.0
        assert s.mean_k3 >= 0.0 and s.mean_ratio_dev <= s.max_ratio_dev


def test_trl_absent_is_said_not_hidden(demo, monkeypatch):
    for name in ("trl", "trl.trainer", "trl.trainer.utils"):  # importing them raises ImportError
        monkeypatch.setitem(sys.modules, name, None)
    fn, why = demo.trl_selective_log_softmax()
    assert fn is None and "trl" in why


def test_trl_present_is_scored_on_the_rollout(demo, monkeypatch):
    def selective_log_softmax(logits, index):  # TRL's definition, in torch
        return logits.float().log_softmax(-1).gather(-1, index[..., None]).squeeze(-1)

    utils = types.ModuleType("trl.trainer.utils")
    utils.selective_log_softmax = selective_log_softmax
    for name in ("trl", "trl.trainer"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "trl.trainer.utils", utils)
    score, _, missing = demo.rollout_scorers(5000)
    assert missing is None
    gen = torch.Generator().manual_seed(1)
    hidden, weight = torch.randn(3, 16, generator=gen), torch.randn(5000, 16, generator=gen)
    tokens = torch.tensor([0, 17, 4999])
    logits, out = score(hidden, weight, tokens)
    assert torch.equal(out[demo.TRL], selective_log_softmax(logits, tokens))


def test_processed_run_is_bitwise_on_equal_hidden_states(demo, result):
    assert result.cut_hidden is not None and result.cut_hidden.tokens == result.num_tokens
    p = result.stats("bf16", "bf16", demo.PROCESSED, demo.EQUAL)
    assert p.tokens == result.cut_hidden.equal > 0
    assert p.equal == p.tokens and p.dropped == 0
    assert p.max_abs_diff == 0.0 and p.max_ratio_dev == 0.0  # r = 1 exactly
    logits = result.stats(
        "bf16", "bf16", demo.LOGITS.replace("own torch head", "exact"), demo.EQUAL
    )
    assert logits.equal == logits.tokens == p.tokens
    assert demo.processed_holds(result)
    text = " ".join(demo.format_report(result).split())  # the prose as one line
    assert "top-k 50, top-p 0.9, min-p 0.05" in text and "r = 1" in text


def test_replaying_the_returned_kept_sets_gives_r_1(demo, result):
    """(m): the trainer replays the kept sets the rollout returned (CSR ids, as vLLM's
    --return-sampling-mask gives them) with replay_logprobs on its TP4 shards: the
    rollout's processed logprob bits on every token with equal hidden states."""
    m = result.stats("bf16", "bf16", demo.REPLAY, demo.EQUAL)
    p = result.stats("bf16", "bf16", demo.PROCESSED, demo.EQUAL)
    assert m.tokens == p.tokens > 0 and m.equal == m.tokens and m.dropped == 0
    assert m.max_abs_diff == 0.0 and m.max_ratio_dev == 0.0  # r = 1 exactly
    assert "(m) replay of the rollout's kept sets" in demo.format_report(result)


def test_unnormalised_replay_shows_the_log_s_bias(demo, result):
    # the full-vocabulary log-softmax is log S lower than the processed logprob: on every
    # token with equal hidden states it differs, and |log r| > 0 (S < 1 once the cut bites)
    u = result.stats("bf16", "bf16", demo.UNNORMALISED, demo.EQUAL)
    assert u.tokens > 0 and u.equal == 0
    assert 0.0 < u.mean_abs_diff <= u.max_abs_diff
    assert f"mean |log r| {u.mean_abs_diff:.3g}" in demo.format_report(result)


def test_the_processed_check_fails_if_the_trainer_replays_unnormalised(demo, result):
    def swap(row):
        if row.method not in (demo.PROCESSED, demo.REPLAY):
            return row
        other = result.stats(row.body, row.head, demo.UNNORMALISED, row.group)
        return dataclasses.replace(row, stats=other)

    swapped = dataclasses.replace(result, cut_rows=[swap(r) for r in result.cut_rows])
    assert not demo.processed_holds(swapped)
    assert "(p) DIFFERS" in demo.format_report(swapped)
