"""The conformance report, end to end: workload, one world per candidate and TP degree,
verdicts, header, JSON + Markdown.

  1. rows: the requested candidates (+ one exactlogp row per other backend); the ones
     that cannot run here are reported as {"unavailable": "<exception text>"}
  2. the shared workload: seeded logits and targets, written once; fp64 ground truth
  3. one fresh world per (candidate, TP) -- spawned (gloo on CPU, NCCL one GPU per
     rank) with a timeout, or the torchrun world -- running job.py's measurements
  4. on NCCL, one fresh world per NCCL setting for the setting check
  5. verdicts (checks.py), header, JSON validated against schema.py, Markdown summary
"""

from __future__ import annotations

import datetime
import os
import shlex
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace

import torch

from .. import __version__
from ..contract import CONTRACT
from . import candidates, checks, emulation, environment, schema, workload
from .job import Job, run_job
from .worlds import run_candidates

KIND = "logprob_conformance"
SCHEMA_VERSION = 1
DEFAULT_CANDIDATES = (
    "exactlogp",
    "megatron_ce",
    "megatron_fused_ce",
    "vime_default",
    "vllm_gather",
    "rl_kernel_ws2",
    "miles_fused",
    "verl_fused",
    "torch_full",
)


@dataclass(frozen=True)
class ReportOptions:
    tokens: int = 1024
    vocab: int = 151936
    tp: tuple[int, ...] = (1, 4)
    repeats: int = 10
    dtype: str = "bf16"
    candidates: tuple[str, ...] = DEFAULT_CANDIDATES
    out: str = "reports/prior_art.json"
    device: str = "auto"
    check_rows: int = 64
    timeout_s: float = 1200.0
    threads_per_rank: int | None = None  # None: the CPU count shared out over the ranks
    seed: int = 0
    preset: str | None = None
    command: str = field(default_factory=lambda: shlex.join(["exactlogp", *sys.argv[1:]]))


PRESETS = {
    # small enough for CI: well under a minute of measurement on two CPU cores
    # (megatron_fused_ce is left out: its torch.compile warm-up alone takes ~30 s per world)
    # (one thread per rank: at these tiny shapes a second thread only adds sync overhead)
    "quick": dict(
        tokens=48,
        vocab=2048,
        tp=(1, 2),
        repeats=10,
        check_rows=12,
        timeout_s=300.0,
        threads_per_rank=1,
        candidates=tuple(c for c in DEFAULT_CANDIDATES if c != "megatron_fused_ce"),
    ),
}


def make_options(preset: str | None = None, **overrides) -> ReportOptions:
    """Defaults (the seed's workload), then the preset's values, then `overrides`."""
    opts = ReportOptions(preset=preset)
    if preset is not None:
        if preset not in PRESETS:
            raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {preset!r}")
        opts = replace(opts, **PRESETS[preset])
    return replace(opts, **overrides)


class NullDisplay:
    """The display interface the runner drives; this one shows nothing."""

    def start(self, label: str, total: int):
        return label

    def advance(self, task, done: int, what: str) -> None:
        pass

    def finish(self, task, status: str) -> None:
        pass


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but torch sees no CUDA device")
    return torch.device(device)


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or int(os.environ.get("WORLD_SIZE", "1")) > 1


