"""`exactlogp report --preset quick` end to end through the CLI, and `exactlogp bench`."""

import json
import multiprocessing
import subprocess
import sys

import pytest

from exactlogp import cli
from exactlogp.report import schema


@pytest.fixture(scope="module")
def quick_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("report") / "quick.json"
    status = cli.main(["report", "--preset", "quick", "--out", str(out)])
    return status, out, json.loads(out.read_text())


def test_quick_preset_writes_a_valid_report_and_exits_0(quick_report):
    status, out, report = quick_report
    assert status == 0
    schema.validate(report)
    markdown = out.with_suffix(".md").read_text()
    assert markdown.startswith("# exactlogp conformance report")
    prefix = "- invariant on every axis measured (TP, settings, batch, repeats): "
    line = next(ln for ln in markdown.splitlines() if ln.startswith(prefix))
    invariant = set(line[len(prefix) :].split(", "))
    assert {"exactlogp", "vllm_gather", "rl_kernel_ws2"} <= invariant
    assert not invariant & {"megatron_ce", "vime_default"}
    assert {name for name in invariant if not name.startswith("exactlogp[")} == {
        "exactlogp", "vllm_gather", "rl_kernel_ws2"
    }  # fmt: skip
    assert "\n- smallest error vs fp64: exactlogp (" in markdown
    assert report["tp"] == [1, 2] and report["tokens"] == 48 and report["vocab"] == 2048
    assert report["command"] == f"exactlogp report --preset quick --out {out}"
    assert report["nccl_settings_emulated"] is True
    assert [s["name"] for s in report["nccl_settings"]] == [
        "as_is",
        "ring_from_0",
        "ring_from_1",
        "tree",
        "reversed",
    ]
    assert {"name": "megatron-core", "version": "0.16.1"} in report["third_party"]
    assert multiprocessing.active_children() == []


def test_quick_preset_exactlogp_is_invariant_and_most_accurate(quick_report):
    cands = quick_report[2]["candidates"]
    ours = cands["exactlogp"]
    assert ours["tp_equals_tp1"] == {"2": True}
    assert ours["nccl_setting_invariant"] is True
    assert ours["batch_bitwise"] is True
    assert ours["distinct_results_in_repeats"] == 1 and ours["repeats"] == 10
    assert ours["max_ulp_vs_fp64"] <= 0.5 + 1e-3
    measured = {n: e for n, e in cands.items() if "unavailable" not in e}
    logits_rows = {n: e for n, e in measured.items() if e["workload"] == "logits"}
    assert all(ours["max_abs_vs_fp64"] <= e["max_abs_vs_fp64"] for e in logits_rows.values())


def test_quick_preset_reproduces_the_prior_art_truth_table(quick_report):
    cands = quick_report[2]["candidates"]
    assert cands["megatron_ce"]["tp_equals_tp1"] == {"2": False}
    assert cands["vime_default"]["tp_equals_tp1"] == {"2": False}
    assert cands["vllm_gather"]["tp_equals_tp1"] == {"2": True}
    assert cands["rl_kernel_ws2"]["tp_equals_tp1"] == {"2": True}
    # the re-implemented vime math is Megatron's, bit for bit (as in the seed report)
    assert cands["megatron_ce"]["max_abs_vs"]["vime_default"] == 0.0
    assert cands["torch_full"]["tp_measured"] == [1]


FUSED_ROWS = [
    "exactlogp_linear",
    "exactlogp_linear[reference]",
    "verl_fused",
    "miles_fused",
    "torch_linear",
]


def test_quick_preset_measures_the_fused_lm_head_rows(quick_report):
    _, out, report = quick_report
    cands = report["candidates"]
    fused = [n for n, e in cands.items() if e.get("workload") == "hidden_states"]
    assert fused == FUSED_ROWS and all("errors" not in cands[n] for n in fused)
    assert report["hidden_states"]["tokens"] == 48 and report["hidden_states"]["hidden"] == 128
    assert {cands[n]["reference"] for n in fused} == {"lm_head_fp64"}
    assert cands["torch_linear"]["tp_measured"] == [1]
    assert cands["verl_fused"]["implementation"] == "re-implementation"
    assert cands["miles_fused"]["float_all_reduces_per_call"]["2"] == 2
    # the exact LM head: the TP1 bits at TP2, in every batch, order and setting, repeat
    # after repeat, whatever the backend -- and within the 1e-4 of the fp64 truth
    ours = cands["exactlogp_linear"]
    assert ours["tp_equals_tp1"] == {"2": True}
    assert ours["nccl_setting_invariant"] is True and ours["batch_bitwise"] is True
    assert ours["distinct_results_in_repeats"] == 1 and ours["ranks_agree"] is True
    assert ours["float_all_reduces_per_call"] == {"1": 0, "2": 1}  # the MAX; no float SUM
    assert cands["exactlogp_linear[reference]"]["bitwise_equal_to_exactlogp"] is True
    assert ours["max_abs_vs_fp64"] < 1e-4
    assert all(ours["max_abs_vs_fp64"] <= cands[n]["max_abs_vs_fp64"] for n in fused)
    # the pipelines that round the logits to bf16 are off by far more
    for name in ("miles_fused", "torch_linear"):
        assert cands[name]["max_abs_vs_fp64"] > 1e-3, name
    # the plot and the Markdown section next to the JSON
    png = out.with_name(out.stem + "_fused.png")
    assert png.read_bytes()[:4] == b"\x89PNG"
    markdown = out.with_suffix(".md").read_text()
    assert f"![latency and error vs fp64 of the fused LM-head rows]({png.name})" in markdown
    section = markdown.split("## Fused LM head: from hidden states")[1]
    assert all(f"| {name} |" in section for name in FUSED_ROWS)


