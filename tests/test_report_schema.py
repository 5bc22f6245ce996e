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


def test_a_complete_report_validates():
    schema.validate(_report())


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
    ],
)
def test_malformed_reports_are_rejected(mutate):
    report = copy.deepcopy(_report())
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
