"""Real torch.distributed worlds for the report.

`run_candidates` measures a list of candidates at one TP degree in as few spawned worlds
as possible (gloo on CPU; NCCL with one GPU per rank), each candidate bounded by its own
timeout. Rank 0 writes each candidate's result to a file as soon as it is done and its
progress to another small file the parent polls (so a killed process never leaves a lock
behind). When a candidate crashes or hangs, the parent kills the whole world, records the
error (or the timeout) for that candidate and starts a fresh world for the candidates
after it: one bad candidate never stops the others, and no process outlives the call.
"""

from __future__ import annotations

import datetime
import os
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from .job import Job, run_job

POLL_S = 0.2
FAILURE_GRACE_S = 1.0
STARTUP_S = 300.0  # spawning a world and joining its process group, on a busy machine
Progress = Callable[[str, int, str], None]


@dataclass
class WorldOutcome:
    results: dict  # candidate -> result, for every candidate that finished
    failed: str | None = None  # the candidate that was running when the world failed
    error: str | None = None  # one line
    traceback: str | None = None


def run_candidates(
    job: Job,
    *,
    backend: str,
    timeout: float,
    env: dict | None = None,
    on_start: Callable[[str], None] | None = None,
    on_progress: Progress | None = None,
) -> dict:
    """{candidate: result or {"error", "traceback"?}} for every candidate of `job`."""
    results: dict = {}
    remaining = list(job.candidates)
    while remaining:
        outcome = spawn_world(
            replace(job, candidates=tuple(remaining)),
            backend=backend,
            timeout=timeout,
            env=env,
            on_start=on_start,
            on_progress=on_progress,
        )
        results.update(outcome.results)
        if outcome.error is not None:
            failed = outcome.failed
            if failed is None or failed in results:  # it failed between two candidates
                failed = next(n for n in remaining if n not in results)
            results[failed] = {"error": outcome.error}
            if outcome.traceback:
                results[failed]["traceback"] = outcome.traceback[-4000:]
        remaining = [n for n in remaining if n not in results]
    return results


def spawn_world(
    job: Job,
    *,
    backend: str,
    timeout: float,
    env: dict | None = None,
    on_start: Callable[[str], None] | None = None,
    on_progress: Progress | None = None,
) -> WorldOutcome:
    """One world of job.tp processes running `job`; every process is gone on return."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="exactlogp-world-") as tmp:
        args = (job.tp, _free_port(), backend, dict(env or {}), tmp, job, timeout)
        procs = [
            ctx.Process(target=_worker, args=(rank, *args), daemon=True) for rank in range(job.tp)
        ]
        try:
            for p in procs:
                p.start()
            watch = _Watch(job, tmp, timeout, on_start, on_progress)
            error, detail = watch.wait(procs)
            results = _finished(job, tmp)
            current = watch.current if error else None
            return WorldOutcome(results, current, error, detail)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
            for p in procs:
                p.join(10)


class _Watch:
    """Follows rank 0's progress; each candidate gets `timeout` seconds from its start,
    and the world STARTUP_S to start its processes and join its process group."""

    def __init__(self, job: Job, tmp: str, timeout: float, on_start, on_progress):
        self.job, self.tmp = job, tmp
        self.on_start, self.on_progress = on_start, on_progress
        self.current = job.candidates[0]
        self.since = time.monotonic()
        self.timeout = max(timeout, STARTUP_S)  # until the first candidate starts
        self.candidate_timeout = timeout
        self.last = None
        if on_start:
            on_start(self.current)

    def wait(self, procs) -> tuple[str | None, str | None]:
        """(None, None) when every rank finished cleanly, else (error, traceback)."""
        while True:
            self._poll()
            if any(p.exitcode is not None and not self._clean(r) for r, p in enumerate(procs)):
                time.sleep(FAILURE_GRACE_S)  # let the other ranks record what they saw
                return self._root_cause(procs)
            if all(p.exitcode is not None for p in procs):
                return None, None
            if time.monotonic() - self.since > self.timeout:
                return f"TimeoutError: no result after {self.timeout:.0f} s; world killed", None
            time.sleep(POLL_S)

    def _path(self, rank: int) -> str:
        return os.path.join(self.tmp, f"rank{rank}.pt")

    def _clean(self, rank: int) -> bool:
        return _load(self._path(rank))[0] is True

    def _root_cause(self, procs) -> tuple[str, str | None]:
        """A rank that died without a word first; else the earliest error written (the
        ranks that fail later mostly report the connection the first one dropped)."""
        for rank, p in enumerate(procs):
            if p.exitcode is not None and not os.path.exists(self._path(rank)):
                return f"rank {rank} died with exit code {p.exitcode}", None
        failed = [
            (os.stat(self._path(r)).st_mtime_ns, r)
            for r, p in enumerate(procs)
            if p.exitcode is not None and _load(self._path(r))[0] is False
        ]
        rank = min(failed)[1]
        value = _load(self._path(rank))[1]
        return f"rank {rank}: {value['error']}", value["traceback"]

    def _poll(self) -> None:
        try:
            with open(os.path.join(self.tmp, "progress")) as f:
                line = f.read()
        except OSError:
            return
        if line == self.last or line.count("\t") != 2:
            return
        self.last = line
        name, done, what = line.split("\t")
        if name != self.current or self.timeout != self.candidate_timeout:
            if name != self.current and self.on_start:
                self.on_start(name)
            self.current, self.since = name, time.monotonic()
            self.timeout = self.candidate_timeout
        if self.on_progress:
            self.on_progress(name, int(done), what)


def _finished(job: Job, tmp: str) -> dict:
    out = {}
    for i, name in enumerate(job.candidates):
        ok, value = _load(os.path.join(tmp, f"cand{i}.pt"))
        if ok:
            out[name] = value
    return out


def _load(path: str):
    """(ok, value) from a result file; (None, None) if there is none yet."""
    if not os.path.exists(path):
        return None, None
    try:
        return torch.load(path, weights_only=False)
    except Exception as exc:  # a rank killed while writing leaves a torn file
        return False, {"error": f"unreadable result: {type(exc).__name__}: {exc}", "traceback": ""}


def _save(path: str, value) -> None:
    torch.save(value, path + ".tmp")
    os.replace(path + ".tmp", path)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """Ask Linux to kill this rank if the report process dies, however it dies."""
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: the parent's finally block is the only clean-up


def _worker(rank, world_size, port, backend, env, tmp, job: Job, timeout):
    import torch.distributed as dist

    _die_with_parent()
    for key, value in env.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

    def progress(name, done, what):
        with open(os.path.join(tmp, "progress.tmp"), "w") as f:
            f.write(f"{name}\t{done}\t{what}")
        os.replace(os.path.join(tmp, "progress.tmp"), os.path.join(tmp, "progress"))

    def sink(name, result):
        _save(os.path.join(tmp, f"cand{job.candidates.index(name)}.pt"), (True, result))

    result = (True, None)
    try:
        if backend == "nccl":
            os.environ["EXACTLOGP_REPORT_DEVICE"] = "cuda"
            torch.cuda.set_device(rank)
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=max(timeout, STARTUP_S)),
        )
        run_job(dist.group.WORLD, job, progress, sink)
    except BaseException as exc:
        error = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        result = (False, error)
    # written before the process group goes away, so a failing rank's own error is on
    # disk before its peers see the connection drop
    _save(os.path.join(tmp, f"rank{rank}.pt"), result)
    if dist.is_initialized():
        dist.destroy_process_group()
