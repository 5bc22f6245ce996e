"""What the person running the report sees: a rich progress display while it runs, a
table at the end, and the Markdown summary written next to the JSON."""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

BASE_COLUMNS = (
    "candidate",
    "implementation",
    "TP == TP1",
    "settings",
    "batch",
    "distinct",
    "max abs vs fp64",
    "max ulp vs fp64",
)


def columns(report: dict) -> list[str]:
    return [*BASE_COLUMNS, *(f"TP{tp} median ms" for tp in report["tp"]), "peak MiB/rank"]


class RichDisplay:
    """The runner's display: one progress line per candidate and TP degree (or phase).

    A terminal gets live progress bars; a log file or pipe gets one plain line per
    finished task instead (a live display there would print every bar again when it stops).
    """

    def __init__(self, console: Console):
        self.console = console
        self.progress = Progress(
            TextColumn("{task.description:<34}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.fields[status]}"),
            console=console,
        )

    def __enter__(self):
        if self.console.is_terminal:
            self.progress.start()
        return self

    def __exit__(self, *exc):
        if self.console.is_terminal:
            self.progress.stop()

    def start(self, label: str, total: int):
        # names like "exactlogp[cpu]" must not be read as rich markup
        return self.progress.add_task(escape(label), total=total, status="")

    def advance(self, task, done: int, what: str) -> None:
        self.progress.update(task, completed=done, status=escape(what))

    def finish(self, task, status: str) -> None:
        info = self.progress.tasks[task]
        self.progress.update(task, completed=info.total, status=escape(status))
        if not self.console.is_terminal:
            self.console.print(f"{info.description}: {escape(status)}")


def _mark(value) -> str:
    return {True: "yes", False: "NO", None: "-"}[value]


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def rows(report: dict) -> list[list[str]]:
    """One row of strings per candidate, in the report's order."""
    width = len(columns(report))
    out = []
    for name, e in report["candidates"].items():
        if "unavailable" in e:
            out.append([name, "unavailable: " + e["unavailable"]] + [""] * (width - 2))
            continue
        tp_eq = e["tp_equals_tp1"]
        row = [
            name,
            e["implementation"],
            _mark(all(tp_eq.values()) if tp_eq else None),
            _mark(e["nccl_setting_invariant"]),
            _mark(e["batch_bitwise"]),
            _fmt(e["distinct_results_in_repeats"], "d"),
            _fmt(e["max_abs_vs_fp64"], ".3g"),
            _fmt(e["max_ulp_vs_fp64"], ".3g"),
        ]
        for tp in report["tp"]:
            lat = e["latency_us"].get(str(tp))
            err = e.get("errors", {}).get(str(tp))
            row.append(f"{lat['median'] / 1000:.1f}" if lat else ("error" if err else "-"))
        peaks = [p for per in e["peak_memory_mib_per_rank"].values() for p in per if p is not None]
        row.append(f"{max(peaks):.0f}" if peaks else "-")
        out.append(row)
    return out


def table(report: dict) -> Table:
    t = Table(title=escape(_title(report)))
    for col in columns(report):
        t.add_column(col)
    for row in rows(report):
        t.add_row(*(escape(cell) for cell in row))
    return t


def _title(report: dict) -> str:
    return (
        f"{report['tokens']} x {report['vocab']} {report['dtype']}, TP {report['tp']}, "
        f"{report['collective_backend']}, {report['environment']['device']}"
    )


def markdown(report: dict) -> str:
    env = report["environment"]
    lines = [
        "# exactlogp conformance report",
        "",
        f"- created: {report['created']} on {env['device']} ({env['cpu_count']} CPUs), "
        f"torch {env['torch']}, Python {env['python']}",
        f"- command: `{report['command']}` ({report['wall_s']:.0f} s)",
        f"- workload: {report['tokens']} tokens x {report['vocab']} vocabulary, "
        f"{report['dtype']}; {report['workload']['distribution']}",
        f"- collectives: {report['collective_backend']}, TP {report['tp']}, "
        f"launcher {report['launcher']}; project commit {report['project_commit']}"
        + (" (tracked tree dirty)" if report["tracked_tree_dirty"] else ""),
        "",
        "| " + " | ".join(columns(report)) + " |",
        "|" + "---|" * len(columns(report)),
    ]
    lines += ["| " + " | ".join(r) + " |" for r in rows(report)]
    lines += ["", *findings(report), "", *_notes(report)]
    return "\n".join(lines) + "\n"


def findings(report: dict) -> list[str]:
    """What the table says, in words: who is invariant on every axis, who is closest to fp64."""
    measured = {n: e for n, e in report["candidates"].items() if "unavailable" not in e}
    axes = ("nccl_setting_invariant", "batch_bitwise")
    invariant = [
        n
        for n, e in measured.items()
        if e["tp_equals_tp1"]
        and all(e["tp_equals_tp1"].values())
        and all(e[a] is True for a in axes)
        and e["distinct_results_in_repeats"] == 1
    ]
    scored = {
        n: e["max_abs_vs_fp64"] for n, e in measured.items() if e["max_abs_vs_fp64"] is not None
    }
    lines = [
        "- invariant on every axis measured (TP, settings, batch, repeats): "
        + (", ".join(invariant) or "none")
    ]
    if scored:
        best = min(scored, key=scored.get)
        ulp = measured[best]["max_ulp_vs_fp64"]
        lines.append(f"- smallest error vs fp64: {best} ({scored[best]:.3g}, {ulp:.3g} ulp)")
    return lines


def _notes(report: dict) -> list[str]:
    method = report["method"]
    settings = ", ".join(s["name"] for s in report["nccl_settings"])
    notes = [
        "TP == TP1, settings, batch and distinct are bitwise checks (yes = identical bits, "
        "distinct = different outputs over the repeats); max abs / max ulp are against the "
        "fp64 truth of the shared logits (ulps: fp32 ulps of the true value); latency is the "
        f"median of {method['timed_runs']} timed runs after {method['warmup_runs']} warm-up; "
        "peak MiB/rank is the largest per-rank peak of extra memory.",
        "",
        f"- settings ({'emulated on gloo' if report['nccl_settings_emulated'] else 'NCCL'}): "
        f"{settings}. {method['nccl_setting_invariant']}.",
        f"- batch: {method['batch_bitwise']} ({len(method['check_rows'])} check rows).",
        f"- repeats: {method['repeats']}.",
        f"- workers: {method['worlds']}; threads per rank by TP: "
        f"{report['environment']['threads_per_rank']}.",
    ]
    for name, e in report["candidates"].items():
        if "unavailable" in e:
            continue
        note = f"- {name}: {e['summary']}"
        if e.get("note"):
            note += f" ({e['note']})"
        for tp, err in e.get("errors", {}).items():
            note += f"; TP{tp} error: {err}"
        notes.append(note)
    return notes


def print_summary(console: Console, report: dict, json_path: str, md_path: str) -> None:
    if not console.is_terminal:
        console.width = max(console.width, 180)  # a file or pipe gets the whole table
    console.print(table(report))
    console.print(f"wrote {json_path} and {md_path} in {report['wall_s']:.0f} s")
