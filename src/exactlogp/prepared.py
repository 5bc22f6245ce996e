"""A weight shard prepared once for the exact LM head, for calls where it does not change.

    head = exactlogp.prepare_lm_head(lm_head.weight)        # once
    exactlogp.linear_selected_logprobs(hidden, head, target) # every decode step
    head.refresh()                                           # after the weight changes

What is kept: the weight rows' exponents and scales (linear_contract L1), and on a backend
whose head is fused (TritonBackend(exact_gemm="int8_fused")) the int8 diagonal layout of
the whole shard (3 bytes per weight element: 1.5x a bf16 weight), so a call slices only
its hidden states. Nothing is cached process-wide: the handle is the cache, and dropping
it frees it. The outputs are the bits of the same call with the weight itself.
"""

from __future__ import annotations

import torch

from . import linear_contract as lc
from . import validation
from .backends import Backend, get_backend


class PreparedLMHead:
    """The prepared form of one LM-head weight shard (see prepare_lm_head).

    Staleness: every call checks the weight's version counter, which in-place torch ops
    on it bump (an optimizer step, `weight.copy_(...)`, `weight.add_(...)` under no_grad):
    a changed weight raises ValueError until refresh(). Writes through `weight.data` (as
    weight syncs do with `p.data.copy_`) bypass the counter and are NOT detected: call
    refresh() after them."""

    def __init__(self, weight: torch.Tensor, backend: Backend):
        self.weight, self.backend = weight, backend
        self.refresh()

    def refresh(self) -> PreparedLMHead:
        """Prepare again from the weight's current values; returns self."""
        w = self.weight
        self.f, self.finite = lc.row_exponents(w)
        self.col_scale = lc.unit_scales(self.f, self.finite)
        self.version = w._version
        self._c3 = self._grid = None
        if self.backend.fused_head(w.device):
            self.c3(self.backend)
        return self

    def c3(self, backend: Backend) -> torch.Tensor:
        """(V_local, 3H) int8: the fused head's layout of the weight, made on first use by
        `backend` (a backend whose head is fused; every such backend makes the same bytes,
        linear_contract.diagonal_layout)."""
        if self._c3 is None:
            self._c3 = backend.head_slices(self.weight, self.f, self.finite, reverse=False)
        return self._c3

    def on_grid(self, rows: slice) -> bool:
        """Whether every element of these weight rows is on L2's grid (no residual: the
        fused kernel's logits are contract v2's there); found once per refresh."""
        if self._grid is None:
            self._grid = lc.on_grid(self.weight, self.f, self.finite)
        return bool(self._grid[rows].all())

    def check(self) -> None:
        if self.weight._version != self.version:
            raise ValueError(
                f"the weight of this PreparedLMHead changed after it was prepared (version "
                f"{self.version}, now {self.weight._version}): call refresh() after every "
                "update of the weight"
            )

    def __repr__(self) -> str:
        shape = tuple(self.weight.shape)
        layout = "" if self._c3 is None else ", int8 layout"
        return f"PreparedLMHead({shape}, {self.weight.dtype}, {self.backend!r}{layout})"


def prepare_lm_head(weight: torch.Tensor, *, backend: str | Backend = "auto") -> PreparedLMHead:
    """A PreparedLMHead of `weight` (V_local, H), for linear_logits and
    linear_selected_logprobs in place of the weight; `backend` is the one the calls will
    use (it decides whether the int8 layout is made now). The calls' bits do not depend on
    it: a handle prepared for one backend serves any."""
    validation.check_weight(weight)
    return PreparedLMHead(weight, get_backend(backend, weight.device))


def unwrap(weight) -> tuple[torch.Tensor, PreparedLMHead | None]:
    """(the weight tensor, its PreparedLMHead or None) of a functions' `weight` argument;
    a stale handle raises."""
    if isinstance(weight, PreparedLMHead):
        weight.check()
        return weight.weight, weight
    return weight, None
