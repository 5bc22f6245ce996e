"""The exact cut's options as one checked value, attached to the call.

    processed_logprobs / sampling_mask / sample (cut/api.py)
      -> check_cut(...)     this rank's checks of top_k, top_p, min_p and sample's
                            uniforms, once, where the public function is entered (the
                            temperature is the call's: a greedy row's tau read as 1,
                            Temperature.greedy)
      -> CutOptions         each parameter a RowParam (absent, a scalar, or one per row),
                            the uniforms
      -> replace(call, cut=CutOptions)
                            read by the cut (cut/blocks.py), the draw and the agreement

docs/numerics.md section 13 gives each parameter's conventions.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import torch

from .. import agreement, contract


@dataclass(frozen=True, eq=False)
class RowParam:
    """One parameter of the cut: absent (no cut in any row), one value for every row, or
    one value per row. `off` is the value that means "no cut" in a row."""

    name: str
    off: int | float  # top_k 0, top_p 1.0, min_p 0.0
    scalar: int | float | None = None  # the value of every row; None: per row or absent
    rows: torch.Tensor | None = None  # (N,) int64 (top_k) or fp32, contiguous

    @property
    def given(self) -> bool:
        """Whether some row may have this cut (alike on every rank: it is in the key)."""
        return self.scalar is not None or self.rows is not None

    @property
    def dtype(self) -> torch.dtype:
        return torch.int64 if self.name == "top_k" else torch.float32

    def block(self, rows: slice, device: torch.device) -> torch.Tensor:
        """(nb,) the values of rows [start, stop); `off` where the parameter is absent."""
        if self.rows is not None:
            return self.rows[rows]
        value = self.off if self.scalar is None else self.scalar
        return torch.full((rows.stop - rows.start,), value, dtype=self.dtype, device=device)

    def field(self) -> int:
        """The agreement's call field (agreement.CallFields): 0 absent, -2 (top_k) or -1
        (top_p, min_p) per row, else k or the fp32 bits."""
        if self.rows is not None:
            return -2 if self.name == "top_k" else -1
        if self.scalar is None:
            return 0
        return self.scalar if self.name == "top_k" else contract.fp32_bits(self.scalar)

    def words(self, n: int, device: torch.device) -> torch.Tensor:
        """(N,) int32: each row's value as the agreement compares it (k clamped to the
        int32 range, else the fp32 bits)."""
        v = self.block(slice(0, n), device)
        if self.name == "top_k":
            return v.clamp(-1, (1 << 31) - 1).to(torch.int32)
        return v.view(torch.int32)


@dataclass(frozen=True, eq=False)
class CutOptions:
    """The cut of one call, checked (docs/numerics.md section 13)."""

    top_k: RowParam
    top_p: RowParam
    min_p: RowParam
    uniforms: torch.Tensor | None = None  # (N,) float64 in [0, 1): sample's draws

    def params(self) -> tuple[RowParam, RowParam, RowParam]:
        """min-p, top-k, top-p: the order the cut applies them in."""
        return self.min_p, self.top_k, self.top_p

    def fields(self) -> dict:
        """The call fields every rank must pass alike (agreement.CallFields)."""
        return {p.name: p.field() for p in self.params()}

    def row_words(self, greedy: torch.Tensor | None, n: int, device) -> torch.Tensor:
        """(N, ROW_WORDS) int32: every per-row value the ranks must share besides the
        target and tau (ROW_WORD_NAMES: top_k, top_p, min_p, whether the row is greedy,
        the uniform's two halves; `greedy`: Temperature.greedy)."""
        zeros = torch.zeros(n, dtype=torch.int32, device=device)
        is_greedy = zeros if greedy is None else greedy.to(torch.int32)
        u_hi = u_lo = zeros
        if self.uniforms is not None:
            bits = self.uniforms.view(torch.int64)
            u_hi, u_lo = (bits >> 32).to(torch.int32), bits.to(torch.int32)
        params = [p.words(n, device) for p in (self.top_k, self.top_p, self.min_p)]
        return torch.stack([*params, is_greedy, u_hi, u_lo], dim=1)

    def row_hash(self, greedy: torch.Tensor | None, n: int, device) -> torch.Tensor:
        """(2, N) int64 below 2^24: the hash of row_words that rides the MAX."""
        return agreement.row_hash(self.row_words(greedy, n, device))


ROW_WORD_NAMES = ("top_k", "top_p", "min_p", "temperature", "uniforms", "uniforms")


def row_word_text(words: list[int]) -> dict[str, str]:
    """A row's ROW_WORDS as the user wrote them, by name (for the messages)."""
    k, p, m, greedy, u_hi, u_lo = words
    u = torch.tensor([(u_hi << 32) | (u_lo & 0xFFFFFFFF)], dtype=torch.int64)
    return {
        "top_k": str(k),
        "top_p": agreement.fp32_text(p),
        "min_p": agreement.fp32_text(m),
        "temperature": "0 (greedy)" if greedy else "not 0",
        "uniforms": repr(float(u.view(torch.float64)[0])),
    }


# --- this rank's checks ---


def check_cut(top_k, top_p, min_p, target: torch.Tensor, uniforms=None) -> CutOptions:
    """The CutOptions of the public arguments, or a TypeError / ValueError naming the
    argument and the value (the range checks of per-row tensors sync with the host).
    `target` fixes the rows' shape and device; the temperature is the call's
    (validation.check_temperature with greedy=True)."""
    return CutOptions(
        top_k=check_top_k(top_k, target),
        top_p=check_top_p(top_p, target),
        min_p=check_min_p(min_p, target),
        uniforms=uniforms,
    )


def scalar_cut(top_k=None, top_p=None, min_p=None) -> dict:
    """A host's fixed cut (a trainer's top_k / top_p / min_p settings), checked as the
    cut's functions check them: {name: value} of the parameters that cut ({}: none)."""
    for name, value in (("top_k", top_k), ("top_p", top_p), ("min_p", min_p)):
        if isinstance(value, torch.Tensor):
            raise TypeError(f"{name} must be a number or None here, got a tensor")
    cut = check_cut(top_k, top_p, min_p, torch.zeros((), dtype=torch.int64))
    return {p.name: p.scalar for p in cut.params() if p.scalar is not None}


def _per_row(name: str, value: torch.Tensor, target: torch.Tensor, dtype) -> torch.Tensor:
    """A per-row tensor parameter as (N,) `dtype`: () or the target's shape, its device,
    and no gradient to lose."""
    if value.dim() != 0 and value.shape != target.shape:
        raise ValueError(
            f"{name} tensor shape {tuple(value.shape)} must be () or equal target shape "
            f"{tuple(target.shape)}"
        )
    if value.device != target.device:
        raise ValueError(f"{name} is on {value.device} but target is on {target.device}")
    if value.requires_grad and torch.is_grad_enabled():
        raise ValueError(
            f"{name} is a tensor that requires grad, but exactlogp does not differentiate "
            f"with respect to {name} (the gradient would be silently missing); pass "
            f"{name}.detach()"
        )
    return value.detach().expand(target.shape).reshape(-1).to(dtype).contiguous()


def check_top_k(top_k, target: torch.Tensor) -> RowParam:
    """None (no cut) or an int >= -1 (-1, 0: no cut), or a tensor of them, one per row."""
    if top_k is None:
        return RowParam("top_k", 0)
    if isinstance(top_k, torch.Tensor):
        if top_k.is_floating_point() or top_k.is_complex() or top_k.dtype == torch.bool:
            raise TypeError(f"top_k tensor must have an integer dtype, got {top_k.dtype}")
        k = _per_row("top_k", top_k, target, torch.int64)
        if k.numel() and bool((k < -1).any()):
            raise ValueError(f"top_k must be >= -1 (-1 and 0: no cut), got {int(k.min())}")
        return RowParam("top_k", 0, rows=k)
    if isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral):
        raise TypeError(
            f"top_k must be an int, a tensor or None, got {type(top_k).__name__} {top_k!r}"
        )
    if top_k < -1:
        raise ValueError(f"top_k must be >= -1 (-1 and 0: no cut), got {top_k}")
    return RowParam("top_k", 0, None if top_k <= 0 else int(top_k))


