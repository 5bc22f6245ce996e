"""The report's JSON schema: what it accepts, what it rejects, and the seed's keys."""

import copy

import jsonschema
import pytest

from exactlogp.report import checks, schema

# every key the seed prior-art report gives a measured candidate
SEED_CANDIDATE_KEYS = {
    "tp4_equals_tp1",
    "nccl_setting_invariant",
    "batch_bitwise",
    "distinct_results_in_repeats",
    "repeats",
    "reference",
    "max_abs_vs_fp64",
    "max_abs_vs",
    "latency_us_tp4",
}
SEED_HEADER_KEYS = {
    "kind",
    "tracked_tree_dirty",
    "environment",
    "third_party",
    "tokens",
    "nccl_settings",
}


def _measured() -> dict:
    lat = {"median": 10.0, "p10": 9.0, "p90": 12.0, "runs": 10}
    batch = {"alone": 0, "sub_batches": 0, "permuted": 0, "among_extra_rows": 0}
    return {
        "summary": "s",
        "implementation": "ours",
        "workload": "logits",
        "tp_measured": [1, 4],
        "tp4_equals_tp1": True,
        "tp_equals_tp1": {"4": True},
        "nccl_setting_invariant": True,
        "nccl_settings_mismatched_rows": {"4": {"as_is": 0}},
        "float_all_reduces_per_call": {"1": 1, "4": 1},
        "batch_bitwise": True,
        "batch_mismatched_rows": {"1": batch, "4": batch},
        "distinct_results_in_repeats": 1,
        "repeats": 10,
        "ranks_agree": True,
        "reference": "shared_logits_fp64",
        "max_abs_vs_fp64": 1e-8,
        "max_ulp_vs_fp64": 0.5,
        "max_abs_vs": {"other": 1e-7},
        "latency_us_tp1": 10.0,
        "latency_us_tp4": 10.0,
        "latency_us": {"1": lat, "4": lat},
        "peak_memory_mib_per_rank": {"1": [1.0], "4": [1.0] * 4},
        "padded_vocab": {"1": 151936, "4": 152064},
    }


def _report() -> dict:
    return {
        "kind": "logprob_conformance",
        "schema_version": 1,
        "contract": "exactlogp-v1",
        "exactlogp_version": "0.1.0",
        "created": "2026-01-01T00:00:00+00:00",
        "command": "x",
        "project_commit": None,
        "tracked_tree_dirty": None,
        "environment": {
            "device": "cpu",
            "torch": "2",
            "collective_backend": "gloo",
            "nccl": None,
            "vllm": None,
            "python": "3.11",
            "cpu_count": 2,
        },
        "third_party": [{"name": "megatron-core", "version": "0.16.1"}],
        "tokens": 1024,
        "vocab": 151936,
        "dtype": "bf16",
        "collective_backend": "gloo",
        "launcher": "spawn",
        "tp": [1, 4],
        "nccl_settings": [{"name": "as_is", "description": "d"}],
        "nccl_settings_emulated": True,
        "workload": {"generator": "g", "seed": 0, "distribution": "d"},
        "reference": {"name": "shared_logits_fp64", "method": "m"},
        "method": {},
        "candidates": {
            "exactlogp": _measured(),
            "miles_fused": {"unavailable": "ModuleNotFoundError: No module named 'miles'"},
        },
        "wall_s": 1.0,
    }


def _with_hidden_states(report: dict) -> dict:
    report["hidden_states"] = {
        "tokens": 128,
        "hidden": 256,
        "vocab": 151936,
        "dtype": "bf16",
        "workload": {"generator": "g", "seed": 0, "distribution": "d"},
        "reference": {"name": "lm_head_fp64", "method": "m"},
        "check_rows": [1, 2],
        "extra_rows": [3, 4],
    }
    fused = {**_measured(), "workload": "hidden_states", "reference": "lm_head_fp64"}
    report["candidates"]["exactlogp_linear"] = fused
    report["candidates"]["verl_fused"] = {
        **fused,
        "implementation": "re-implementation",
        "tp_equals_tp1": {"4": False},
    }
    return report


def test_a_complete_report_validates():
    schema.validate(_report())
    schema.validate(_with_hidden_states(_report()))


def test_the_seed_keys_are_all_there():
    assert SEED_CANDIDATE_KEYS <= set(schema.MEASURED["required"]) | {"latency_us_tp4"}
    assert SEED_HEADER_KEYS <= set(schema.REPORT["required"])


