"""Timing (alternating, in one process) and peak memory (one fresh process per run).

Timing: every repeat runs each candidate once, in an order that rotates between repeats,
so that drift on a shared machine hits every candidate alike; medians, min and max.

Memory: torch's tensors live outside Python's heap (tracemalloc sees nothing), so a child
process builds the inputs, runs one warm-up step, resets the kernel's peak-RSS counter
(`/proc/self/clear_refs`), runs the step once more and reports VmHWM minus the RSS
before the step: the extra memory the step needed, inputs excluded, outputs included.
The child's malloc maps every block of 64 KiB or more on its own (MALLOC_MMAP_THRESHOLD_),
so memory the warm-up freed is given back and counted again instead of being reused.
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

MODES = ("forward", "forward_backward")


@dataclass(frozen=True)
class Timing:
    median: float
    low: float
    high: float
    runs: int

    @classmethod
    def of(cls, seconds: list[float]) -> Timing:
        return cls(statistics.median(seconds), min(seconds), max(seconds), len(seconds))


def time_alternating(candidates, x, target, repeats: int) -> dict[tuple[str, str], Timing]:
    """{(candidate, mode): Timing} after one untimed warm-up of each."""
    for cand in candidates:
        for mode in MODES:
            getattr(cand, mode)(x, target)
    seconds: dict[tuple[str, str], list[float]] = {}
    for rep in range(repeats):
        shift = rep % len(candidates)
        for cand in candidates[shift:] + candidates[:shift]:
            for mode in MODES:
                gc.collect()
                start = time.perf_counter()
                out = getattr(cand, mode)(x, target)
                seconds.setdefault((cand.name, mode), []).append(time.perf_counter() - start)
                del out
    return {key: Timing.of(v) for key, v in seconds.items()}


# --- peak memory in a child process ---


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise OSError(f"/proc/self/status has no {field}")


def step_peak_mib(step) -> float:
    """Peak RSS added by step() in this process, MiB (Linux only)."""
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    before = _status_kib("VmRSS")
    out = step()
    peak = _status_kib("VmHWM")
    del out
    return (peak - before) / 1024.0


def child_peak_mib(candidate: str, mode: str, args: list[str]) -> float | None:
    """Run one measurement in a fresh interpreter; None if it could not be measured."""
    cmd = [sys.executable, "-m", "exactlogp.bench.cpu", *args, "--measure-memory", candidate, mode]
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    run = subprocess.run(cmd, capture_output=True, text=True, env=env)
    for line in reversed(run.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)["peak_mib"]
    return None
