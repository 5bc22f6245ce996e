"""What runs inside one torch.distributed world: every measurement of the candidates
named in a Job, on this rank's shard of the shared logits.

Per candidate (all ranks issue the same calls, so collectives stay matched):
  1. build it on this rank's shard
  2. warm-up run on all rows: its output is the candidate's result at this TP
  3. `repeats` timed runs on all rows (fewer where the candidate caps them): barrier,
     run, (CUDA sync); per run the slowest rank's time; the SHA-256 of every output;
     peak memory of steps 2-3 per rank
  4. batch checks on the check rows: each row alone, consecutive sub-batches of
     1, 2, 3, 5, 8, ... rows, the rows permuted, the rows shuffled among as many
     other rows; each compared bit for bit with step 2's rows
  5. collective settings on the check rows (gloo: emulated orders, see emulation.py)
Rank 0 returns the results; a settings-only job (a fresh NCCL world per setting)
runs just the check rows.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..testing import sha256
from . import candidates, emulation, workload

SUB_BATCH_SIZES = (1, 2, 3, 5, 8, 13, 21, 34, 55, 89)


@dataclass(frozen=True)
class Job:
    candidates: tuple[str, ...]
    data_path: str
    vocab: int
    tp: int
    repeats: int
    check_rows: tuple[int, ...]
    extra_rows: tuple[int, ...]
    threads: int = 1
    full: bool = True  # False: only the check rows, for a fresh world per NCCL setting
    emulate: bool = False  # replay emulated reduction orders (gloo, tp > 1)
    seed: int = 0

    def timed_runs(self, name: str) -> int:
        cap = candidates.create(name).max_timed_runs
        return self.repeats if cap is None else min(self.repeats, cap)

    def steps(self, name: str) -> int:
        """Progress steps of one candidate."""
        if not self.full:
            return 2
        settings = len(emulation.emulated_settings(self.tp)) if self.emulate else 0
        return 2 + self.timed_runs(name) + 4 + settings


Progress = Callable[[str, int, str], None]  # (candidate, steps done, what)
Sink = Callable[[str, dict], None]  # (candidate, its result), called on rank 0


def run_job(group, job: Job, progress: Progress | None = None, sink: Sink | None = None) -> None:
    """Measure the candidates of `job` in order in this world; an exception ends the job
    (the other ranks may be waiting in a collective of the failed candidate)."""
    import torch.distributed as dist

    torch.set_num_threads(job.threads)
    rank = dist.get_rank(group)
    device = _device()
    quiet = lambda *args: None  # noqa: E731
    report = progress if rank == 0 and progress else quiet
    for name in job.candidates:
        result = _measure(name, job, group, rank, device, report)
        if rank == 0 and sink:
            sink(name, result)


def _device() -> torch.device:
    if torch.cuda.is_available() and os.environ.get("EXACTLOGP_REPORT_DEVICE") == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _measure(name, job: Job, group, rank, device, report) -> dict:
    report(name, 0, "loading")
    start = time.perf_counter()
    cand = candidates.create(name)
    try:
        # every rank fails the same way here, so the world can go on to the next candidate
        cand.check_available(device)
    except candidates.Unavailable as exc:
        return {"unavailable": str(exc)}
    padded = cand.padded_vocab(job.vocab, job.tp)
    width = padded // job.tp
    logits, target = workload.load_shard(job.data_path, rank * width, width, job.vocab)
    logits, target = logits.to(device), target.to(device)
    ctx = candidates.ShardContext(rank, job.tp, group, device, job.vocab, padded, rank * width)
    done = [0]

    def step(what: str) -> None:
        done[0] += 1
        report(name, done[0], what)

    rows = torch.tensor(job.check_rows, dtype=torch.int64, device=device)
    try:
        fn = cand.build(ctx)
        step("built")
        with torch.no_grad():
            if not job.full:
                out = fn(logits[rows], target[rows])
                step("settings run")
                return {"check_rows_out": out.cpu()}
            result = _main_runs(name, fn, logits, target, group, job, device, step)
            expect = result["out"].to(device)[rows]
            result["batch"] = _batch_checks(fn, logits, target, rows, expect, job, step)
            if job.emulate:
                result["settings"] = _settings_checks(fn, logits, target, rows, job, step)
            else:
                with emulation.emulate(None) as counter:
                    fn(logits[rows[:1]], target[rows[:1]])
                result["float_all_reduces_per_call"] = counter.count
            result["padded_vocab"] = padded
            result["wall_s"] = time.perf_counter() - start
            return result
    finally:
        cand.teardown()


def _main_runs(name, fn, logits, target, group, job: Job, device, step) -> dict:
    import torch.distributed as dist

    memory = PeakMemory(device)
    dist.barrier(group=group)
    out = fn(logits, target)  # warm-up; its output is the result
    _sync(device)
    step("warm-up")
    hashes, times = [sha256(out)], []
    runs = job.timed_runs(name)
    for i in range(runs):
        dist.barrier(group=group)
        t0 = time.perf_counter()
        again = fn(logits, target)
        _sync(device)
        times.append(time.perf_counter() - t0)
        hashes.append(sha256(again))
        step(f"timed run {i + 1}/{runs}")
    peak = memory.read()
    per_rank = [None] * dist.get_world_size(group)
    dist.all_gather_object(per_rank, (times, peak, hashes[0]), group=group)
    slowest = [max(t[i] for t, _, _ in per_rank) for i in range(runs)]
    return {
        "out": out.detach().to(torch.float32).cpu(),
        "hashes": hashes,
        "times_s": slowest,
        "peak_memory_mib_per_rank": [p for _, p, _ in per_rank],
        "ranks_agree": len({h for _, _, h in per_rank}) == 1,
    }


def _batch_checks(fn, logits, target, rows, expect, job: Job, step) -> dict:
    gen = torch.Generator().manual_seed(job.seed + 2)
    n = rows.numel()

    def run(idx):
        return fn(logits[idx], target[idx])

    alone = torch.cat([run(rows[i : i + 1]) for i in range(n)])
    step("rows alone")
    pieces, start = [], 0
    for size in _cycle(SUB_BATCH_SIZES):
        if start >= n:
            break
        pieces.append(run(rows[start : start + size]))
        start += size
    sub = torch.cat(pieces)
    step("sub-batches")
    perm = torch.randperm(n, generator=gen).to(rows.device)
    permuted = torch.empty_like(expect)
    permuted[perm] = run(rows[perm])
    step("permuted")
    extra = torch.tensor(job.extra_rows, dtype=torch.int64, device=rows.device)
    mixed_idx = torch.cat((rows, extra))
    shuffle = torch.randperm(mixed_idx.numel(), generator=gen).to(rows.device)
    mixed_out = torch.empty(mixed_idx.numel(), dtype=expect.dtype, device=expect.device)
    mixed_out[shuffle] = run(mixed_idx[shuffle])
    step("among extra rows")
    variants = {
        "alone": alone,
        "sub_batches": sub,
        "permuted": permuted,
        "among_extra_rows": mixed_out[:n],
    }
    return {k: _mismatches(v, expect) for k, v in variants.items()}


def _settings_checks(fn, logits, target, rows, job: Job, step) -> dict:
    outs, counts = {}, {}
    for setting in emulation.emulated_settings(job.tp):
        with emulation.emulate(setting) as counter:
            outs[setting.name] = fn(logits[rows], target[rows])
        counts[setting.name] = counter.count
        step(setting.name)
    base = outs["as_is"]
    return {
        "mismatched_rows": {k: _mismatches(v, base) for k, v in outs.items()},
        "float_all_reduces_per_call": counts["as_is"],
    }


def _mismatches(actual: torch.Tensor, expected: torch.Tensor) -> int:
    """Rows whose fp32 bits differ."""
    a = actual.detach().to(torch.float32).contiguous().view(torch.int32)
    b = expected.detach().to(torch.float32).contiguous().view(torch.int32)
    return int((a != b).sum())


def _cycle(values):
    while True:
        yield from values


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class PeakMemory:
    """Peak extra memory of this rank from construction to read(), in MiB.

    CUDA: the allocator's peak. CPU: the peak resident set (VmHWM, reset through
    /proc/self/clear_refs) minus the resident set at the start.
    """

    def __init__(self, device: torch.device):
        self.device = device
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
            f.write("5")
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