@pytest.mark.parametrize(
    "mutate",
    [
        lambda r: r.pop("nccl_settings"),
        lambda r: r["candidates"]["exactlogp"].pop("batch_bitwise"),
        lambda r: r["candidates"]["exactlogp"].update(tp4_equals_tp1="yes"),
        lambda r: r["candidates"]["exactlogp"].update(reference="fp32"),
        lambda r: r["candidates"]["exactlogp"].update(surprise=1),
        lambda r: r["candidates"]["miles_fused"].update(note="x"),
        lambda r: r["candidates"].update(empty={}),
        lambda r: r.update(collective_backend="mpi"),
        lambda r: r["candidates"]["exactlogp"]["batch_mismatched_rows"]["1"].pop("alone"),
        lambda r: r["candidates"]["exactlogp"].pop("workload"),
        lambda r: r["candidates"]["exactlogp_linear"].update(workload="tokens"),
        lambda r: r["candidates"]["exactlogp_linear"].update(reference="fp64"),
        lambda r: r["hidden_states"].pop("hidden"),
        lambda r: r["hidden_states"]["reference"].update(name="shared_logits_fp64"),
        lambda r: r["hidden_states"].update(surprise=1),
    ],
)
def test_malformed_reports_are_rejected(mutate):
    report = _with_hidden_states(copy.deepcopy(_report()))
    mutate(report)
    with pytest.raises(jsonschema.ValidationError):
        schema.validate(report)


def test_exactlogp_failures_name_each_broken_invariance():
    good = _report()["candidates"]
    assert checks.exactlogp_failures(good) == []
    bad = copy.deepcopy(good)
    bad["exactlogp"].update(
        tp_equals_tp1={"4": False}, batch_bitwise=False, distinct_results_in_repeats=2
    )
    bad["exactlogp"]["errors"] = {"2": "TimeoutError: no result after 8 s; world killed"}
    bad["exactlogp[reference]"] = {"unavailable": "ValueError: no"}
    assert checks.exactlogp_failures(bad) == [
        "exactlogp tp2: TimeoutError: no result after 8 s; world killed",
        "exactlogp: TP4 != TP1",
        "exactlogp: batch_bitwise is false",
        "exactlogp: 2 distinct results",
        "exactlogp[reference]: unavailable: ValueError: no",
    ]
    # peers may fail anything without failing the report
    peers = copy.deepcopy(good)
    peers["megatron_ce"] = {
        **good["exactlogp"],
        "tp4_equals_tp1": False,
        "tp_equals_tp1": {"4": False},
    }
    assert checks.exactlogp_failures(peers) == []
    # the exact LM head's rows are ours too
    fused = _with_hidden_states(_report())["candidates"]
    assert checks.exactlogp_failures(fused) == []
    fused["exactlogp_linear"].update(batch_bitwise=False)
    fused["exactlogp_linear[reference]"] = {**fused["exactlogp_linear"], "batch_bitwise": True}
    fused["exactlogp_linear[reference]"]["bitwise_equal_to_exactlogp"] = False
    assert checks.exactlogp_failures(fused) == [
        "exactlogp_linear: batch_bitwise is false",
        "exactlogp_linear[reference]: differs from the auto backend",
    ]


def test_latency_percentiles():
    lat = checks.latency([0.001 * i for i in range(1, 11)])
    assert lat["runs"] == 10
    assert lat["median"] == pytest.approx(5500.0)
    assert lat["p10"] == pytest.approx(1900.0) and lat["p90"] == pytest.approx(9100.0)


def test_the_console_table_keeps_backend_names_in_brackets():
    import io

    from rich.console import Console

    from exactlogp.report import display

    report = _report()
    report["candidates"]["exactlogp[reference]"] = _measured()
    console = Console(record=True, width=400, file=io.StringIO())
    console.print(display.table(report))
    assert "exactlogp[reference]" in console.export_text()


def test_each_workload_gets_its_own_table_and_findings():
    from exactlogp.report import display

    report = _with_hidden_states(_report())
    assert display.workloads(report) == ["logits", "hidden_states"]
    assert [r[0] for r in display.rows(report)] == ["exactlogp", "miles_fused"]
    assert [r[0] for r in display.rows(report, "hidden_states")] == [
        "exactlogp_linear", "verl_fused"
    ]  # fmt: skip
    prefix = "- invariant on every axis measured (TP, settings, batch, repeats): "
    assert display.findings(report)[0] == prefix + "exactlogp"
    assert display.findings(report, "hidden_states")[0] == prefix + "exactlogp_linear"
    assert display.table(report, "hidden_states").row_count == 2


def test_the_fused_plot_is_a_png_of_the_hidden_state_rows(tmp_path):
    pytest.importorskip("matplotlib")
    from exactlogp.report import plot

    report = _with_hidden_states(_report())
    report["candidates"]["torch_linear"] = {
        **report["candidates"]["verl_fused"],
        "tp_measured": [1],
        "latency_us": {"1": report["candidates"]["verl_fused"]["latency_us"]["1"]},
    }
    assert list(plot.fused_rows(report)) == ["exactlogp_linear", "verl_fused", "torch_linear"]
    path = tmp_path / "r_fused.png"
    assert plot.write_fused_plot(report, str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not plot.write_fused_plot(_report(), str(tmp_path / "none.png"))
    assert not (tmp_path / "none.png").exists()
