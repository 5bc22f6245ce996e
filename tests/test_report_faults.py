"""A crashing or hanging candidate is reported with its error, never hangs the report and
never stops the candidates after it; no process outlives the report."""

import multiprocessing
import time

from exactlogp.report import runner

FAULTS = "report_fault_candidates"


def test_crash_exit_and_hang_are_reported_and_the_rest_still_runs():
    opts = runner.make_options(
        tokens=16,
        vocab=256,
        tp=(2,),
        repeats=2,
        check_rows=4,
        timeout_s=4.0,
        candidates=(
            f"{FAULTS}:RaiseOnRank1",
            f"{FAULTS}:ExitOnRank1",
            "vllm_gather",
            f"{FAULTS}:HangOnRank0",
        ),
        command="test",
    )
    start = time.monotonic()
    report, status = runner.run(opts)
    elapsed = time.monotonic() - start
    cands = report["candidates"]

    raised = cands[f"{FAULTS}:RaiseOnRank1"]
    assert raised["tp_measured"] == []
    assert "RuntimeError: deliberate failure on rank 1" in raised["errors"]["2"]
    assert "deliberate failure" in raised["tracebacks"]["2"]

    exited = cands[f"{FAULTS}:ExitOnRank1"]
    assert exited["errors"]["2"] == "rank 1 died with exit code 3"

    hung = cands[f"{FAULTS}:HangOnRank0"]
    assert hung["errors"]["2"].startswith("TimeoutError: no result after 4 s")

    good = cands["vllm_gather"]
    assert good["tp_measured"] == [2] and "errors" not in good
    assert good["batch_bitwise"] is True and good["distinct_results_in_repeats"] == 1

    assert status == 0  # exactlogp was not asked for, so nothing of ours failed
    assert elapsed < 120, elapsed
    assert multiprocessing.active_children() == []