def run(opts: ReportOptions, display=None) -> tuple[dict | None, int]:
    """(report, exit status); the report is None on ranks other than 0 under torchrun."""
    _check_options(opts)
    display = display or NullDisplay()
    start = time.monotonic()
    device = resolve_device(opts.device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if under_torchrun():
        return _run_torchrun(opts, device, backend, display, start)
    tps, cap = _plan_tps(opts.tp, device)
    threads = {tp: opts.threads_per_rank or max(1, (os.cpu_count() or 1) // tp) for tp in tps}
    rows = candidates.expand(list(opts.candidates), device)
    runnable, entries = _availability(rows, device)
    wl = workload.Workload(opts.tokens, opts.vocab, opts.dtype, opts.seed)
    with tempfile.TemporaryDirectory(prefix="exactlogp-report-") as tmp:
        data_path = os.path.join(tmp, "workload.pt")
        logits, target, reference = _prepare(wl, data_path, display)
        rows_chk, extra = workload.check_rows(opts.tokens, opts.check_rows, opts.seed)
        results = {name: {} for name in runnable}
        for tp in tps:
            job = _job(runnable, tp, opts, backend, data_path, rows_chk, extra, threads[tp])
            for name, res in _run_tp(job, opts, backend, display).items():
                results[name][tp] = res
            _drop_unavailable(runnable, entries, results, tp)
        settings = emulation.emulated_settings(max(tps))
        if backend == "nccl" and max(tps) > 1:
            settings = emulation.nccl_settings()
            _nccl_settings_worlds(runnable, tps, opts, data_path, rows_chk, extra, results, display)
    report = _assemble(
        opts,
        wl,
        device,
        backend,
        "spawn",
        tps,
        cap,
        threads,
        rows,
        runnable,
        entries,
        results,
        reference,
        logits,
        target,
        rows_chk,
        extra,
        settings,
        start,
    )
    return report, _exit_status(report)


def _check_options(opts: ReportOptions) -> None:
    for name in ("tokens", "vocab", "repeats", "check_rows"):
        value = getattr(opts, name)
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if not opts.tp or any(not isinstance(t, int) or t < 1 for t in opts.tp):
        raise ValueError(f"tp must be positive ints, got {opts.tp!r}")
    if opts.dtype not in workload.DTYPES:
        raise ValueError(f"dtype must be one of {sorted(workload.DTYPES)}, got {opts.dtype!r}")
    if not opts.candidates:
        raise ValueError("candidates must name at least one candidate")
    if opts.timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {opts.timeout_s!r}")


def _plan_tps(requested, device) -> tuple[list[int], int | None]:
    tps = sorted(set(requested))
    if device.type != "cuda":
        return tps, None
    cap = torch.cuda.device_count()
    return [tp for tp in tps if tp <= cap] or [1], cap


def _availability(rows: list[str], device) -> tuple[list[str], dict]:
    """Candidates that cannot even be created are unavailable; the others are checked
    (imported) inside the first world, where their imports are paid for anyway."""
    runnable, entries = [], {}
    for name in rows:
        try:
            candidates.create(name)
        except Exception as exc:
            entries[name] = {"unavailable": f"{type(exc).__name__}: {exc}"}
            continue
        runnable.append(name)
    return runnable, entries


def _drop_unavailable(runnable: list[str], entries: dict, results: dict, tp: int) -> None:
    for name in list(runnable):
        res = results[name].get(tp, {})
        if "unavailable" in res:
            entries[name] = {"unavailable": res["unavailable"]}
            runnable.remove(name)
            del results[name]


def _prepare(wl: workload.Workload, data_path: str, display):
    task = display.start(f"shared logits {wl.tokens} x {wl.vocab} {wl.dtype}", 2)
    logits, target = workload.generate(wl)
    workload.save(data_path, logits, target)
    display.advance(task, 1, "fp64 reference")
    reference = workload.reference_logprobs(logits, target)
    display.finish(task, "ready")
    return logits, target, reference


def _job(names, tp, opts, backend, data_path, rows_chk, extra, threads, full=True) -> Job:
    return Job(
        candidates=tuple(names),
        data_path=data_path,
        vocab=opts.vocab,
        tp=tp,
        repeats=opts.repeats,
        check_rows=tuple(rows_chk),
        extra_rows=tuple(extra),
        threads=threads,
        full=full,
        emulate=full and backend == "gloo" and tp > 1,
        seed=opts.seed,
    )


def _run_tp(job: Job, opts, backend, display) -> dict:
    """{candidate: result or error} at one TP degree, in as few worlds as possible."""
    out, names = {}, []
    for name in job.candidates:
        cand = candidates.create(name)
        if cand.tp1_only and job.tp != 1:
            continue
        try:
            cand.padded_vocab(opts.vocab, job.tp)
        except ValueError as exc:
            out[name] = {"error": f"not applicable: {exc}"}
            continue
        names.append(name)
    if not names:
        return out
    job = replace(job, candidates=tuple(names))
    tasks = {}

    def on_start(name):
        tasks[name] = display.start(f"{name} TP{job.tp}", job.steps())

    def on_progress(name, done, what):
        display.advance(tasks[name], done, what)

    results = run_candidates(
        job, backend=backend, timeout=opts.timeout_s, on_start=on_start, on_progress=on_progress
    )
    for name in names:
        if name not in tasks:
            on_start(name)
        res = results[name]
        status = "done"
        if "error" in res or "unavailable" in res:
            status = f"[red]{res.get('error') or 'unavailable: ' + res['unavailable']}"
        display.finish(tasks[name], status)
    out.update(results)
    return out


def _nccl_settings_worlds(runnable, tps, opts, data_path, rows_chk, extra, results, display):
    """A fresh NCCL world per setting; all candidates in it, check rows only."""
    for tp in [t for t in tps if t > 1]:
        names = [n for n in runnable if tp in results[n] and "error" not in results[n][tp]]
        outs: dict[str, dict] = {n: {} for n in names}
        for setting in emulation.nccl_settings():
            job = _job(names, tp, opts, "nccl", data_path, rows_chk, extra, 1, full=False)
            task = display.start(f"TP{tp} NCCL {setting.name}", 1)
            got = run_candidates(job, backend="nccl", timeout=opts.timeout_s, env=dict(setting.env))
            display.finish(task, "done")
            for n in names:
                outs[n][setting.name] = got[n]
        for n in names:
            base = outs[n]["nccl_default"].get("check_rows_out")
            mism = {}
            for s, v in outs[n].items():
                if base is None or "check_rows_out" not in v:
                    mism[s] = -1  # could not be measured
                else:
                    mism[s] = int(
                        (v["check_rows_out"].view(torch.int32) != base.view(torch.int32)).sum()
                    )
            results[n][tp]["settings"] = {
                "mismatched_rows": mism,
                "float_all_reduces_per_call": results[n][tp]["float_all_reduces_per_call"],
            }


def _run_torchrun(opts, device, backend, display, start):
    """Every rank of the torchrun world runs this; TP groups are consecutive blocks of ranks
    (the other blocks compute the same thing, as data-parallel replicas)."""
    import datetime as dt

    import torch.distributed as dist

    if not dist.is_initialized():
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            os.environ["EXACTLOGP_REPORT_DEVICE"] = "cuda"
        dist.init_process_group(backend, timeout=dt.timedelta(seconds=opts.timeout_s))
    rank, world = dist.get_rank(), dist.get_world_size()
    tps = [tp for tp in sorted(set(opts.tp)) if world % tp == 0]
    threads = {tp: opts.threads_per_rank or max(1, (os.cpu_count() or 1) // world) for tp in tps}
    rows = candidates.expand(list(opts.candidates), device)
    runnable, entries = _availability(rows, device)
    wl = workload.Workload(opts.tokens, opts.vocab, opts.dtype, opts.seed)
    shown = display if rank == 0 else NullDisplay()
    with tempfile.TemporaryDirectory(prefix=f"exactlogp-report-r{rank}-") as tmp:
        data_path = os.path.join(tmp, "workload.pt")
        logits, target, reference = _prepare(wl, data_path, shown)
        rows_chk, extra = workload.check_rows(opts.tokens, opts.check_rows, opts.seed)
        results = {name: {} for name in runnable}
        for tp in tps:
            blocks = [dist.new_group(list(range(b, b + tp))) for b in range(0, world, tp)]
            group = blocks[rank // tp]
            for name in runnable:
                if candidates.create(name).tp1_only and tp != 1:
                    continue
                job = _job([name], tp, opts, backend, data_path, rows_chk, extra, threads[tp])
                task = shown.start(f"{name} TP{tp}", job.steps())

                def sink(n, value, tp=tp):
                    results[n][tp] = value

                try:
                    run_job(group, job, lambda _n, d, w, t=task: shown.advance(t, d, w), sink)
                except Exception as exc:  # other ranks may then wait until the PG timeout
                    results[name][tp] = {"error": f"{type(exc).__name__}: {exc}"}
                shown.finish(task, results[name].get(tp, {}).get("error", "done"))
            _drop_unavailable(runnable, entries, results, tp)
    if rank != 0:
        return None, 0
    settings = emulation.emulated_settings(max(tps))
    report = _assemble(
        opts,
        wl,
        device,
        backend,
        "torchrun",
        tps,
        world,
        threads,
        rows,
        runnable,
        entries,
        results,
        reference,
        logits,
        target,
        rows_chk,
        extra,
        settings,
        start,
    )
    return report, _exit_status(report)


def _assemble(
    opts,
    wl,
    device,
    backend,
    launcher,
    tps,
    cap,
    threads,
    rows,
    runnable,
    entries,
    results,
    reference,
    logits,
    target,
    rows_chk,
    extra,
    settings,
    start,
) -> dict:
    infos = {name: candidates.create(name) for name in runnable}
    for name in runnable:
        entries[name] = checks.candidate_entry(infos[name].describe(), results[name], reference)
    entries = {name: entries[name] for name in rows}  # the requested order
    outs = {n: {tp: r["out"] for tp, r in results[n].items() if "error" not in r} for n in runnable}
    pairwise = checks.pairwise_max_abs(outs)
    for name in runnable:
        entries[name]["max_abs_vs"] = pairwise[name]
        if name.startswith("exactlogp[") and "exactlogp" in outs:
            common = set(outs[name]) & set(outs["exactlogp"])
            entries[name]["bitwise_equal_to_exactlogp"] = (
                all(checks.bits_equal(outs[name][t], outs["exactlogp"][t]) for t in common)
                if common
                else None
            )
        if name == "exactlogp":
            entries[name]["backend_resolved"] = infos[name].resolved_backend(device)
    commit, dirty = environment.project_git_state()
    emulated = backend == "gloo"
    third_party = {}
    for cand in infos.values():
        for pkg in cand.third_party():
            third_party[pkg["name"]] = pkg
    report = {
        "kind": KIND,
        "schema_version": SCHEMA_VERSION,
        "contract": CONTRACT,
        "exactlogp_version": __version__,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": opts.command,
        "project_commit": commit,
        "tracked_tree_dirty": dirty,
        "environment": environment.environment(device, backend, threads),
        "third_party": sorted(third_party.values(), key=lambda p: p["name"]),
        "tokens": wl.tokens,
        "vocab": wl.vocab,
        "dtype": wl.dtype,
        "collective_backend": backend,
        "launcher": launcher,
        "tp": tps,
        "tp_requested": sorted(set(opts.tp)),
        "tp_cap": cap,
        "nccl_settings": [s.as_dict() for s in settings],
        "nccl_settings_emulated": emulated,
        "workload": {**wl.describe(), **workload.summary(logits, target, reference)},
        "reference": {
            "name": checks.REFERENCE_NAME,
            "method": "exactlogp.testing.fp64_reference: fp64 max, exp and sum, log1p of the "
            "non-argmax terms so logprobs near 0 keep full relative precision",
        },
        "method": _method(opts, rows_chk, extra, emulated, launcher),
        "candidates": entries,
    }
    report["wall_s"] = time.monotonic() - start
    schema.validate(report)
    return report


def _method(opts, rows_chk, extra, emulated, launcher) -> dict:
    return {
        "warmup_runs": 1,
        "timed_runs": opts.repeats,
        "timing": "all rows per run; barrier before each run, the slowest rank's time per "
        "run (CUDA synchronised); median and p10/p90 over the timed runs",
        "repeats": "SHA-256 of the warm-up output and of every timed run's output, all rows",
        "check_rows": list(rows_chk),
        "extra_rows": list(extra),
        "batch_bitwise": "on check_rows: each row alone, consecutive sub-batches of 1, 2, 3, 5, "
        "8, ... rows, the rows permuted, the rows shuffled among extra_rows; each bit for bit "
        "against the same rows of the full-batch warm-up output",
        "nccl_setting_invariant": (
            "on check_rows, in the same world: every float all_reduce a candidate issues "
            "replayed in each emulated order (gloo has no NCCL knobs); all outputs bit for bit"
            if emulated
            else "on check_rows: a fresh NCCL world per setting; all outputs bit for bit"
        ),
        "tp_equals_tp1": "all rows, bit for bit, each TP degree against TP1",
        "accuracy": "all rows at every TP measured, against the fp64 reference; ulps are fp32 "
        "ulps of the reference value",
        "peak_memory": "per rank, warm-up and timed runs: CUDA allocator peak, or on CPU the "
        "resident-set peak (VmHWM, reset first) minus the resident set before",
        "worlds": "one fresh world per candidate and TP degree, spawned with a timeout"
        if launcher == "spawn"
        else "the torchrun world; TP groups are consecutive blocks of ranks",
        "timeout_s": opts.timeout_s,
    }


def _exit_status(report: dict) -> int:
    return 1 if checks.exactlogp_failures(report["candidates"]) else 0
