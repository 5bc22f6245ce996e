"""From the raw per-world measurements to the report's verdicts (same keys as the seed).

Bitwise verdicts compare fp32 bit patterns (never a tolerance); accuracy is measured
against the fp64 ground truth of the candidate's workload (the shared logits, or the LM
head of the shared hidden states), in absolute terms and in fp32 ulps of the true value.
"""

from __future__ import annotations

import torch

from ..testing import ulp32
from .measure import Timing

# the fp64 truth of each workload, by the name the report gives it
REFERENCES = {"logits": "shared_logits_fp64", "hidden_states": "lm_head_fp64"}
OURS = ("exactlogp", "exactlogp_linear")  # our rows; "NAME[BACKEND]" pins a backend


def differing_rows(a: torch.Tensor, b: torch.Tensor) -> int:
    """Rows (elements) of two (N,) outputs whose fp32 bits differ."""
    a = a.detach().to(torch.float32).contiguous().view(torch.int32)
    b = b.detach().to(torch.float32).contiguous().view(torch.int32)
    return int((a != b).sum())


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and differing_rows(a, b) == 0


def accuracy(out: torch.Tensor, reference: torch.Tensor) -> tuple[float, float]:
    """(max |out - truth|, max |out - truth| in fp32 ulps of the truth)."""
    err = (out.to(torch.float64) - reference).abs()
    return float(err.max()), float((err / ulp32(reference)).max())


def latency(times_s: list[float]) -> dict:
    t = Timing.of([s * 1e6 for s in times_s])
    return {"median": t.median, "p10": t.p10, "p90": t.p90, "runs": t.runs}


def candidate_entry(
    info: dict, per_tp: dict[int, dict], reference: torch.Tensor, reference_name: str
) -> dict:
    """The report entry of one candidate from its worlds' results, keyed by TP degree.

    `per_tp[tp]` is the world's result or {"error": text}; `info` is what the candidate
    says about itself; `reference` is the (N,) fp64 truth of its workload.
    """
    entry = dict(info)
    ok = {tp: r for tp, r in per_tp.items() if "error" not in r}
    errors = {str(tp): r["error"] for tp, r in per_tp.items() if "error" in r}
    entry["tp_measured"] = sorted(ok)
    if errors:
        entry["errors"] = errors
        tracebacks = {str(tp): r["traceback"] for tp, r in per_tp.items() if r.get("traceback")}
        if tracebacks:
            entry["tracebacks"] = tracebacks
    entry.update(_tp_verdicts(ok))
    entry.update(_settings_verdict(ok))
    entry.update(_batch_verdict(ok))
    entry.update(_repeat_verdict(ok))
    entry["reference"] = reference_name
    entry.update(_accuracy(ok, reference))
    for tp, r in sorted(ok.items()):
        entry[f"latency_us_tp{tp}"] = latency(r["times_s"])["median"]
    entry["latency_us"] = {str(tp): latency(r["times_s"]) for tp, r in sorted(ok.items())}
    entry["peak_memory_mib_per_rank"] = {
        str(tp): r["peak_memory_mib_per_rank"] for tp, r in sorted(ok.items())
    }
    entry["padded_vocab"] = {str(tp): r["padded_vocab"] for tp, r in sorted(ok.items())}
    entry["measure_wall_s"] = {
        str(tp): r["wall_s"] for tp, r in sorted(ok.items()) if "wall_s" in r
    }
    return entry


def _tp_verdicts(ok: dict) -> dict:
    base = ok.get(1)
    others = sorted(tp for tp in ok if tp != 1)
    if base is None or not others:
        return {"tp4_equals_tp1": None, "tp_equals_tp1": {}}
    eq = {str(tp): bits_equal(ok[tp]["out"], base["out"]) for tp in others}
    return {"tp4_equals_tp1": eq.get("4"), "tp_equals_tp1": eq}


def _settings_verdict(ok: dict) -> dict:
    detail = {
        str(tp): r["settings"]["mismatched_rows"] for tp, r in sorted(ok.items()) if "settings" in r
    }
    counts = {
        str(tp): r["settings"]["float_all_reduces_per_call"]
        if "settings" in r
        else r["float_all_reduces_per_call"]
        for tp, r in sorted(ok.items())
    }
    verdict = None
    if detail:
        verdict = all(n == 0 for per in detail.values() for n in per.values())
    return {
        "nccl_setting_invariant": verdict,
        "nccl_settings_mismatched_rows": detail,
        "float_all_reduces_per_call": counts,
    }


def _batch_verdict(ok: dict) -> dict:
    detail = {str(tp): r["batch"] for tp, r in sorted(ok.items())}
    verdict = all(n == 0 for per in detail.values() for n in per.values()) if detail else None
    return {"batch_bitwise": verdict, "batch_mismatched_rows": detail}


def _repeat_verdict(ok: dict) -> dict:
    if not ok:
        return {"distinct_results_in_repeats": None, "repeats": None, "ranks_agree": None}
    distinct = max(len(set(r["hashes"])) for r in ok.values())
    repeats = min(len(r["times_s"]) for r in ok.values())
    return {
        "distinct_results_in_repeats": distinct,
        "repeats": repeats,
        "ranks_agree": all(r["ranks_agree"] for r in ok.values()),
    }


def _accuracy(ok: dict, reference: torch.Tensor) -> dict:
    if not ok:
        return {"max_abs_vs_fp64": None, "max_ulp_vs_fp64": None}
    per_tp = {tp: accuracy(r["out"], reference) for tp, r in ok.items()}
    return {
        "max_abs_vs_fp64": max(a for a, _ in per_tp.values()),
        "max_ulp_vs_fp64": max(u for _, u in per_tp.values()),
    }


def pairwise_max_abs(outs: dict[str, dict[int, torch.Tensor]]) -> dict[str, dict[str, float]]:
    """name -> {other: max |a - b| over the TP degrees both measured}."""
    table: dict[str, dict[str, float]] = {name: {} for name in outs}
    names = list(outs)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            common = set(outs[a]) & set(outs[b])
            if not common:
                continue
            diff = max(
                float((outs[a][tp].double() - outs[b][tp].double()).abs().max()) for tp in common
            )
            table[a][b] = table[b][a] = diff
    return table


def exactlogp_failures(entries: dict[str, dict]) -> list[str]:
    """Every invariance (or run) one of our rows (exactlogp, exactlogp_linear and their
    pinned-backend rows) failed, as readable lines; [] when none."""
    failures = []
    for name, e in entries.items():
        if name.split("[", 1)[0] not in OURS:
            continue
        if "unavailable" in e:
            failures.append(f"{name}: unavailable: {e['unavailable']}")
            continue
        for tp, err in e.get("errors", {}).items():
            failures.append(f"{name} tp{tp}: {err}")
        for tp, eq in e["tp_equals_tp1"].items():
            if not eq:
                failures.append(f"{name}: TP{tp} != TP1")
        for key in ("nccl_setting_invariant", "batch_bitwise", "ranks_agree"):
            if e.get(key) is False:
                failures.append(f"{name}: {key} is false")
        if (e.get("distinct_results_in_repeats") or 1) > 1:
            failures.append(f"{name}: {e['distinct_results_in_repeats']} distinct results")
        if e.get("bitwise_equal_to_exactlogp") is False:
            failures.append(f"{name}: differs from the auto backend")
    return failures
