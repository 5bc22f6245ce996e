"""examples/train_rollout_parity.py at a small size: the demo runs and its numbers hold.

The sampled batch is 2 sequences x 4 tokens on a 2-layer Qwen3-Next model with the real
151936-token vocabulary; the trainer is a real gloo TP=4 world with megatron-core.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
SMALL = ["--batch", "2", "--prompt-len", "4", "--new-tokens", "4", "--layers", "2"]


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


def test_report_names_every_method(demo, result, capsys):
    text = demo.format_report(result)
    assert "LM-head logits, trainer shards vs rollout's full matmul" in text
    rows = [line.strip() for line in text.splitlines() if line.startswith("  ")]
    for method in demo.METHODS:
        assert sum(row.startswith(method) for row in rows) == 2  # one row in each table
    assert f"{result.num_tokens} tokens" in text and result.num_tokens == 8
    assert result.padded_vocab == 152064


def test_exactlogp_alone_is_tp_invariant(result):
    stats = result.tp_invariance["exactlogp"]
    assert stats.equal == stats.total and stats.max_abs_diff == 0.0


def test_gathering_the_whole_row_is_tp_invariant(demo, result):
    # all_gather moves bits without arithmetic, so the gathered row is the rollout's row
    stats = result.tp_invariance[demo.GATHER]
    assert stats.equal == stats.total


def test_exactlogp_matches_the_rollout_whenever_the_logits_do(result):
    stats = result.vs_rollout["exactlogp"]
    if result.logits_equal_columns == 151936:
        assert stats.equal == stats.total
    else:  # the report must then say why, and the logits differ somewhere
        assert result.logits_mismatched_elements > 0


def test_statistics_are_consistent(result):
    for table in (result.vs_rollout, result.tp_invariance):
        for stats in table.values():
            assert stats.total == result.num_tokens
            if stats.equal == stats.total:  # (+0 vs -0 may differ in bits at diff 0)
                assert stats.max_abs_diff == 0.0 and stats.mean_k3 == 0.0
            assert stats.mean_k3 >= 0.0
