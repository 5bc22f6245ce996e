"""The report's processed-logprobs table (exactlogp.report.processed) at a tiny size, at
TP 1 (its TP 2 world runs in the quick report, tests/test_report_cli.py): the real TRL
function, the fp64 truth, the schema and the Markdown."""

from __future__ import annotations

import copy
import math
import sys

import pytest
import torch

from exactlogp.report import display, processed, schema
from exactlogp.testing import llm_like_logits


@pytest.fixture(scope="module")
def table():
    # the re-implementation of vLLM's cut (vLLM's own, from <venv>/hosts, runs in the quick
    # report: tests/test_report_cli.py)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(processed, "vllm_host", lambda: None)
        return processed.measure(tokens=8, vocab=256, dtype="bf16", tp=1, repeats=2, check_rows=4)


def test_exactlogp_row_is_invariant_and_matches_the_fp64_cut(table):
    e = table["rows"]["exactlogp"]
    assert e["cut_tp_equals_tp1"] is None  # TP 1 only here
    assert e["batch_bitwise"] is True and e["distinct_results_in_repeats"] == 1
    assert e["rows_cut_differs_from_truth"] == 0 and e["dropped_targets"] == 0
    assert e["max_abs_vs_fp64"] < 1e-6
    assert processed.failures(table) == []
    broken = copy.deepcopy(table)
    broken["rows"]["exactlogp"]["cut_tp_equals_tp1"] = False
    broken["rows"]["exactlogp"]["distinct_results_in_repeats"] = 2
    assert processed.failures(broken) == [
        "processed: exactlogp fails cut_tp_equals_tp1",
        "processed: exactlogp fails repeats",
    ]


def test_unnormalised_replay_carries_the_log_s_bias(table):
    trl = table["rows"]["trl_unnormalised"]
    assert trl["cut_tp_equals_tp1"] is None  # TRL does not split the vocabulary
    assert trl["rows_cut_differs_from_truth"] == table["rows_in_workload_cut_by_truth"] > 0
    assert trl["mean_abs_log_ratio_vs_fp64"] > 100 * table["rows"]["exactlogp"]["max_abs_vs_fp64"]
    vllm = table["rows"]["vllm_topk_topp"]
    assert "re-implementation" in vllm["implementation"] or "vLLM's own" in vllm["implementation"]
    assert vllm["rows_cut_differs_from_truth"] == 0 and vllm["batch_bitwise"] is True


def test_schema_and_markdown(table):
    import jsonschema

    jsonschema.validate(table, schema.PROCESSED, cls=jsonschema.Draft202012Validator)
    lines = display._processed_section(table)
    text = "\n".join(lines)
    assert "top-k 50, top-p 0.9" in text and "| exactlogp |" in text
    assert "cut TP1 == TP1" in text
    bad = copy.deepcopy(table)
    bad["rows"]["exactlogp"]["dropped_targets"] = -1
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema.PROCESSED, cls=jsonschema.Draft202012Validator)


def test_fp64_truth_keeps_ties_and_follows_the_order():
    x = torch.tensor([[4.0, 4.0, 3.0, 1.0, -2.0, -30.0]])
    keep = processed.truth_keep(x, temperature=1.0, top_k=1, top_p=1.0, min_p=0.0)
    assert keep.tolist() == [[True, True, False, False, False, False]]  # ties at the k-th
    keep = processed.truth_keep(x, temperature=1.0, top_k=0, top_p=1.0, min_p=0.05)
    p = torch.softmax(x.double(), -1)
    assert torch.equal(keep, p >= 0.05 * p.max())
    keep = processed.truth_keep(x, temperature=1.0, top_k=0, top_p=0.5, min_p=0.0)
    assert keep.tolist() == [[True, True, False, False, False, False]]
    # the cut rows' truth against exactlogp's cut on a real-looking workload
    from exactlogp import sampling_mask

    logits, _ = llm_like_logits(16, 300, torch.bfloat16, seed=3)
    kw = {"temperature": 0.8, "top_k": 50, "top_p": 0.9, "min_p": 0.05}
    assert torch.equal(processed.truth_keep(logits, **kw), sampling_mask(logits, **kw).keep_mask)


def test_trl_absent_is_an_unavailable_row(monkeypatch):
    monkeypatch.setattr(processed, "vllm_host", lambda: None)
    for name in ("trl", "trl.trainer", "trl.trainer.utils"):
        monkeypatch.setitem(sys.modules, name, None)
    out = processed.measure(tokens=4, vocab=64, dtype="fp32", tp=1, repeats=1, check_rows=2)
    assert "unavailable" in out["rows"]["trl_unnormalised"]
    assert not math.isnan(out["rows"]["exactlogp"]["max_abs_vs_fp64"])
