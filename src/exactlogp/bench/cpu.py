"""`exactlogp bench` (also benchmarks/cpu_bench.py): the fused CPU backend against the
real megatron-core vocab-parallel cross-entropy, eager torch fp32 log_softmax + gather
and a torch.compile'd fp32 logsumexp + gather.

The candidates are the report's (exactlogp.report.candidates), built at TP1 through the
same ShardContext on a process group of one rank (exactlogp.report.tp1), and timed by
exactlogp.report.measure: every repeat runs every (candidate, mode) once, in an order
shuffled per repeat (seeded), after one untimed warm-up of each.

Default run: the Qwen3-Next shape (1024 tokens x 151936 vocab, bf16, TP 1, one process),
forward and forward+backward, the median of 5 repeats (min and max shown), then the peak
extra memory of each candidate, each in a fresh process. --profile times the backend's
passes against this machine's memory bandwidth. --sweep adds sweeps over tokens
(128 .. 4096) and vocab (32k .. 262k) with fewer repeats, written as Markdown tables and
a PNG plot. --goals instead runs the table of GOAL_ROWS: decode-step calls (1 and 8
tokens, a 64-token batch), the Qwen shape in bf16, fp16, fp32 and fp32 holding bf16
values, a low temperature and heavy-tailed logits, each against eager torch and
torch.compile, forward and forward+backward, with and without entropy. Everything lands
in --out (default reports/performance; the committed tables in docs/performance are
refreshed with --out docs/performance).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..report import candidates, measure
from ..report.measure import MODES
from ..report.tp1 import tp1_steps
from ..temperature import ONE
from ..testing import heavy_tailed_logits, llm_like_logits

# environment variables that cap the instruction sets (ours, ATen's and inductor's, oneDNN's,
# MKL's): a run under them is recorded with them, e.g. to measure an AVX2-only machine's ratios
ISA_ENV = (
    "EXACTLOGP_CPU_ISA",
    "ATEN_CPU_CAPABILITY",
    "ONEDNN_MAX_CPU_ISA",
    "MKL_ENABLE_INSTRUCTIONS",
)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
SWEEP_TOKENS = (128, 256, 512, 1024, 2048, 4096)
SWEEP_VOCAB = (32768, 65536, 131072, 151936, 262144)
OURS = "exactlogp[cpu]"
BASELINE = "megatron_ce"
EAGER = "torch_full[row_block=all]"
COMPILED = "torch_compile"
DEFAULT_CANDIDATES = (
    OURS,
    "exactlogp[cpu,entropy]",  # the RL case: the loss adds the entropy
    "exactlogp[cpu,value_tables=never]",  # column by column: what the value tables save
    BASELINE,
    EAGER,
    COMPILED,
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="exactlogp bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=1024, help="rows N (default 1024)")
    p.add_argument("--vocab", type=int, default=151936, help="vocabulary V (default 151936)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--repeats", type=int, default=5, help="shuffled repeats (default 5)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--candidates",
        default=",".join(DEFAULT_CANDIDATES),
        help="comma-separated names of exactlogp.report.candidates",
    )
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory processes")
    p.add_argument("--profile", action="store_true", help="time the backend passes")
    p.add_argument("--sweep", action="store_true", help="also run the token and vocab sweeps")
    p.add_argument("--sweep-repeats", type=int, default=3, help="repeats per sweep point")
    p.add_argument(
        "--sweep-candidates",
        default=f"{OURS},{BASELINE},{EAGER},{COMPILED}",
        help="comma-separated names for the sweeps",
    )
    p.add_argument("--goals", action="store_true", help="run the goal rows (GOAL_ROWS) instead")
    p.add_argument(
        "--goal-rows", default="", help="comma-separated labels of GOAL_ROWS (default: all)"
    )
    p.add_argument("--out", type=Path, default=Path("reports/performance"))
    p.add_argument(
        "--measure-memory", nargs=2, metavar=("CANDIDATE", "MODE"), help=argparse.SUPPRESS
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.measure_memory:
        return _child_memory(args, *args.measure_memory)
    args.out.mkdir(parents=True, exist_ok=True)
    command = recorded_command(sys.argv[1:] if argv is None else argv)
    if args.goals:
        return goals(args, command)
    names = _names("--candidates", args.candidates)
    sweep_names = _names("--sweep-candidates", args.sweep_candidates)
    report = _main_shape(args, names)
    report.update(command=command, machine=machine())
    if args.profile:
        report["profile"] = profile(args)
    if args.sweep:
        report["sweeps"] = sweeps(args, sweep_names)
    _write(args.out, report)
    return 0


def isa_caps() -> list[str]:
    """`NAME=value` of each ISA_ENV variable set in this process."""
    return [f"{k}={shlex.quote(os.environ[k])}" for k in ISA_ENV if os.environ.get(k)]


def recorded_command(argv: list[str]) -> str:
    """The command line the tables name, with the instruction-set caps it ran under."""
    return " ".join([*isa_caps(), "exactlogp bench " + shlex.join(argv)])


def _names(option: str, value: str) -> list[str]:
    names = list(candidates.split_names(value))
    for name in names:
        try:
            candidates.create(name)
        except (ValueError, TypeError, ImportError, AttributeError) as exc:
            raise SystemExit(f"{option}: unknown candidate {name!r}: {exc}") from None
    return names


def _inputs(args, tokens: int, vocab: int):
    return llm_like_logits(tokens, vocab, DTYPES[args.dtype], args.seed, targets="uniform")


def time_candidates(names, x, target, repeats: int, seed: int) -> tuple[dict, dict]:
    """({name: {mode: Timing as a dict, or None}}, {name: why unavailable})."""
    with tp1_steps(names, x, target, skip_unavailable=True) as (steps, skipped):
        fns = {
            (name, mode): getattr(s, mode)
            for name, s in steps.items()
            for mode in MODES
            if getattr(s, mode) is not None
        }
        seconds = measure.interleaved(fns, repeats, seed=seed, warmup=1)
    rows = {
        name: {
            mode: vars(measure.Timing.of(seconds[name, mode])) if (name, mode) in seconds else None
            for mode in MODES
        }
        for name in steps
    }
    return rows, skipped


# --- the main shape ---


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _main_shape(args, names: list[str]) -> dict:
    x, target = _inputs(args, args.tokens, args.vocab)
    _log(f"timing {names} on {args.tokens} x {args.vocab} {args.dtype}, {args.repeats} repeats")
    rows, skipped = time_candidates(names, x, target, args.repeats, args.seed)
    for name, why in skipped.items():
        _log(f"{name} unavailable: {why}")
    if not args.no_memory:
        shape_args = _shape_args(args, args.tokens, args.vocab)
        for name in rows:
            for mode in MODES:
                if rows[name][mode] is not None:
                    _log(f"peak memory: {name} {mode}")
                    rows[name][mode]["peak_mib"] = child_peak_mib(name, mode, shape_args)
    report = {
        "shape": {"tokens": args.tokens, "vocab": args.vocab, "dtype": args.dtype},
        "threads": torch.get_num_threads(),
        "repeats": args.repeats,
        "seed": args.seed,
        "results": rows,
        "unavailable": skipped,
    }
    print(main_table(report))
    return report


def _shape_args(args, tokens: int, vocab: int) -> list[str]:
    out = ["--tokens", str(tokens), "--vocab", str(vocab), "--dtype", args.dtype]
    out += ["--seed", str(args.seed), "--threads", str(torch.get_num_threads())]
    return out


def child_peak_mib(name: str, mode: str, shape_args: list[str]) -> float | None:
    """Peak extra memory of one step of `name` in a fresh interpreter; None if it could not
    be measured. Its malloc maps every block of 64 KiB or more on its own, so memory the
    warm-up freed is given back and counted again instead of being reused."""
    cmd = [sys.executable, "-m", "exactlogp.bench.cpu", *shape_args, "--measure-memory", name, mode]
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    run = subprocess.run(cmd, capture_output=True, text=True, env=env)
    for line in reversed(run.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)["peak_mib"]
    return None


def _child_memory(args, name: str, mode: str) -> int:
    x, target = _inputs(args, args.tokens, args.vocab)
    with tp1_steps([name], x, target) as (steps, _):
        step = getattr(steps[name], mode)
        step()  # warm-up: lazy imports, the compiled kernels, thread pools
        memory = measure.PeakMemory(x.device)
        out = step()
        peak = memory.read()
        del out
    print(json.dumps({"peak_mib": peak}))
    return 0


def _ms(t: dict | None) -> str:
    if t is None:
        return "-"
    return f"{t['median'] * 1e3:.0f} ({t['low'] * 1e3:.0f}-{t['high'] * 1e3:.0f})"


def _ratio(rows: dict, name: str, other: str, mode: str) -> str:
    if other not in rows or rows[name][mode] is None or rows[other][mode] is None:
        return "-"
    return f"{rows[name][mode]['median'] / rows[other][mode]['median']:.2f}x"


def _mib(t: dict | None) -> str:
    peak = None if t is None else t.get("peak_mib")
    return "-" if peak is None else f"{peak:.0f}"


def main_table(report: dict) -> str:
    rows = report["results"]
    head = (
        f"| candidate | forward ms, median (min-max) | forward+backward ms | forward vs "
        f"{BASELINE} | fwd+bwd vs {BASELINE} | forward vs {EAGER} | fwd+bwd vs {EAGER} "
        "| peak extra MiB, forward | peak extra MiB, fwd+bwd |\n"
        "|---|---|---|---|---|---|---|---|---|"
    )
    lines = [head]
    for name, r in rows.items():
        fwd, both = r["forward"], r["forward_backward"]
        ratios = [_ratio(rows, name, other, m) for other in (BASELINE, EAGER) for m in MODES]
        lines.append(
            f"| {name} | {_ms(fwd)} | {_ms(both)} | {' | '.join(ratios)} "
            f"| {_mib(fwd)} | {_mib(both)} |"
        )
    return "\n".join(lines)


# --- where the time goes ---


def _median_seconds(fn, repeats: int) -> tuple[float, float]:
    """Median wall seconds and median CPU seconds (all threads of this process) of fn()."""
    wall, cpu = [], []
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.process_time()
        fn()
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    return sorted(wall)[len(wall) // 2], sorted(cpu)[len(cpu) // 2]


def profile(args) -> dict:
    """Median seconds of each pass of backend="cpu", with references for this machine's
    memory system: a copy into a buffer that is already mapped (bandwidth) and the first
    write of a fresh [N, V] tensor (page faults, which every candidate's outputs pay).
    The "direct loops" stages are the same passes with value tables off."""
    from .. import contract
    from ..backends import ShardPlan, get_backend
    from ..backends.cpu import CpuBackend

    x, target = _inputs(args, args.tokens, args.vocab)
    cpu = get_backend("cpu", x.device)
    direct = CpuBackend(num_threads=cpu.num_threads, value_tables="never")
    plan = ShardPlan(0, None, -100, False)
    row_max = cpu.row_max(x, ONE, None, plan)
    record = cpu.partials(x, target, ONE, None, row_max, plan)
    fin = contract.finalize(row_max, record, target, None, -100, None)
    stats = contract.grad_stats(row_max, fin, -torch.ones_like(fin.s_hi), None, None)
    mapped = torch.empty_like(x).fill_(0)
    stages = {
        "row_max pass": lambda: cpu.row_max(x, ONE, None, plan),
        "partials pass": lambda: cpu.partials(x, target, ONE, None, row_max, plan),
        "partials pass, with entropy": lambda: cpu.partials(
            x, target, ONE, None, row_max, ShardPlan(0, None, -100, True)
        ),
        "partials pass, direct loops": lambda: direct.partials(x, target, ONE, None, row_max, plan),
        "finalize": lambda: contract.finalize(row_max, record, target, None, -100, None),
        "grad pass (fresh output)": lambda: cpu.grad(x, target, ONE, None, stats, plan),
        "grad pass, direct loops (fresh output)": lambda: direct.grad(
            x, target, ONE, None, stats, plan
        ),
        "copy of the logits into a mapped buffer": lambda: mapped.copy_(x),
        "first write of a fresh [N, V] tensor": lambda: torch.empty_like(x).fill_(0),
    }
    measured = {name: _median_seconds(fn, args.repeats) for name, fn in stages.items()}
    seconds = {name: wall for name, (wall, _) in measured.items()}
    elements, nbytes, threads = x.numel(), x.numel() * x.element_size(), torch.get_num_threads()
    out = {
        "seconds": seconds,
        # CPU time is what the kernels used while they ran, so it tells compute cost apart
        # from the waiting a shared machine adds to wall time
        "cpu_ns_per_element": {name: c * 1e9 / elements for name, (_, c) in measured.items()},
        "read_GBps_row_max": nbytes / seconds["row_max pass"] / 1e9,
        "copy_GBps": 2 * nbytes / seconds["copy of the logits into a mapped buffer"] / 1e9,
        "threads": threads,
        "avx2": cpu.uses_avx2,
    }
    print(profile_table(out))
    return out


def profile_table(prof: dict) -> str:
    lines = ["| stage | wall ms (median) | CPU ns per element (all threads) |", "|---|---|---|"]
    for name, t in prof["seconds"].items():
        per = prof["cpu_ns_per_element"][name]
        lines.append(f"| {name} | {t * 1e3:.1f} | {per:.2f} |")
    lines.append(
        f"\nrow_max reads the logits at {prof['read_GBps_row_max']:.1f} GB/s; the copy moves "
        f"{prof['copy_GBps']:.1f} GB/s (read + write); {prof['threads']} threads, "
        f"AVX2 kernels: {prof['avx2']}."
    )
    return "\n".join(lines)


# --- sweeps ---


def sweeps(args, names: list[str]) -> dict:
    points = [("tokens", n, args.vocab) for n in SWEEP_TOKENS]
    points += [("vocab", args.tokens, v) for v in SWEEP_VOCAB]
    out: dict = {"repeats": args.sweep_repeats, "tokens": [], "vocab": []}
    for axis, n, v in points:
        _log(f"sweep {axis}: {n} x {v}")
        x, target = _inputs(args, n, v)
        results, _ = time_candidates(names, x, target, args.sweep_repeats, args.seed)
        del x, target
        out[axis].append({"tokens": n, "vocab": v, "results": results})
    return out


def sweep_table(points: list[dict], axis: str) -> str:
    names = list(points[0]["results"])
    head = f"| {axis} | " + " | ".join(f"{name} fwd ms | {name} fwd+bwd ms" for name in names)
    ratio_cols = BASELINE in names and OURS in names
    if ratio_cols:
        head += f" | {OURS} / {BASELINE} fwd | {OURS} / {BASELINE} fwd+bwd"
    lines = [head + " |", "|" + "---|" * (1 + 2 * len(names) + 2 * ratio_cols)]
    for p in points:
        r = p["results"]
        cells = [str(p[axis])]
        for name in names:
            cells += [_ms(r[name]["forward"]), _ms(r[name]["forward_backward"])]
        if ratio_cols:
            cells += [_ratio(r, OURS, BASELINE, m) for m in MODES]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_sweeps(report: dict, path: Path) -> None:
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sw = report["sweeps"]
    fig, axes = plt.subplots(2, 2, figsize=(12, 8.5), sharex="col")
    for col, axis in enumerate(("tokens", "vocab")):
        points = sw[axis]
        xs = [p[axis] for p in points]
        ax = axes[0][col]
        for name in points[0]["results"]:
            for mode, style in (("forward", "-"), ("forward_backward", "--")):
                if any(p["results"][name][mode] is None for p in points):
                    continue
                ys = [p["results"][name][mode]["median"] * 1e3 for p in points]
                ax.plot(xs, ys, style, marker="o", label=f"{name} {mode.replace('_', '+')}")
        ax.set(xscale="log", yscale="log", ylabel="ms (median)")
        ax.set_xticks(xs, [str(v) for v in xs], minor=False)
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax.set_title(f"sweep over {axis}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
        ratio = axes[1][col]
        if BASELINE in points[0]["results"] and OURS in points[0]["results"]:
            for mode, target in (("forward", 0.5), ("forward_backward", 0.7)):
                ys = [
                    p["results"][OURS][mode]["median"] / p["results"][BASELINE][mode]["median"]
                    for p in points
                ]
                line = ratio.plot(xs, ys, marker="o", label=f"{mode.replace('_', '+')}")[0]
                ratio.axhline(target, color=line.get_color(), ls=":", label=f"target {target}x")
        ratio.set(xscale="log", xlabel=axis, ylabel=f"{OURS} / {BASELINE}", ylim=(0, None))
        ratio.set_xticks(xs, [str(v) for v in xs], minor=False)
        ratio.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ratio.grid(True, which="both", alpha=0.3)
        ratio.legend(fontsize=7)
    m = report["machine"]
    fig.suptitle(
        f"{m['cpu']}, {m['cores']} cores, {report['threads']} threads, {report['shape']['dtype']}"
        f", median of {sw['repeats']} shuffled runs per point"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --- the goal rows ---


@dataclass(frozen=True)
class GoalRow:
    label: str
    tokens: int
    vocab: int
    dtype: str  # a key of DTYPES, or "fp32-of-bf16": bf16 logits cast to fp32
    goal: str  # what the row is held to (shown in the table)
    logits: str = "llm"  # "llm" (llm_like_logits) or "student_t" (heavy_tailed_logits)
    temperature: float = 1.0
    repeats: int = 11

    def candidates(self) -> dict[str, str]:
        """{role: candidate name}: ours, ours with entropy, eager and compiled torch."""
        tau = "" if self.temperature == 1.0 else f"temperature={self.temperature:g}"
        join = lambda *p: ",".join(x for x in p if x)  # noqa: E731
        return {
            "ours": f"exactlogp[{join('cpu', tau)}]",
            "entropy": f"exactlogp[{join('cpu', 'entropy', tau)}]",
            "eager": f"torch_full[{join('row_block=all', tau)}]",
            "compiled": f"torch_compile[{tau}]" if tau else "torch_compile",
        }


GOAL_ROWS = (
    # the host path alone: a call whose work is a few hundred nanoseconds
    GoalRow("host path 1 x 64", 1, 64, "bf16", "fwd <= 5x eager", repeats=2000),
    GoalRow("1 token", 1, 151936, "bf16", "fwd <= 1.5x eager", repeats=300),
    GoalRow("8 tokens", 8, 32000, "bf16", "fwd <= 1.5x eager", repeats=300),
    GoalRow("decode batch", 64, 151936, "bf16", "fwd well below eager", repeats=20),
    GoalRow("Qwen bf16", 1024, 151936, "bf16", "fwd <= 0.6x compiled"),
    GoalRow("Qwen fp16", 1024, 151936, "fp16", "fwd <= 0.8x compiled"),
    GoalRow("Qwen fp32", 1024, 151936, "fp32", "fwd <= 1.5x compiled"),
    GoalRow("Qwen fp32 of bf16 values", 1024, 151936, "fp32-of-bf16", "as bf16"),
    GoalRow("tau 0.05", 512, 151936, "bf16", "fast", temperature=0.05),
    GoalRow("Student-t", 512, 151936, "bf16", "fast", logits="student_t"),
)


def goal_inputs(row: GoalRow, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    dtype = torch.bfloat16 if row.dtype == "fp32-of-bf16" else DTYPES[row.dtype]
    draw = heavy_tailed_logits if row.logits == "student_t" else llm_like_logits
    kw = {} if row.logits == "student_t" else {"targets": "uniform"}
    x, target = draw(row.tokens, row.vocab, dtype, seed, **kw)
    return (x.float() if row.dtype == "fp32-of-bf16" else x), target


def goals(args, command: str) -> int:
    """Time every goal row's candidates interleaved, write cpu_goals.md and the JSON."""
    from ..backends import get_backend

    labels = [x.strip() for x in args.goal_rows.split(",") if x.strip()]
    rows = [r for r in GOAL_ROWS if not labels or r.label in labels]
    unknown = set(labels) - {r.label for r in rows}
    if unknown:
        raise SystemExit(
            f"--goal-rows: unknown {sorted(unknown)}; one of {[r.label for r in GOAL_ROWS]}"
        )
    results = []
    for row in rows:
        names = row.candidates()
        _log(f"goal row {row.label}: {row.tokens} x {row.vocab} {row.dtype}, {row.repeats} repeats")
        x, target = goal_inputs(row, args.seed)
        timed, skipped = time_candidates(list(names.values()), x, target, row.repeats, args.seed)
        del x, target
        results.append({"row": vars(row), "names": names, "results": timed, "unavailable": skipped})
    report = {
        "command": command,
        "machine": machine(),
        "threads": torch.get_num_threads(),
        "isa": getattr(get_backend("cpu", torch.device("cpu")), "isa", "?"),
        "seed": args.seed,
        "goals": results,
    }
    (args.out / "cpu_goals.json").write_text(json.dumps(report, indent=1) + "\n")
    text = goals_markdown(report)
    (args.out / "cpu_goals.md").write_text(text)
    print(text)
    return 0


def _goal_timing(g: dict, role: str, mode: str) -> dict | None:
    return g["results"].get(g["names"][role], {}).get(mode)


def _goal_ms(g: dict, role: str, mode: str) -> str:
    t = _goal_timing(g, role, mode)
    return "-" if t is None else f"{t['median'] * 1e3:.3g}"


def _goal_ratio(g: dict, role: str, other: str, mode: str) -> str:
    a, b = _goal_timing(g, role, mode), _goal_timing(g, other, mode)
    return "-" if a is None or b is None else f"{a['median'] / b['median']:.2f}x"


def goals_table(report: dict) -> str:
    """One line per goal row: our medians and the ratios to eager and compiled torch."""
    head = (
        "| row | shape | ours fwd ms | eager fwd ms | compiled fwd ms | fwd / eager "
        "| fwd / compiled | with entropy fwd / compiled | ours fwd+bwd ms | fwd+bwd / eager "
        "| fwd+bwd / compiled | with entropy fwd+bwd / compiled | goal |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|"
    )
    lines = [head]
    for g in report["goals"]:
        row = g["row"]
        shape = f"{row['tokens']} x {row['vocab']} {row['dtype']}"
        shape += "" if row["temperature"] == 1.0 else f", tau {row['temperature']:g}"
        shape += ", Student-t" if row["logits"] == "student_t" else ""
        cells = [row["label"], shape]
        for mode in MODES:
            cells.append(_goal_ms(g, "ours", mode))
            if mode == "forward":
                cells += [_goal_ms(g, "eager", mode), _goal_ms(g, "compiled", mode)]
            cells += [_goal_ratio(g, "ours", other, mode) for other in ("eager", "compiled")]
            cells.append(_goal_ratio(g, "entropy", "compiled", mode))
        lines.append("| " + " | ".join(cells + [row["goal"]]) + " |")
    return "\n".join(lines)


def goals_markdown(report: dict) -> str:
    m = report["machine"]
    versions = ", ".join(f"{k} {v}" for k, v in m["versions"].items())
    return "\n".join([
        "# CPU goal rows: exactlogp[cpu] against eager torch and torch.compile",
        "",
        f"Command: `{report['command']}`  ",
        f"Machine: {m['cpu']}, {m['cores']} cores, torch threads {report['threads']}, "
        f"exactlogp CPU kernels built for {report['isa']}, {versions}, {m['date']}  ",
        "Medians of interleaved runs (each round runs every candidate and mode once, in an "
        "order shuffled per round); ours = exactlogp[cpu], eager = torch_full[row_block=all], "
        "compiled = torch_compile (with the row's temperature where it has one).",
        "",
        goals_table(report),
        "",
    ])  # fmt: skip


# --- the report files ---


def machine() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        cpu = next(
            (
                ln.split(":", 1)[1].strip()
                for ln in lscpu.splitlines()
                if ln.startswith("Model name")
            ),
            cpu,
        )
    except OSError:
        pass
    versions = {"torch": torch.__version__}
    try:
        from importlib.metadata import version

        versions["megatron-core"] = version("megatron-core")
    except Exception:  # not installed: the candidate is simply absent
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "versions": versions,
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
    }


