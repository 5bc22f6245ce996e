"""Warm-up before CUDA-graph capture (or a latency-critical loop): everything a first call
does once, done ahead.

A first call on a device builds (CPU) or JIT-compiles (Triton) the kernels of its
variant, copies the contract's exp2 table to the device and loads the backend; none of
that may happen inside `torch.cuda.graph` capture. `warmup` runs the calls of the
given dtypes, shapes and options once, forward and backward, on zero logits, so that
every later call of those variants only launches kernels. The Triton kernels specialise
on which integer arguments are 1 or multiples of 16 (row counts, row strides, widths),
so pass the shapes that will be captured. Captured calls must use validate=False (with
validate=True a call waits for the device once, to raise on bad rows).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable

import torch

from .api import selected_logprobs


def warmup(
    device: torch.device | str = "cuda",
    dtypes: Iterable[torch.dtype] = (torch.bfloat16,),
    shapes: Iterable[tuple[int, int]] = ((1, 128),),
    *,
    with_entropy: Iterable[bool] = (False, True),
    temperatures: Iterable[float | str] = (1.0,),
    keep_mask: bool = False,
    backward: bool = True,
    tp_group=None,
    vocab_size: int | None = None,
    backend: str = "auto",
) -> int:
    """Run one call per (dtype, (rows, V_local), with_entropy, temperature), forward and
    (with `backward`) backward; returns how many calls ran. A temperature of "per_row"
    passes a tensor of one per row. With a `tp_group` every rank must call this alike
    (the calls are collective, as any call is)."""
    device = torch.device(device)
    calls = 0
    for dtype, (rows, cols), entropy, tau in itertools.product(
        tuple(dtypes), tuple(shapes), tuple(with_entropy), tuple(temperatures)
    ):
        logits = torch.zeros(rows, cols, dtype=dtype, device=device)
        logits.requires_grad_(backward)
        target = torch.zeros(rows, dtype=torch.int64, device=device)
        if tau == "per_row":
            tau = torch.ones(rows, dtype=torch.float32, device=device)
        mask = torch.ones(rows, cols, dtype=torch.bool, device=device) if keep_mask else None
        res = selected_logprobs(
            logits, target, tp_group=tp_group, vocab_size=vocab_size, temperature=tau,
            keep_mask=mask, with_entropy=entropy, validate=False, backend=backend,
        )  # fmt: skip
        if backward:
            loss = res.logprobs.sum() + res.lse.sum()
            (loss + res.entropy.sum() if entropy else loss).backward()
        calls += 1
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return calls
