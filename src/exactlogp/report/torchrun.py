"""The report inside a torchrun world: every rank runs this; rank 0 writes the report.

TP groups are consecutive blocks of ranks (the other blocks compute the same thing, as
data-parallel replicas); TP degrees that do not divide the world are skipped. Collective
settings cannot change inside one world, so on NCCL only the launch environment's
setting is measured; on gloo the emulated orders apply as usual. A candidate that
fails on one rank leaves the others waiting until the process-group timeout (--timeout).
"""

from __future__ import annotations

import datetime
import os
import tempfile
import time

import torch

from . import candidates, emulation
from .assemble import assemble, exit_status
from .job import run_job
from .session import Session


def run_torchrun(opts, device: torch.device, display, null_display) -> tuple[dict | None, int]:
    import torch.distributed as dist

    backend = "nccl" if device.type == "cuda" else "gloo"
    if not dist.is_initialized():
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=opts.timeout_s))
    rank, world = dist.get_rank(), dist.get_world_size()
    tps = [tp for tp in sorted(set(opts.tp)) if world % tp == 0] or [1]
    threads = opts.threads_per_rank
    s = Session(
        opts, device, backend, "torchrun", tps, world, dict.fromkeys(tps, threads), time.monotonic()
    )
    shown = display if rank == 0 else null_display
    s.choose_rows()
    with tempfile.TemporaryDirectory(prefix=f"exactlogp-report-r{rank}-") as tmp:
        s.prepare(tmp, shown, reference=rank == 0)  # every rank: the same seeded workload
        for tp in tps:
            blocks = [dist.new_group(list(range(b, b + tp))) for b in range(0, world, tp)]
            _measure_tp(s, tp, blocks[rank // tp], shown)
    if rank != 0:
        return None, 0
    if backend == "gloo":
        s.settings = emulation.emulated_settings(max(tps))
    else:
        env = tuple((k, os.environ.get(k)) for k in emulation.NCCL_KNOBS)
        s.settings = [emulation.Setting("launch_environment", "as torchrun was started", env)]
    report = assemble(s)
    return report, exit_status(report)


def _measure_tp(s: Session, tp: int, group, shown) -> None:
    got, passed = {}, []  # got: rank 0's results; passed: the same on every rank
    for name in s.applicable(tp):
        try:  # on every rank, so that all ranks drop the same candidates
            candidates.create(name).check_available(s.device)
        except candidates.Unavailable as exc:
            got[name] = {"unavailable": str(exc)}
            continue
        job = s.job([name], tp)
        task = shown.start(f"{name} TP{tp}", job.steps(name))
        if _run(group, job, task, shown, got):
            passed.append(name)
        shown.finish(task, got.get(name, {}).get("error", "done"))
    if passed:
        timing = s.job(passed, tp, kind="timing")
        task = shown.start(f"timing TP{tp}, interleaved", timing.timing_steps())
        timed: dict = {}
        _run(group, timing, task, shown, timed)
        shown.finish(task, "done")
        got = s.with_timing(got, timed)
    s.record(tp, got)


def _run(group, job, task, shown, got: dict) -> bool:
    """run_job; False, and the error for every candidate without a result, if it raised."""
    try:
        run_job(group, job, lambda _n, d, w: shown.advance(task, d, w), got.__setitem__)
    except Exception as exc:
        for name in job.candidates:
            got.setdefault(name, {"error": f"{type(exc).__name__}: {exc}"})
        return False
    return True
