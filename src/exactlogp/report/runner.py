"""The conformance report, end to end.

1. rows: the requested candidates (+ one exactlogp row per other backend); the ones
   that cannot run here are reported as {"unavailable": "<exception text>"}
2. the shared workloads, written once with their fp64 truth: seeded logits and targets;
   and, when a fused LM-head row asks for them, seeded hidden states, an LM-head weight
   and targets (candidates.base: the candidate's `kind`)
3. per TP degree, spawned worlds (gloo on CPU; NCCL, one GPU per rank) run job.py's
   checks for the candidates one after another, each with its own timeout; a crash or
   hang costs that candidate its result and the rest a fresh world. Then one world
   times the candidates that passed, interleaved: every candidate once per round, the
   order shuffled per round (under torchrun: the torchrun world, see torchrun.py)
4. on NCCL, a fresh world per NCCL setting for the setting check
5. the processed-logprobs table (processed.py): its own seeded logits, a gloo world at
   the largest TP degree
6. verdicts (checks.py), header, JSON validated against schema.py (assemble.py)
"""

from __future__ import annotations

import math
import os
import shlex
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace

import torch

from . import checks, emulation, processed
from .assemble import assemble, exit_status
from .job import run_candidates
from .session import Session

DEFAULT_CANDIDATES = (
    # on the shared logits
    "exactlogp",
    "megatron_ce",
    "megatron_fused_ce",
    "vime_default",
    "vllm_gather",
    "rl_kernel_ws2",
    "torch_full",
    # on the shared hidden states and LM-head weight
    "exactlogp_linear",
    "verl_fused",
    "miles_fused",
    "torch_linear",
)


@dataclass(frozen=True)
class ReportOptions:
    tokens: int = 1024
    vocab: int = 151936
    # The hidden-state workload: hidden_tokens x hidden_size hidden states and a vocab x
    # hidden_size LM head (Qwen3-Next's vocabulary; its hidden size is 2048). Smaller than
    # the logits workload so that `make report` stays within minutes on a small CPU: the
    # exact LM head's CPU time grows with tokens x vocab.
    hidden_tokens: int = 128
    hidden_size: int = 256
    # > 0: two channels of the hidden states this many times the rest (LLM hidden states'
    # massive activations: the rows where contract v1's logits were not exact); 0: H // 64
    # channels 8x the rest
    hidden_outlier: float = 0.0
    tp: tuple[int, ...] = (1, 4)
    repeats: int = 10
    dtype: str = "bf16"
    candidates: tuple[str, ...] = DEFAULT_CANDIDATES
    out: str = "reports/prior_art.json"
    device: str = "auto"
    check_rows: int = 64
    # The hidden-state workload's check rows: fewer, since the batch checks run every check
    # row alone and each call of the exact LM head quantizes its whole weight shard first
    # (~1.4 s for 151936 x 256 on one core).
    hidden_check_rows: int = 16
    timeout_s: float = 1200.0  # per candidate and TP degree
    # One intra-op thread per rank by default: on CPU, torch splits one long row's sum
    # over threads, so a thread count that changes with TP or batch would add its own
    # (non-algorithmic) differences to every float-summing candidate.
    threads_per_rank: int = 1
    seed: int = 0
    # The processed-logprobs table (temperature 0.8, top-k 50, top-p 0.9, min-p 0.05) on
    # its own processed_tokens x vocab logits; 0 leaves it out. Fewer rows than the
    # logits workload: its fp64 truth sorts every row in fp64.
    processed_tokens: int = 256
    preset: str | None = None
    command: str = field(default_factory=lambda: shlex.join(["exactlogp", *sys.argv[1:]]))


