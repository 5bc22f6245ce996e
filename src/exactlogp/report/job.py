"""What runs inside one torch.distributed world: the measurements of the candidates named
in a Job, each on this rank's shard of the workload it takes (the shared logits, or the
shared hidden states and LM-head weight); and `run_candidates`, which runs a job in
spawned worlds with crash and hang isolation.

A "checks" job, per candidate (all ranks issue the same calls, so collectives stay
matched):
  1. build it on this rank's shard
  2. warm-up run on all rows: its output is the candidate's result at this TP; its
     SHA-256 on every rank; each rank's peak memory
  3. batch checks on the check rows: each row alone, consecutive sub-batches of
     1, 2, 3, 5, 8, ... rows, the rows permuted, the rows shuffled among as many
     other rows; each compared bit for bit with step 2's rows
  4. collective settings on the check rows (gloo: emulated orders, see emulation.py)
A "timing" job: the candidates that passed their checks, built side by side, one
warm-up run each, then `repeats` rounds (fewer where a candidate caps them) in which
each runs once on all rows, in an order shuffled per round (measure.interleaved, seeded:
the same order on every rank): barrier, run, (CUDA sync); per run the slowest rank's
time; the SHA-256 of every output.
A "settings" job (a fresh NCCL world per setting) runs just the check rows.
Rank 0 publishes each candidate's result as soon as it has it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from .. import worlds
from ..testing import sha256
from . import candidates, checks, emulation, measure, workload

SUB_BATCH_SIZES = (1, 2, 3, 5, 8, 13, 21, 34, 55, 89)
KINDS = ("checks", "timing", "settings")


@dataclass(frozen=True)
class Job:
    candidates: tuple[str, ...]
    data: dict  # workload kind -> workload.Saved, for every kind the candidates take
    tp: int
    repeats: int
    threads: int = 1
    kind: str = "checks"  # one of KINDS
    emulate: bool = False  # replay emulated reduction orders (gloo, tp > 1)
    seed: int = 0

    def timed_runs(self, name: str) -> int:
        cap = candidates.create(name).max_timed_runs
        return self.repeats if cap is None else min(self.repeats, cap)

    def steps(self, name: str) -> int:
        """Progress steps of one candidate in a checks or settings job."""
        if self.kind == "settings":
            return 2
        settings = len(emulation.emulated_settings(self.tp)) if self.emulate else 0
        return 2 + 4 + settings

    def timing_steps(self) -> int:
        """Progress steps of a timing job: a warm-up and the timed runs of each candidate."""
        return sum(1 + self.timed_runs(name) for name in self.candidates)


Progress = Callable[[str, int, str], None]  # (candidate, steps done, what)
Sink = Callable[[str, dict], None]  # (candidate, its result), called on rank 0


def run_job(group, job: Job, progress: Progress | None = None, sink: Sink | None = None) -> None:
    """Measure the candidates of `job` in this world; an exception ends the job (the other
    ranks may be waiting in a collective of the failed candidate)."""
    import torch.distributed as dist

    if job.kind not in KINDS:
        raise ValueError(f"job kind must be one of {KINDS}, got {job.kind!r}")
    torch.set_num_threads(job.threads)
    rank = dist.get_rank(group)
    quiet = lambda *args: None  # noqa: E731
    report = progress if rank == 0 and progress else quiet
    publish = sink if rank == 0 and sink else quiet
    device = _device(group)
    inputs = _Inputs(job, rank, device)
    if job.kind == "timing":
        _time_interleaved(job, group, inputs, report, publish)
        return
    for name in job.candidates:
        publish(name, _check(name, job, group, inputs, report))


def in_world(rank: int, world_size: int, group, job: Job) -> None:
    """A spawned world's function (worlds.World): the job, progress and results to the parent."""
    run_job(group, job, worlds.progress, worlds.publish)


def _device(group) -> torch.device:
    import torch.distributed as dist

    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class _Inputs:
    """This rank's shard of the workload a candidate takes, as it pads the vocabulary, and
    its context: (rows it maps to logprobs, target, ShardContext, the workload)."""

    def __init__(self, job: Job, rank: int, device: torch.device):
        self.job, self.rank, self.device = job, rank, device
        self._shards: dict[tuple[str, int], tuple] = {}

    def __call__(self, cand, group):
        job, data = self.job, self.job.data[cand.kind]
        padded = cand.padded_vocab(data.vocab, job.tp)
        width = padded // job.tp
        key = (cand.kind, width)
        if key not in self._shards:
            lo = self.rank * width
            weight = None
            if cand.kind == "logits":
                x, target = workload.load_shard(data.path, lo, width, data.vocab)
            else:
                x, weight, target = workload.load_hidden_shard(data.path, lo, width, data.vocab)
            moved = (t if t is None else t.to(self.device) for t in (x, target, weight))
            self._shards[key] = tuple(moved)
        x, target, weight = self._shards[key]
        ctx = candidates.ShardContext(
            self.rank, job.tp, group, self.device, data.vocab, padded, self.rank * width, weight
        )
        return x, target, ctx, data


def _logprobs_fn(cand, ctx):
    fn = cand.build(ctx)
    return lambda x, target: candidates.logprobs_of(fn(x, target))


