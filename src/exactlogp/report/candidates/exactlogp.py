"""exactlogp itself: `exactlogp.selected_logprobs` on the shard, one row per backend.

The row called "exactlogp" uses backend="auto" (what users get); "exactlogp[NAME]" rows
pin one other available backend, so the report also shows that backends agree bit for bit.
The vocabulary is padded as Megatron pads it (to a multiple of 128 * TP), so TP4 == TP1
here also covers different padding.

Parameters, in "exactlogp[BACKEND,entropy,value_tables=MODE,validate=false,temperature=T]"
(each optional):
  BACKEND             a backend name (default "auto")
  entropy             also compute the entropy (the RL case); the loss then adds it
  value_tables=MODE   the CPU backend's value-table mode ("never": column by column)
  validate=false      no bad-row check, so no host sync (what a GPU step would run)
  temperature=T       the sampling temperature (default 1)
"""

from __future__ import annotations

import torch

from ...api import selected_logprobs
from ...backends import get_backend
from ...backends.base import VALUE_TABLE_MODES, check_mode
from .base import Candidate, ShardContext, Unavailable, round_up, temperature_param
from .megatron import MEGATRON_PAD_MULTIPLE

# A pinned backend's row is there to show its bits equal the auto backend's on every row;
# a few timed runs say how fast it is. (The pure-torch reference backend takes tens of
# seconds per run of the default workload on a small CPU; ten of them add minutes.)
PINNED_TIMED_RUNS = 3
USAGE = "exactlogp[BACKEND,entropy,value_tables=MODE,validate=false,temperature=T]"


class ExactlogpCandidate(Candidate):
    implementation = "ours"
    supports_backward = True

    def __init__(
        self,
        backend: str = "auto",
        with_entropy: bool = False,
        value_tables: str | None = None,
        validate: bool = True,
        temperature: float = 1.0,
    ):
        self.backend, self.with_entropy, self.value_tables = backend, with_entropy, value_tables
        self.validate, self.temperature = validate, temperature
        params = [] if backend == "auto" else [backend]
        params += ["entropy"] if with_entropy else []
        params += [f"value_tables={value_tables}"] if value_tables else []
        params += [] if validate else ["validate=false"]
        params += [] if temperature == 1.0 else [f"temperature={temperature:g}"]
        self.name = f"exactlogp[{','.join(params)}]" if params else "exactlogp"
        self.max_timed_runs = None if backend == "auto" else PINNED_TIMED_RUNS
        options = f"backend={backend!r}" + (", with_entropy=True" if with_entropy else "")
        options += "" if validate else ", validate=False"
        options += "" if temperature == 1.0 else f", temperature={temperature:g}"
        tables = f"; value tables {value_tables!r}" if value_tables else ""
        self.summary = (
            f"exactlogp.selected_logprobs({options}): exact int64 accumulation, "
            f"one all_reduce(MAX) and one int64 all_reduce(SUM){tables}"
        )

    @classmethod
    def from_params(cls, params: tuple[str, ...]) -> ExactlogpCandidate:
        backend, with_entropy, value_tables, validate, temperature = "auto", False, None, True, 1.0
        for p in params:
            tau = temperature_param(p)
            if tau is not None:
                temperature = tau
            elif p == "entropy":
                with_entropy = True
            elif p.startswith("value_tables="):
                value_tables = p.removeprefix("value_tables=")
            elif p == "validate=false":
                validate = False
            elif "=" not in p and backend == "auto":
                backend = p
            else:
                raise ValueError(f"exactlogp takes {USAGE}, got parameter {p!r}")
        return cls(backend, with_entropy, value_tables, validate, temperature)

    def check_available(self, device: torch.device) -> None:
        try:
            impl = get_backend(self.backend, device)
        except (ValueError, RuntimeError) as exc:
            raise Unavailable(f"{type(exc).__name__}: {exc}") from exc
        if self.value_tables and not hasattr(impl, "value_tables"):
            raise Unavailable(f"backend {impl.name!r} has no value tables")
        if self.value_tables:
            check_mode("value_tables", self.value_tables, VALUE_TABLE_MODES)

    def padded_vocab(self, vocab_size: int, tp: int) -> int:
        return round_up(vocab_size, MEGATRON_PAD_MULTIPLE * tp)

    def describe(self) -> dict:
        info = super().describe()
        info["backend"] = self.backend
        return info

    def resolved_backend(self, device: torch.device) -> str:
        return get_backend(self.backend, device).name

    def backend_for(self, device: torch.device):
        """The backend object of this row on `device`: value-table mode `value_tables`
        (as it is when None)."""
        impl = get_backend(self.backend, device)
        return impl.with_options(value_tables=self.value_tables) if self.value_tables else impl

    def build(self, ctx: ShardContext):
        backend = self.backend_for(ctx.device)
        with_entropy, validate = self.with_entropy, self.validate
        temperature = self.temperature

        def run(logits: torch.Tensor, target: torch.Tensor):
            res = selected_logprobs(
                logits,
                target,
                tp_group=ctx.group,
                vocab_start=ctx.vocab_start,
                vocab_size=ctx.vocab_size,
                backend=backend,
                with_entropy=with_entropy,
                validate=validate,
                temperature=temperature,
            )
            return (res.logprobs, res.entropy) if with_entropy else res.logprobs

        return run

    def loss(self, out) -> torch.Tensor:
        if not self.with_entropy:
            return super().loss(out)
        logprobs, entropy = out
        return -logprobs.sum() + entropy.sum()
