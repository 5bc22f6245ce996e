"""The report dictionary: header facts, per-candidate verdicts and the method notes."""

from __future__ import annotations

import datetime
import time

from .. import __version__
from ..contract import CONTRACT
from . import candidates, checks, environment, schema, workload
from .candidates.exactlogp import PINNED_TIMED_RUNS
from .session import Session

KIND = "logprob_conformance"
SCHEMA_VERSION = 1


def assemble(s: Session) -> dict:
    """The validated report of a finished session."""
    infos = {name: candidates.create(name) for name in s.runnable}
    entries = dict(s.entries)
    for name, cand in infos.items():
        kind = s.kinds[name]
        entries[name] = {
            **checks.candidate_entry(
                cand.describe(), s.results[name], s.data[kind].reference, checks.REFERENCES[kind]
            ),
            "workload": kind,
        }
    _cross_candidate(entries, s, infos)
    opts = s.opts
    logits = s.data["logits"]
    commit, dirty = environment.project_git_state()
    report = {
        "kind": KIND,
        "schema_version": SCHEMA_VERSION,
        "contract": CONTRACT,
        "exactlogp_version": __version__,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": opts.command,
        "project_commit": commit,
        "tracked_tree_dirty": dirty,
        "environment": environment.environment(s.device, s.backend, s.threads),
        "third_party": _third_party(infos.values()),
        "tokens": opts.tokens,
        "vocab": opts.vocab,
        "dtype": opts.dtype,
        "collective_backend": s.backend,
        "launcher": s.launcher,
        "tp": s.tps,
        "tp_requested": sorted(set(opts.tp)),
        "tp_cap": s.cap,
        "nccl_settings": [setting.as_dict() for setting in s.settings],
        "nccl_settings_emulated": s.backend == "gloo",
        "workload": {
            **logits.spec.describe(),
            **workload.summary(logits.reference, **logits.inputs),
        },
        "reference": {
            "name": checks.REFERENCES["logits"],
            "method": "exactlogp.testing.fp64_reference: fp64 max, exp and sum, log1p of the "
            "non-argmax terms so logprobs near 0 keep full relative precision",
        },
        "method": _method(s),
        "candidates": {name: entries[name] for name in s.rows},  # the requested order
        "wall_s": time.monotonic() - s.start,
    }
    if "hidden_states" in s.data:
        report["hidden_states"] = _hidden_states(s.data["hidden_states"])
    if s.processed is not None:
        report["processed"] = s.processed
    schema.validate(report)
    return report


def _hidden_states(data) -> dict:
    """The hidden-state workload's header: its shape, generator, truth and check rows."""
    spec = data.spec
    return {
        "tokens": spec.tokens,
        "hidden": spec.hidden,
        "vocab": spec.vocab,
        "dtype": spec.dtype,
        "workload": {**spec.describe(), **workload.summary(data.reference, **data.inputs)},
        "reference": {
            "name": checks.REFERENCES["hidden_states"],
            "method": "fp64 GEMM of the same rounded hidden states and weight (every product "
            "exact, the sum's relative error ~H 2^-53), then exactlogp.testing."
            "fp64_softmax_reference: the fp64 log-softmax of exactlogp.testing.fp64_reference",
        },
        "check_rows": list(data.saved.check_rows),
        "extra_rows": list(data.saved.extra_rows),
    }


def _cross_candidate(entries: dict, s: Session, infos: dict) -> None:
    """Pairwise differences among the candidates of one workload; the pinned-backend rows
    of our candidates against their auto-backend row."""
    outs = {n: {tp: r["out"] for tp, r in s.results[n].items() if "error" not in r} for n in infos}
    for kind in set(s.kinds[n] for n in infos):
        same = {n: o for n, o in outs.items() if s.kinds[n] == kind}
        for name, diffs in checks.pairwise_max_abs(same).items():
            entries[name]["max_abs_vs"] = diffs
    for name in infos:
        base = name.split("[", 1)[0]
        if base in checks.OURS and name != base and base in outs:
            common = set(outs[name]) & set(outs[base])
            same = [checks.bits_equal(outs[name][t], outs[base][t]) for t in common]
            entries[name]["bitwise_equal_to_exactlogp"] = all(same) if same else None
        if name in checks.OURS:
            entries[name]["backend_resolved"] = infos[name].resolved_backend(s.device)


def _third_party(cands) -> list[dict]:
    found = {}
    for cand in cands:
        for pkg in cand.third_party():
            found[pkg["name"]] = pkg
    return sorted(found.values(), key=lambda p: p["name"])


def _method(s: Session) -> dict:
    opts, emulated = s.opts, s.backend == "gloo"
    return {
        "warmup_runs": 1,
        "timed_runs": opts.repeats,
        "timed_runs_note": "exactlogp[BACKEND] and exactlogp_linear[BACKEND] rows (a pinned, "
        f"non-auto backend) time at most {PINNED_TIMED_RUNS} runs; their purpose is the "
        "bitwise comparison with the auto-backend row",
        "timing": "after the checks, in one world per TP degree: every candidate that passed "
        "them built side by side and warmed up once, then rounds in which each runs once on "
        "all rows, in an order shuffled per round (seeded); barrier before each run, the "
        "slowest rank's time per run (CUDA synchronised); median and p10/p90 over the timed "
        "runs",
        "repeats": "SHA-256 of the warm-up output (checks world) and of every timed run's "
        "output (timing world), all rows",
        "check_rows": list(s.data["logits"].saved.check_rows),
        "extra_rows": list(s.data["logits"].saved.extra_rows),
        "batch_bitwise": "on check_rows: each row alone, consecutive sub-batches of 1, 2, 3, 5, "
        "8, ... rows, the rows permuted, the rows shuffled among extra_rows; each bit for bit "
        "against the same rows of the full-batch warm-up output (a float all_reduce can add "
        "the ranks in an order that depends on the message length and the element's place "
        "in it, so batch composition reaches the bits through the collective too)",
        "nccl_setting_invariant": (
            "on check_rows, in the same world: every float all_reduce a candidate issues "
            "replayed in each emulated order (gloo has no NCCL knobs); all outputs bit for bit"
            if emulated
            else "on check_rows: a fresh NCCL world per setting; all outputs bit for bit"
        ),
        "tp_equals_tp1": "all rows, bit for bit, each TP degree against TP1",
        "accuracy": "all rows at every TP measured, against the fp64 reference of the "
        "candidate's workload; ulps are fp32 ulps of the reference value",
        "workloads": "each candidate takes one workload (its entry's 'workload'): the shared "
        "logits, or the shared hidden states and LM-head weight (the header's "
        "'hidden_states', with its own check rows); candidates of both are measured side by "
        "side in the same worlds",
        "peak_memory": "per rank, the warm-up run: CUDA allocator peak, or on CPU the "
        "resident-set peak (VmHWM, reset first) minus the resident set before",
        "worlds": "spawned per TP degree, candidates one after another, each with its own "
        "timeout; a fresh world after any crash or timeout; then one timing world (a fresh "
        "one without the candidate whose run crashed or hung)"
        if s.launcher == "spawn"
        else "the torchrun world; TP groups are consecutive blocks of ranks",
        "timeout_s": opts.timeout_s,
    }


def exit_status(report: dict) -> int:
    """1 if exactlogp failed any invariance (or could not be measured), else 0."""
    from .processed import failures

    bad = checks.exactlogp_failures(report["candidates"])
    if "processed" in report:
        bad = [*bad, *failures(report["processed"])]
    return 1 if bad else 0