def _check(name, job: Job, group, inputs: _Inputs, report) -> dict:
    report(name, 0, "loading")
    start = time.perf_counter()
    cand = candidates.create(name)
    try:
        # every rank fails the same way here, so the world can go on to the next candidate
        cand.check_available(inputs.device)
    except candidates.Unavailable as exc:
        return {"unavailable": str(exc)}
    x, target, ctx, data = inputs(cand, group)
    done = [0]

    def step(what: str) -> None:
        done[0] += 1
        report(name, done[0], what)

    rows = torch.tensor(data.check_rows, dtype=torch.int64, device=inputs.device)
    try:
        fn = _logprobs_fn(cand, ctx)
        step("built")
        with torch.no_grad():
            if job.kind == "settings":
                out = fn(x[rows], target[rows])
                step("settings run")
                return {"check_rows_out": out.cpu()}
            result = _warm_up(fn, x, target, group, inputs.device)
            step("warm-up")
            expect = result["out"].to(inputs.device)[rows]
            extra = torch.tensor(data.extra_rows, dtype=torch.int64, device=inputs.device)
            result["batch"] = _batch_checks(fn, x, target, rows, extra, expect, job, step)
            if job.emulate:
                result["settings"] = _settings_checks(fn, x, target, rows, job, step)
            else:
                with emulation.emulate(None) as counter:
                    fn(x[rows[:1]], target[rows[:1]])
                result["float_all_reduces_per_call"] = counter.count
            result["padded_vocab"] = ctx.padded_vocab
            result["wall_s"] = time.perf_counter() - start
            return result
    finally:
        cand.teardown()


def _warm_up(fn, x, target, group, device) -> dict:
    import torch.distributed as dist

    memory = measure.PeakMemory(device)
    dist.barrier(group=group)
    out = fn(x, target)  # its output is the result
    measure.sync(device)
    peak, digest = memory.read(), sha256(out)
    per_rank = [None] * dist.get_world_size(group)
    dist.all_gather_object(per_rank, (peak, digest), group=group)
    return {
        "out": out.detach().to(torch.float32).cpu(),
        "hashes": [digest],
        "peak_memory_mib_per_rank": [p for p, _ in per_rank],
        "ranks_agree": len({h for _, h in per_rank}) == 1,
    }


def _time_interleaved(job: Job, group, inputs: _Inputs, report, publish) -> None:
    import torch.distributed as dist

    built, steps = [], {}
    hashes: dict[str, list[str]] = {name: [] for name in job.candidates}
    runs = {name: job.timed_runs(name) for name in job.candidates}
    done = [0]

    def advance(name: str, what: str) -> None:
        done[0] += 1
        report(name, done[0], what)

    def on_run(name: str, out) -> None:
        hashes[name].append(sha256(out))
        advance(name, f"timed run {len(hashes[name])}/{runs[name]}")

    try:
        for name in job.candidates:
            report(name, done[0], "building")
            cand = candidates.create(name)
            built.append(cand)
            x, target, ctx, _ = inputs(cand, group)
            fn = _logprobs_fn(cand, ctx)
            steps[name] = lambda fn=fn, x=x, t=target: fn(x, t)
        with torch.no_grad():
            for name, run in steps.items():
                dist.barrier(group=group)
                run()
                measure.sync(inputs.device)
                advance(name, "warm-up")
            seconds = measure.interleaved(
                steps,
                runs,
                seed=job.seed,
                clock=measure.WallClock(inputs.device),
                before=lambda: dist.barrier(group=group),
                on_run=on_run,
            )
        per_rank = [None] * dist.get_world_size(group)
        dist.all_gather_object(per_rank, seconds, group=group)
        for name in job.candidates:
            slowest = [max(s[name][i] for s in per_rank) for i in range(runs[name])]
            publish(name, {"times_s": slowest, "hashes": hashes[name]})
    finally:
        for cand in built:
            cand.teardown()


def _batch_checks(fn, x, target, rows, extra, expect, job: Job, step) -> dict:
    gen = torch.Generator().manual_seed(job.seed + 2)
    n = rows.numel()

    def run(idx):
        return fn(x[idx], target[idx])

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
    return {k: checks.differing_rows(v, expect) for k, v in variants.items()}


def _settings_checks(fn, x, target, rows, job: Job, step) -> dict:
    outs, counts = {}, {}
    for setting in emulation.emulated_settings(job.tp):
        with emulation.emulate(setting) as counter:
            outs[setting.name] = fn(x[rows], target[rows])
        counts[setting.name] = counter.count
        step(setting.name)
    base = outs["as_is"]
    return {
        "mismatched_rows": {k: checks.differing_rows(v, base) for k, v in outs.items()},
        "float_all_reduces_per_call": counts["as_is"],
    }


def _cycle(values):
    while True:
        yield from values


# --- in the parent: a job in spawned worlds, one failure at a time ---


def run_candidates(
    job: Job,
    *,
    backend: str,
    timeout: float,
    env: dict | None = None,
    on_progress: Progress | None = None,
) -> dict:
    """{candidate: result or {"error", "traceback"?}} for every candidate of `job`.

    A world runs the candidates still to do; when one crashes or hangs, the world is
    killed, that candidate gets the error (or the timeout) and a fresh world starts for
    the ones after it: one bad candidate never stops the others.
    """
    results: dict = {}
    remaining = list(job.candidates)
    while remaining:
        this = replace(job, candidates=tuple(remaining))
        with worlds.World(
            job.tp, in_world, (this,), backend=backend, timeout=timeout, env=env,
            threads=job.threads,
        ) as world:  # fmt: skip
            failure = world.wait(on_progress)
            results.update(world.published())
            failed = world.phase
        todo = [n for n in remaining if n not in results]
        if failure is not None and todo:
            if failed not in todo:  # it failed between two candidates
                failed = todo[0]
            results[failed] = {"error": failure.error}
            if failure.traceback:
                results[failed]["traceback"] = failure.traceback[-4000:]
        remaining = [n for n in remaining if n not in results]
    return results
