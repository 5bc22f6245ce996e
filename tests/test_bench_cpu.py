"""The CPU benchmark runs end to end on a tiny shape (its figures are not checked here)."""

from __future__ import annotations

import json

import pytest

from exactlogp.bench import cpu as bench


def test_bench_main_writes_its_table_and_results(tmp_path):
    pytest.importorskip("megatron.core")
    argv = [
        "--tokens",
        "8",
        "--vocab",
        "512",
        "--repeats",
        "1",
        "--no-memory",
        "--out",
        str(tmp_path),
    ]
    assert bench.main(argv) == 0
    results = json.loads((tmp_path / "cpu_results.json").read_text())
    assert set(results["results"]) == {
        "exactlogp[cpu]", "exactlogp[cpu,entropy]", "exactlogp[cpu,value_tables=never]",
        "megatron_ce", "torch_full[row_block=all]", "torch_compile",
    }  # fmt: skip
    table = (tmp_path / "cpu_main.md").read_text()
    assert "| exactlogp[cpu] |" in table and "megatron_ce" in table


def test_bench_rejects_unknown_candidates(tmp_path):
    with pytest.raises(SystemExit, match="unknown candidate"):
        bench.main(["--candidates", "nope", "--out", str(tmp_path)])


def test_the_recorded_command_names_the_instruction_set_caps(monkeypatch):
    from exactlogp.bench import cpu as bench

    for name in bench.ISA_ENV:
        monkeypatch.delenv(name, raising=False)
    assert bench.recorded_command(["--goals"]) == "exactlogp bench --goals"
    monkeypatch.setenv("EXACTLOGP_CPU_ISA", "avx2")
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    assert bench.recorded_command(["--goals", "--out", "a b"]) == (
        "EXACTLOGP_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 exactlogp bench --goals --out 'a b'"
    )


def test_the_benchmark_modules_run_at_tiny_sizes(tmp_path, capsys):
    """Some of the benchmarks that moved into exactlogp.bench, in this process, on tiny
    shapes: what is checked is that they run and write their tables, not their figures
    (the others spawn processes or compile, too slow for every test run)."""
    from exactlogp.bench import cpu_value_tables, linear_accuracy, linear_cost, row_hash

    assert linear_accuracy.main(["--rows", "3", "--vocab", "50", "--hidden", "64",
                                 "--out", str(tmp_path)]) == 0  # fmt: skip
    text = (tmp_path / "linear_accuracy.md").read_text()
    assert (
        "| bf16, 1000x | exactlogp |" in text and "| fp32, 8x (H/64 channels) | exactlogp |" in text
    )
    assert linear_cost.main(["--rows", "3", "--vocab", "40", "--hidden", "64", "--repeats",
                             "1", "--out", str(tmp_path)]) == 0  # fmt: skip
    assert "| bf16, two channels 100x |" in (tmp_path / "linear_cost.md").read_text()
    cpu_value_tables.main(["--vocab", "300", "--repeats", "1"])
    assert "| bfloat16 | 300 |" in capsys.readouterr().out
    row_hash.main(["--tokens", "4", "--hidden", "8", "--vocab", "16", "--repeats", "1"])
    assert "| row_hash(hidden) |" in capsys.readouterr().out
