"""How the harness measures time and memory: one method for the report, the bench and the
GPU check.

Time: `interleaved` runs every step once per round for as many rounds as asked, in an
order shuffled per round by a seeded generator (the same order on every rank of a
world). Drift on a shared machine (a neighbour's job, clock boost, page cache) then
reaches every step alike; a fixed order or rotation puts each step after the same
neighbour and can bias a ratio. A clock times one run: `WallClock` (perf_counter, the
device synchronised before it stops) or `CudaEventClock` (CUDA events, L2 flushed
before each run so that every run reads its inputs from memory). `Timing` keeps the
median, min, max, p10 and p90 of the runs.

Memory: `PeakMemory` is the peak extra memory since it was made: the CUDA allocator's
peak, or on CPU the resident-set peak (VmHWM, reset through /proc/self/clear_refs)
minus the resident set at the start. torch's tensors live outside Python's heap, so
tracemalloc would see nothing.
"""

from __future__ import annotations

import gc
import random
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass

import torch

MODES = ("forward", "forward_backward")


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between the closest ranks, q in [0, 100]."""
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass(frozen=True)
class Timing:
    """Seconds over the timed runs of one step."""

    median: float
    low: float
    high: float
    p10: float
    p90: float
    runs: int

    @classmethod
    def of(cls, seconds: list[float]) -> Timing:
        return cls(
            percentile(seconds, 50),
            min(seconds),
            max(seconds),
            percentile(seconds, 10),
            percentile(seconds, 90),
            len(seconds),
        )


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class WallClock:
    """Wall seconds of one run, the device's queue drained before the clock stops."""

    def __init__(self, device: torch.device):
        self.device = device

    def __call__(self, fn: Callable[[], object]) -> tuple[float, object]:
        start = time.perf_counter()
        out = fn()
        sync(self.device)
        return time.perf_counter() - start, out


class CudaEventClock:
    """GPU seconds of one run between two CUDA events, L2 flushed before it."""

    FLUSH_BYTES = 256 << 20  # above any L2 (60 MB on an H200)

    def __init__(self, device: torch.device):
        self.flush = torch.empty(self.FLUSH_BYTES, dtype=torch.uint8, device=device)

    def __call__(self, fn: Callable[[], object]) -> tuple[float, object]:
        self.flush.zero_()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = fn()
        stop.record()
        stop.synchronize()
        return start.elapsed_time(stop) * 1e-3, out


def interleaved(
    steps: dict[Hashable, Callable[[], object]],
    runs: int | dict[Hashable, int],
    *,
    seed: int = 0,
    warmup: int = 0,
    clock: Callable | None = None,
    before: Callable[[], None] | None = None,
    on_run: Callable[[Hashable, object], None] | None = None,
) -> dict[Hashable, list[float]]:
    """{step: seconds of each timed run}.

    `warmup` untimed runs of every step first, in order; then rounds in which every step
    that has runs left (`runs`, or `runs[step]`) runs once, in an order shuffled per round
    by random.Random(seed). `before()` runs before each timed run, outside the clock (a
    barrier, say); `on_run(step, output)` after it (a hash, say). Garbage is collected
    before every run, so a step does not pay for the previous one's outputs; the objects
    that exist after the warm-up are frozen first (gc.freeze), so that collection looks
    at the new objects only (a full collection with torch loaded takes ~0.1-0.2 s, which
    would dominate a round of small steps and evict their caches).
    """
    clock = clock or WallClock(torch.device("cpu"))
    counts = {key: runs if isinstance(runs, int) else runs[key] for key in steps}
    for _ in range(warmup):
        for fn in steps.values():
            fn()
    order = random.Random(seed)
    seconds: dict[Hashable, list[float]] = {key: [] for key in steps}
    gc.collect()
    gc.freeze()
    try:
        for r in range(max(counts.values(), default=0)):
            keys = [key for key in steps if counts[key] > r]
            order.shuffle(keys)
            for key in keys:
                gc.collect()
                if before is not None:
                    before()
                elapsed, out = clock(steps[key])
                seconds[key].append(elapsed)
                if on_run is not None:
                    on_run(key, out)
                del out
    finally:
        gc.unfreeze()
    return seconds


class PeakMemory:
    """Peak extra memory of this process from construction to read(), in MiB."""

    def __init__(self, device: torch.device):
        self.device = device
        gc.collect()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            self.base = torch.cuda.memory_allocated(device)
        else:
            _reset_hwm()
            self.base = _proc_status_kib("VmRSS")

    def read(self) -> float | None:
        if self.device.type == "cuda":
            return (torch.cuda.max_memory_allocated(self.device) - self.base) / 2**20
        peak = _proc_status_kib("VmHWM")
        if peak is None or self.base is None:
            return None
        return (peak - self.base) / 1024


def _reset_hwm() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := the current resident set
    except OSError:
        pass  # then VmHWM is the process's lifetime peak, an upper bound


def _proc_status_kib(key: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None
