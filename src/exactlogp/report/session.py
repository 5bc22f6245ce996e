"""Everything one report run knows, gathered in one place as it is measured."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from . import candidates, workload
from .job import Job


@dataclass
class Session:
    opts: object  # runner.ReportOptions
    device: torch.device
    backend: str  # "gloo" or "nccl"
    launcher: str  # "spawn" or "torchrun"
    tps: list[int]
    cap: int | None  # GPUs (spawn) or ranks (torchrun) the TP degrees were capped by
    threads: dict[int, int]  # TP degree -> intra-op threads per rank
    start: float
    rows: list[str] = field(default_factory=list)  # report rows, in order
    runnable: list[str] = field(default_factory=list)  # rows still being measured
    entries: dict = field(default_factory=dict)  # name -> {"unavailable": text} so far
    results: dict = field(default_factory=dict)  # name -> tp -> result or {"error"}
    settings: list = field(default_factory=list)  # emulation.Setting, every one used
    workload: workload.Workload | None = None
    data_path: str = ""
    logits: torch.Tensor | None = None
    target: torch.Tensor | None = None
    reference: torch.Tensor | None = None
    check_rows: list[int] = field(default_factory=list)
    extra_rows: list[int] = field(default_factory=list)

    def choose_rows(self) -> None:
        """Report rows from the requested names; those that cannot even be created are
        unavailable. The rest are imported and checked inside the first world."""
        self.rows = candidates.expand(list(self.opts.candidates), self.device)
        for name in self.rows:
            try:
                candidates.create(name)
            except Exception as exc:
                self.entries[name] = {"unavailable": f"{type(exc).__name__}: {exc}"}
                continue
            self.runnable.append(name)
            self.results[name] = {}

    def prepare(self, tmp: str, display, reference: bool = True) -> None:
        """Generate and save the shared workload; compute its fp64 truth if asked."""
        opts = self.opts
        self.workload = workload.Workload(opts.tokens, opts.vocab, opts.dtype, opts.seed)
        self.data_path = os.path.join(tmp, "workload.pt")
        task = display.start(f"shared logits {opts.tokens} x {opts.vocab} {opts.dtype}", 2)
        self.logits, self.target = workload.generate(self.workload)
        workload.save(self.data_path, self.logits, self.target)
        display.advance(task, 1, "fp64 reference")
        if reference:
            self.reference = workload.reference_logprobs(self.logits, self.target)
        display.finish(task, "ready")
        self.check_rows, self.extra_rows = workload.check_rows(
            opts.tokens, opts.check_rows, opts.seed
        )

    def job(self, names, tp: int, kind: str = "checks") -> Job:
        return Job(
            candidates=tuple(names),
            data_path=self.data_path,
            vocab=self.opts.vocab,
            tp=tp,
            repeats=self.opts.repeats,
            check_rows=tuple(self.check_rows),
            extra_rows=tuple(self.extra_rows),
            threads=self.threads[tp],
            kind=kind,
            emulate=kind == "checks" and self.backend == "gloo" and tp > 1,
            seed=self.opts.seed,
        )

    def applicable(self, tp: int) -> list[str]:
        """Runnable candidates at this TP; the ones whose layout cannot have it get an error."""
        names = []
        for name in self.runnable:
            cand = candidates.create(name)
            if cand.tp1_only and tp != 1:
                continue
            try:
                cand.padded_vocab(self.opts.vocab, tp)
            except ValueError as exc:
                self.results[name][tp] = {"error": f"not applicable: {exc}"}
                continue
            names.append(name)
        return names

    @staticmethod
    def with_timing(checked: dict, timed: dict) -> dict:
        """Each candidate's checks with its timed runs; a failed timing is its error."""
        out = dict(checked)
        for name, res in timed.items():
            if "error" in res:
                out[name] = {**res, "error": f"timing: {res['error']}"}
            else:
                out[name] = {
                    **checked[name],
                    "times_s": res["times_s"],
                    "hashes": checked[name]["hashes"] + res["hashes"],
                }
        return out

    def record(self, tp: int, results: dict) -> None:
        """Store one TP degree's results; candidates found unavailable leave the run."""
        for name, res in results.items():
            if "unavailable" in res:
                self.entries[name] = {"unavailable": res["unavailable"]}
                self.runnable.remove(name)
                del self.results[name]
            else:
                self.results[name][tp] = res