def check_top_p(top_p, target: torch.Tensor) -> RowParam:
    """None or 1 (no cut), a float in (0, 1), or a tensor of them, one per row."""
    return _check_fraction("top_p", top_p, target, low_open=True, off=1.0)


def check_min_p(min_p, target: torch.Tensor) -> RowParam:
    """None or 0 (no cut), a float in (0, 1], or a tensor of them, one per row."""
    return _check_fraction("min_p", min_p, target, low_open=False, off=0.0)


def _check_fraction(name, value, target, low_open: bool, off: float) -> RowParam:
    """None, a float or a tensor in (0, 1] (low_open) or [0, 1], rounded to fp32; a
    scalar equal to `off` is no cut."""
    interval = "(0, 1]" if low_open else "[0, 1]"
    if value is None:
        return RowParam(name, off)
    if isinstance(value, torch.Tensor):
        if not value.is_floating_point():
            raise TypeError(f"{name} tensor must be floating point, got {value.dtype}")
        v = _per_row(name, value, target, torch.float32)
        ok = ((v > 0) if low_open else (v >= 0)) & (v <= 1)
        if v.numel() and not bool(ok.all()):
            raise ValueError(f"{name} must be in {interval} in float32, got {v[~ok][0].item()!r}")
        return RowParam(name, off, rows=v)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a float, a tensor or None, got {type(value).__name__}")
    v = contract.fp32_temperature(value)
    if not ((v > 0 if low_open else v >= 0) and v <= 1):
        raise ValueError(f"{name} must be in {interval} in float32, got {value!r}")
    return RowParam(name, off, None if v == off else v)


def check_uniforms(uniforms, generator, rows: tuple[int, ...], device) -> torch.Tensor:
    """sample's (N,) float64 uniforms in [0, 1): the given ones, checked, or drawn from
    `generator` (every rank must draw the same: seed it alike)."""
    if uniforms is None:
        if generator is not None and not isinstance(generator, torch.Generator):
            raise TypeError(
                f"generator must be a torch.Generator or None, got {type(generator).__name__}"
            )
        uniforms = torch.rand(rows, dtype=torch.float64, generator=generator, device=device)
    elif not isinstance(uniforms, torch.Tensor) or uniforms.dtype != torch.float64:
        raise TypeError(f"uniforms must be a float64 tensor, got {_describe(uniforms)}")
    elif tuple(uniforms.shape) != tuple(rows):
        raise ValueError(f"uniforms shape {tuple(uniforms.shape)} must be {tuple(rows)}")
    elif uniforms.device != device:
        raise ValueError(f"uniforms is on {uniforms.device} but must be on {device}")
    elif uniforms.numel() and not bool(((uniforms >= 0) & (uniforms < 1)).all()):
        bad = uniforms[~((uniforms >= 0) & (uniforms < 1))][0].item()
        raise ValueError(f"uniforms must lie in [0, 1), got {bad!r}")
    return uniforms.reshape(-1).contiguous()


def _describe(v) -> str:
    if isinstance(v, torch.Tensor):
        return f"a {v.dtype} tensor of shape {tuple(v.shape)}"
    return type(v).__name__
