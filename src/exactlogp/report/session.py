"""Everything one report run knows, gathered in one place as it is measured."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from . import candidates, workload
from .job import Job


@dataclass
class Prepared:
    """One workload as this run generated it."""

    spec: object  # workload.Workload or workload.HiddenWorkload
    saved: workload.Saved  # what the worlds load
    inputs: dict  # name -> tensor, as saved
    reference: torch.Tensor | None = None  # (N,) fp64 truth (rank 0 only under torchrun)


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
    kinds: dict = field(default_factory=dict)  # name -> the workload it takes
    data: dict = field(default_factory=dict)  # workload kind -> Prepared
    processed: dict | None = None  # the processed-logprobs table (processed.py)

    def choose_rows(self) -> None:
        """Report rows from the requested names; those that cannot even be created are
        unavailable. The rest are imported and checked inside the first world."""
        self.rows = candidates.expand(list(self.opts.candidates), self.device)
        for name in self.rows:
            try:
                cand = candidates.create(name)
            except Exception as exc:
                self.entries[name] = {"unavailable": f"{type(exc).__name__}: {exc}"}
                continue
            self.runnable.append(name)
            self.kinds[name] = cand.kind
            self.results[name] = {}

    def prepare(self, tmp: str, display, reference: bool = True) -> None:
        """Generate and save the shared workloads (the logits always, the hidden states
        when a row takes them); compute their fp64 truth if asked."""
        opts = self.opts
        spec = workload.Workload(opts.tokens, opts.vocab, opts.dtype, opts.seed)
        task = display.start(f"shared logits {opts.tokens} x {opts.vocab} {opts.dtype}", 2)
        logits, target = workload.generate(spec)
        self._save(tmp, "logits", spec, opts.check_rows, dict(logits=logits, target=target))
        display.advance(task, 1, "fp64 reference")
        if reference:
            self.data["logits"].reference = workload.reference_logprobs(logits, target)
        display.finish(task, "ready")
        if "hidden_states" not in self.kinds.values():
            return
        spec = workload.HiddenWorkload(
            opts.hidden_tokens, opts.hidden_size, opts.vocab, opts.dtype, opts.seed,
            opts.hidden_outlier,
        )  # fmt: skip
        task = display.start(
            f"shared hidden states {spec.tokens} x {spec.hidden}, head {spec.vocab} x "
            f"{spec.hidden} {opts.dtype}",
            2,
        )
        hidden, weight, target = workload.generate_hidden(spec)
        tensors = dict(hidden=hidden, weight=weight, target=target)
        self._save(tmp, "hidden_states", spec, opts.hidden_check_rows, tensors)
        display.advance(task, 1, "fp64 GEMM + log-softmax reference")
        if reference:
            self.data["hidden_states"].reference = workload.reference_hidden_logprobs(
                hidden, weight, target
            )
        display.finish(task, "ready")

    def _save(self, tmp: str, kind: str, spec, check_rows: int, tensors: dict) -> None:
        path = os.path.join(tmp, f"{kind}.pt")
        workload.save(path, **tensors)
        rows, extra = workload.check_rows(spec.tokens, check_rows, spec.seed)
        saved = workload.Saved(kind, path, spec.vocab, tuple(rows), tuple(extra))
        self.data[kind] = Prepared(spec, saved, tensors)

    def job(self, names, tp: int, kind: str = "checks") -> Job:
        return Job(
            candidates=tuple(names),
            data={k: self.data[k].saved for k in sorted({self.kinds[n] for n in names})},
            tp=tp,
            repeats=self.opts.repeats,
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
                self.entries[name] = {
                    "unavailable": res["unavailable"],
                    "workload": self.kinds[name],
                }
                self.runnable.remove(name)
                del self.results[name]
            else:
                self.results[name][tp] = res