PRESETS = {
    # Small enough for CI: a few minutes on two idle CPU cores. The default rows but
    # megatron_fused_ce, whose torch.compile warm-up alone takes ~30 s per world
    # (miles_fused compiles the same megatron-core function but stays: it is the only row
    # of its pipeline).
    "quick": dict(
        tokens=48,
        vocab=2048,
        hidden_tokens=48,
        hidden_size=128,
        tp=(1, 2),
        repeats=10,
        check_rows=12,
        hidden_check_rows=12,
        processed_tokens=48,
        timeout_s=300.0,
        candidates=(
            "exactlogp",
            "megatron_ce",
            "vime_default",
            "vllm_gather",
            "rl_kernel_ws2",
            "torch_full",
            "exactlogp_linear",
            "exactlogp_linear[reference]",  # cheap at this size: the backends' bits agree
            "verl_fused",
            "miles_fused",
            "torch_linear",
        ),
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


def run(opts: ReportOptions, display=None) -> tuple[dict | None, int]:
    """(report, exit status); the report is None on ranks other than 0 under torchrun."""
    _check_options(opts)
    display = display or NullDisplay()
    device = resolve_device(opts.device)
    if under_torchrun():
        from .torchrun import run_torchrun

        return run_torchrun(opts, device, display, NullDisplay())
    backend = "nccl" if device.type == "cuda" else "gloo"
    tps, cap = _plan_tps(opts.tp, device)
    threads = dict.fromkeys(tps, opts.threads_per_rank)
    s = Session(opts, device, backend, "spawn", tps, cap, threads, time.monotonic())
    s.choose_rows()
    with tempfile.TemporaryDirectory(prefix="exactlogp-report-") as tmp:
        s.prepare(tmp, display)
        for tp in tps:
            s.record(tp, _measure_tp(s, tp, display))
        s.settings = emulation.emulated_settings(max(tps))
        if backend == "nccl" and max(tps) > 1:
            s.settings = emulation.nccl_settings()
            for tp in (t for t in tps if t > 1):
                _nccl_settings(s, tp, display)
    if opts.processed_tokens:
        s.processed = _processed(opts, max(tps), display)
    report = assemble(s)
    return report, exit_status(report)


def _processed(opts: ReportOptions, tp: int, display) -> dict:
    task = display.start("processed logprobs (CPU, gloo)", 1)
    result = processed.measure(
        opts.processed_tokens, opts.vocab, opts.dtype, tp, opts.repeats, opts.check_rows,
        opts.seed,
    )  # fmt: skip
    bad = processed.failures(result)
    display.finish(task, "; ".join(bad) if bad else "done")
    return result


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but torch sees no CUDA device")
    return torch.device(device)


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ


def _check_options(opts: ReportOptions) -> None:
    counts = ("tokens", "vocab", "repeats", "check_rows")
    for name in (*counts, "hidden_tokens", "hidden_size", "hidden_check_rows"):
        value = getattr(opts, name)
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    out = opts.hidden_outlier
    if not isinstance(out, (int, float)) or not math.isfinite(out) or out < 0:
        raise ValueError(f"hidden_outlier must be a finite number >= 0, got {out!r}")
    if not isinstance(opts.processed_tokens, int) or opts.processed_tokens < 0:
        raise ValueError(
            f"processed_tokens must be an int >= 0 (0: no table), got {opts.processed_tokens!r}"
        )
    if not opts.tp or any(not isinstance(t, int) or t < 1 for t in opts.tp):
        raise ValueError(f"tp must be positive ints, got {opts.tp!r}")
    from .workload import DTYPES

    if opts.dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {opts.dtype!r}")
    if not opts.candidates:
        raise ValueError("candidates must name at least one candidate")
    if opts.timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {opts.timeout_s!r}")
    if not isinstance(opts.threads_per_rank, int) or opts.threads_per_rank < 1:
        raise ValueError(f"threads_per_rank must be >= 1, got {opts.threads_per_rank!r}")


def _plan_tps(requested, device) -> tuple[list[int], int | None]:
    """TP degrees to measure; on CUDA, capped by the GPU count (one process per GPU)."""
    tps = sorted(set(requested))
    if device.type != "cuda":
        return tps, None
    cap = torch.cuda.device_count()
    return [tp for tp in tps if tp <= cap] or [1], cap


def _measure_tp(s: Session, tp: int, display) -> dict:
    """{candidate: result or {"error"} or {"unavailable"}} at one TP degree."""
    names = s.applicable(tp)
    if not names:
        return {}
    job = s.job(names, tp)
    tasks = {}

    def on_progress(name, done, what):
        if name not in tasks:
            tasks[name] = display.start(f"{name} TP{tp}", job.steps(name))
        display.advance(tasks[name], done, what)

    results = run_candidates(
        job, backend=s.backend, timeout=s.opts.timeout_s, on_progress=on_progress
    )
    for name in names:
        if name not in tasks:
            tasks[name] = display.start(f"{name} TP{tp}", job.steps(name))
        res = results[name]
        if "error" in res:
            status = f"[red]{res['error']}"
        elif "unavailable" in res:
            status = f"unavailable: {res['unavailable']}"
        else:
            status = f"checked in {res['wall_s']:.0f} s"
        display.finish(tasks[name], status)
    passed = [n for n, res in results.items() if "error" not in res and "unavailable" not in res]
    if not passed:
        return results
    timing = s.job(passed, tp, kind="timing")
    task = display.start(f"timing TP{tp}, interleaved", timing.timing_steps())
    timed = run_candidates(
        timing,
        backend=s.backend,
        timeout=s.opts.timeout_s,
        on_progress=lambda name, done, what: display.advance(task, done, f"{name}: {what}"),
    )
    failed = [f"{n}: {r['error']}" for n, r in timed.items() if "error" in r]
    display.finish(task, f"[red]{'; '.join(failed)}" if failed else "done")
    return s.with_timing(results, timed)


def _nccl_settings(s: Session, tp: int, display) -> None:
    """A fresh NCCL world per setting, all candidates in it, on the check rows only."""
    names = [n for n in s.runnable if tp in s.results[n] and "error" not in s.results[n][tp]]
    outs: dict[str, dict] = {n: {} for n in names}
    for setting in emulation.nccl_settings():
        task = display.start(f"TP{tp} NCCL {setting.name}", 1)
        got = run_candidates(
            s.job(names, tp, kind="settings"),
            backend="nccl",
            timeout=s.opts.timeout_s,
            env=dict(setting.env),
        )
        display.finish(task, "done")
        for n in names:
            outs[n][setting.name] = got[n].get("check_rows_out")
    for n in names:
        base = outs[n]["nccl_default"]
        mismatched = {
            name: -1 if out is None or base is None else checks.differing_rows(out, base)
            for name, out in outs[n].items()
        }  # -1: that setting's world failed for this candidate
        s.results[n][tp]["settings"] = {
            "mismatched_rows": mismatched,
            "float_all_reduces_per_call": s.results[n][tp]["float_all_reduces_per_call"],
        }
