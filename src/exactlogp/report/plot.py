"""The fused LM-head rows in one picture, written next to the report: each candidate's
median latency per TP degree (left) and its largest error vs the fp64 truth (right), both
on log scales. Needs matplotlib (the `report` extra)."""

from __future__ import annotations

import math

from .display import workload_of


def fused_rows(report: dict) -> dict[str, dict]:
    """The measured candidates of the hidden-state workload, in the report's order."""
    return {
        name: e
        for name, e in report["candidates"].items()
        if "unavailable" not in e and workload_of(e) == "hidden_states"
    }


def write_fused_plot(report: dict, path: str) -> bool:
    """Write the PNG; False (and nothing written) when no fused row was measured."""
    from matplotlib.figure import Figure

    rows = fused_rows(report)
    if not rows:
        return False
    names = list(rows)
    tps = report["tp"]
    fig = Figure(figsize=(12, 1.6 + 0.55 * len(names)), layout="constrained")
    lat, err = fig.subplots(1, 2, sharey=True)
    height = 0.8 / len(tps)
    ms = {tp: [_median_ms(rows[n], tp) for n in names] for tp in tps}  # nan: not measured
    for i, tp in enumerate(tps):
        ys = [y + (i - (len(tps) - 1) / 2) * height for y in range(len(names))]
        bars = lat.barh(ys, [0 if math.isnan(v) else v for v in ms[tp]], height, label=f"TP{tp}")
        lat.bar_label(bars, [_ms_label(v) for v in ms[tp]], fontsize=7)
    _room_for_labels(lat, [v for values in ms.values() for v in values])
    lat.set_xlabel("median latency, ms (log scale)")
    lat.legend(fontsize=8)
    errors = [rows[n]["max_abs_vs_fp64"] or float("nan") for n in names]
    bars = err.barh(range(len(names)), errors, 0.6, color="tab:red")
    err.bar_label(bars, [f"{e:.2g}" for e in errors], fontsize=7)
    _room_for_labels(err, errors)
    err.set_xlabel("max |logprob - fp64 truth| (log scale)")
    lat.set_yticks(range(len(names)), names)
    lat.invert_yaxis()
    hs = report["hidden_states"]
    fig.suptitle(
        f"Fused LM head: {hs['tokens']} x {hs['hidden']} hidden states, {hs['vocab']} x "
        f"{hs['hidden']} head, {hs['dtype']}; {report['environment']['device']}",
        fontsize=10,
    )
    fig.savefig(path, dpi=120)
    return True


def _room_for_labels(ax, values: list[float]) -> None:
    """A log x axis that leaves room right of the longest bar for its label."""
    ax.set_xscale("log")
    positive = [v for v in values if v > 0]  # nan compares False
    if positive:
        ax.set_xlim(min(positive) / 3, max(positive) * 4)


def _ms_label(ms: float) -> str:
    return "" if math.isnan(ms) else f"{ms:.0f}" if ms >= 100 else f"{ms:.3g}"


def _median_ms(entry: dict, tp: int) -> float:
    lat = entry["latency_us"].get(str(tp))
    return lat["median"] / 1000 if lat else float("nan")