def test_bad_option_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["report", "--tp", "0"])
    assert exc.value.code == 2
    assert "positive ints" in capsys.readouterr().err


def test_bench_without_its_module_exits_2(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "exactlogp.bench.cpu", None)
    assert cli.main(["bench", "--rows", "4"]) == 2
    assert "CPU benchmark module is not available" in capsys.readouterr().err


def test_bench_passes_its_arguments_through(monkeypatch):
    import types

    seen = []
    fake = types.ModuleType("exactlogp.bench.cpu")
    fake.main = lambda argv: seen.append(argv) or 0
    monkeypatch.setitem(sys.modules, "exactlogp.bench.cpu", fake)
    assert cli.main(["bench", "--rows", "4", "x"]) == 0
    assert seen == [["--rows", "4", "x"]]


def test_python_dash_m_shows_help():
    out = subprocess.run(
        [sys.executable, "-m", "exactlogp", "report", "--help"], capture_output=True, text=True
    )
    assert out.returncode == 0 and "--preset" in out.stdout


def test_quick_preset_has_the_processed_logprobs_table(quick_report):
    _, out, report = quick_report
    p = report["processed"]
    assert (p["tokens"], p["vocab"], p["tp"]) == (48, 2048, 2)
    ours = p["rows"]["exactlogp"]
    assert ours["cut_tp_equals_tp1"] is True and ours["logprobs_tp_equals_tp1"] is True
    assert ours["batch_bitwise"] is True and ours["distinct_results_in_repeats"] == 1
    assert ours["rows_cut_differs_from_truth"] == 0 and ours["dropped_targets"] == 0
    vllm = p["rows"]["vllm_topk_topp"]
    if vllm["implementation"].startswith("vLLM's own"):  # make setup's vLLM 0.34, at TP 1
        assert vllm["cut_tp_equals_tp1"] is None
    else:  # the re-implementation gathers the rows in the TP world
        assert vllm["cut_tp_equals_tp1"] is True
    assert vllm["batch_bitwise"] is True and vllm["distinct_results_in_repeats"] == 1
    trl = p["rows"]["trl_unnormalised"]
    assert trl["mean_abs_log_ratio_vs_fp64"] > 100 * ours["mean_abs_log_ratio_vs_fp64"]
    assert "## Processed logprobs: 48 x 2048 bf16" in out.with_suffix(".md").read_text()


def test_the_hidden_state_workload_takes_outlier_channels():
    """`--hidden-outlier 100`: two hidden-state channels 100x the rest (the rows where
    contract v1's logits were not exact), in the workload and its description."""
    import torch

    from exactlogp.report import runner, workload

    args = cli.build_parser().parse_args(["report", "--hidden-outlier", "100"])
    assert args.hidden_outlier == 100.0
    spec = workload.HiddenWorkload(8, 256, 64, "bf16", 0, args.hidden_outlier)
    hidden, _, _ = workload.generate_hidden(spec)
    col = hidden.float().abs().amax(0)
    assert (col > 30 * col.median()).sum() == 2
    assert "two channels 100x the rest" in spec.describe()["distribution"]
    with pytest.raises(ValueError, match="hidden_outlier must be a finite number >= 0"):
        runner._check_options(runner.ReportOptions(hidden_outlier=-1.0))
    assert torch.equal(workload.generate_hidden(workload.HiddenWorkload(8, 256, 64, "bf16"))[0],
                       workload.generate_hidden(workload.HiddenWorkload(8, 256, 64, "bf16", 0, 0.0))[0])  # fmt: skip