def _write(out: Path, report: dict) -> None:
    (out / "cpu_results.json").write_text(json.dumps(report, indent=1) + "\n")
    m, s = report["machine"], report["shape"]
    text = [
        f"# CPU benchmark: {s['tokens']} x {s['vocab']} {s['dtype']}, TP 1",
        "",
        f"Command: `{report['command']}`  ",
        f"Machine: {m['cpu']}, {m['cores']} cores, torch threads {report['threads']}, "
        f"{', '.join(f'{k} {v}' for k, v in m['versions'].items())}, {m['date']}  ",
        f"Median of {report['repeats']} runs, the order of the candidates shuffled per run "
        f"(seed {report['seed']}; min-max in brackets); peak extra "
        "memory = peak RSS of a fresh process during one step minus its RSS before the step.",
        "",
        main_table(report),
        "",
    ]
    if "profile" in report:
        text += [
            "## Where the time goes (backend passes)",
            "",
            profile_table(report["profile"]),
            "",
        ]
    (out / "cpu_main.md").write_text("\n".join(text))
    if "sweeps" in report:
        sw = report["sweeps"]
        text = [
            "# CPU benchmark sweeps",
            "",
            f"Command: `{report['command']}`  ",
            f"Machine: {m['cpu']}, {m['cores']} cores, torch threads {report['threads']}  ",
            f"Median of {sw['repeats']} shuffled runs per point (min-max in brackets).",
            "",
            f"## tokens (vocab {report['shape']['vocab']})",
            "",
            sweep_table(sw["tokens"], "tokens"),
            "",
            f"## vocab (tokens {report['shape']['tokens']})",
            "",
            sweep_table(sw["vocab"], "vocab"),
            "",
        ]
        (out / "cpu_sweep.md").write_text("\n".join(text))
        plot_sweeps(report, out / "cpu_sweep.png")
    _log(f"wrote {out}")


if __name__ == "__main__":
    sys.exit(main())
