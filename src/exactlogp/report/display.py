"""What the person running the report sees: a rich progress display while it runs, a
table per workload at the end (the shared logits; the hidden states of the fused LM-head
rows), and the Markdown summary written next to the JSON."""

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


def workload_of(entry: dict) -> str:
    """The workload a report entry belongs to (a row unavailable before it was created has
    none: it is listed with the logits rows)."""
    return entry.get("workload", "logits")


def rows(report: dict, workload: str = "logits") -> list[list[str]]:
    """One row of strings per candidate of `workload`, in the report's order."""
    width = len(columns(report))
    out = []
    for name, e in report["candidates"].items():
        if workload_of(e) != workload:
            continue
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


def table(report: dict, workload: str = "logits") -> Table:
    t = Table(title=escape(_title(report, workload)))
    for col in columns(report):
        t.add_column(col)
    for row in rows(report, workload):
        t.add_row(*(escape(cell) for cell in row))
    return t


def workloads(report: dict) -> list[str]:
    """The workloads the report has rows of, the logits first."""
    kinds = {workload_of(e) for e in report["candidates"].values()}
    return [k for k in ("logits", "hidden_states") if k in kinds]


def _title(report: dict, workload: str = "logits") -> str:
    if workload == "logits":
        shape = f"{report['tokens']} x {report['vocab']} {report['dtype']}"
    else:
        hs = report["hidden_states"]
        shape = (
            f"hidden states {hs['tokens']} x {hs['hidden']}, LM head {hs['vocab']} x "
            f"{hs['hidden']} {hs['dtype']}"
        )
    return (
        f"{shape}, TP {report['tp']}, {report['collective_backend']}, "
        f"{report['environment']['device']}"
    )


def _table_lines(report: dict, workload: str) -> list[str]:
    return [
        "| " + " | ".join(columns(report)) + " |",
        "|" + "---|" * len(columns(report)),
        *("| " + " | ".join(r) + " |" for r in rows(report, workload)),
    ]


def markdown(report: dict, plot: str | None = None) -> str:
    """The summary; `plot` is the file name of the fused LM-head plot next to it, if any."""
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
        *_table_lines(report, "logits"),
    ]
    lines += ["", *findings(report), "", *_notes(report)]
    if "hidden_states" in workloads(report):
        lines += ["", *_hidden_section(report, plot)]
    if "processed" in report:
        lines += ["", *_processed_section(report["processed"])]
    return "\n".join(lines) + "\n"


def processed_columns(processed: dict) -> list[str]:
    tp = processed["tp"]
    return [
        "row",
        "implementation",
        f"cut TP{tp} == TP1",
        f"logprobs TP{tp} == TP1",
        "batch",
        "distinct",
        "rows cut != fp64 cut",
        "dropped targets",
        "max abs vs fp64",
        "max ulp vs fp64",
        "mean abs vs fp64",
    ]


def processed_rows(processed: dict) -> list[list[str]]:
    width = len(processed_columns(processed))
    out = []
    for name, e in processed["rows"].items():
        if "unavailable" in e:
            out.append([name, "unavailable: " + e["unavailable"]] + [""] * (width - 2))
            continue
        out.append(
            [
                name,
                e["implementation"],
                _mark(e["cut_tp_equals_tp1"]),
                _mark(e["logprobs_tp_equals_tp1"]),
                _mark(e["batch_bitwise"]),
                str(e["distinct_results_in_repeats"]),
                f"{e['rows_cut_differs_from_truth']}/{processed['tokens']}",
                str(e["dropped_targets"]),
                _fmt(e["max_abs_vs_fp64"], ".3g"),
                _fmt(e["max_ulp_vs_fp64"], ".3g"),
                _fmt(e["mean_abs_log_ratio_vs_fp64"], ".3g"),
            ]
        )
    return out


def _processed_title(p: dict) -> str:
    return (
        f"Processed logprobs: {p['tokens']} x {p['vocab']} {p['dtype']}, temperature "
        f"{p['temperature']}, min-p {p['min_p']}, top-k {p['top_k']}, top-p {p['top_p']}, "
        f"TP {p['tp']} vs 1 (gloo)"
    )


def processed_table(processed: dict) -> Table:
    t = Table(title=escape(_processed_title(processed)))
    for col in processed_columns(processed):
        t.add_column(col)
    for row in processed_rows(processed):
        t.add_row(*(escape(cell) for cell in row))
    return t


def _processed_section(p: dict) -> list[str]:
    cols = processed_columns(p)
    return [
        f"## {_processed_title(p)}",
        "",
        "| " + " | ".join(cols) + " |",
        "|" + "---|" * len(cols),
        *("| " + " | ".join(r) + " |" for r in processed_rows(p)),
        "",
        f"- truth: {p['truth']}; targets drawn from it (seeded); the cut bites on "
        f"{p['rows_in_workload_cut_by_truth']} of {p['tokens']} rows.",
        "- cut / logprobs TP == TP1: the kept set and the logprobs at TP "
        f"{p['tp']} (vocabulary shards) bit for bit against TP 1; batch: each of the "
        f"{p['check_rows']} check rows alone against the batch; distinct: different "
        f"outputs over {p['repeats']} repeats; rows cut != fp64 cut: rows whose kept set "
        "differs from the fp64 truth's; dropped targets: targets outside the row's own "
        "kept set (logprob -inf, left out of the errors); mean abs vs fp64: the mean "
        "|log r| against the truth: for the unnormalised replay its log S bias (plus, for a "
        "bf16 row on CPU, TRL's bf16 rounding).",
    ]


def _hidden_section(report: dict, plot: str | None) -> list[str]:
    hs = report["hidden_states"]
    lines = [
        "## Fused LM head: from hidden states",
        "",
        f"- workload: {hs['workload']['distribution']}",
        f"- truth: {hs['reference']['method']}",
        f"- {len(hs['check_rows'])} check rows of the batch and setting checks; the other "
        "columns as above",
        "",
        *_table_lines(report, "hidden_states"),
        "",
        *findings(report, "hidden_states"),
    ]
    if plot:
        lines += ["", f"![latency and error vs fp64 of the fused LM-head rows]({plot})"]
    lines.append("")
    lines += _candidate_notes(report, "hidden_states")
    return lines


def findings(report: dict, workload: str = "logits") -> list[str]:
    """What a table says, in words: who is invariant on every axis, who is closest to fp64."""
    measured = {
        n: e
        for n, e in report["candidates"].items()
        if "unavailable" not in e and workload_of(e) == workload
    }
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
    return notes + _candidate_notes(report, "logits")


def _candidate_notes(report: dict, workload: str) -> list[str]:
    """What each measured candidate of `workload` runs, and its errors."""
    notes = []
    for name, e in report["candidates"].items():
        if "unavailable" in e or workload_of(e) != workload:
            continue
        note = f"- {name}: {e['summary']}"
        if e.get("note"):
            note += f" ({e['note']})"
        for tp, err in e.get("errors", {}).items():
            note += f"; TP{tp} error: {err}"
        notes.append(note)
    return notes


def print_summary(console: Console, report: dict, paths: list[str]) -> None:
    if not console.is_terminal:
        console.width = max(console.width, 180)  # a file or pipe gets the whole table
    for workload in workloads(report):
        console.print(table(report, workload))
    if "processed" in report:
        console.print(processed_table(report["processed"]))
    console.print(f"wrote {', '.join(paths)} in {report['wall_s']:.0f} s")
