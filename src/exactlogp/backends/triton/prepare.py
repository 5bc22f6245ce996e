"""What the Triton kernels' launches share: launch configurations, the argument preparation
and the device the launch runs on (launch.py and value_tables.py both use them)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ...temperature import Temperature
from ..base import ShardPlan, num_rows


@dataclass(frozen=True)
class LaunchConfig:
    block_v: int  # columns per step of a program's loop (a power of two)
    num_warps: int
    num_stages: int = 2


# Aim for this many programs per multiprocessor when splitting rows across programs.
PROGRAMS_PER_SM = 8


@dataclass(frozen=True)
class Prepared:
    x: torch.Tensor  # logits rows (N, V) or (B, T, V), unit column stride; bf16 as int16
    keep: torch.Tensor  # uint8 keep mask shaped like x, or a stand-in pointer
    tau: torch.Tensor  # fp32 (N,) or (1,)
    stride_tau: int
    has_tau: bool
    n_real: int  # local columns below the padding
    rows: int  # N

    def row_args(self) -> tuple[int, ...]:
        """stride_x, stride_keep, stride_tau, rows_inner, stride_x_outer, stride_keep_outer
        of the kernels (kernels._row_ptr): rows read in place, in one or two levels."""
        x, keep = self.x, self.keep
        if x.dim() == 2:
            return (x.stride(0), keep.stride(0), self.stride_tau, max(self.rows, 1), 0, 0)
        return (x.stride(1), keep.stride(-2), self.stride_tau, max(x.shape[1], 1), x.stride(0),
                keep.stride(0))  # fmt: skip


def prepare(logits, temperature: Temperature, keep_mask, plan: ShardPlan) -> Prepared:
    """The kernels' view of one pass's arguments (no host sync, no copy from host memory)."""
    x = logits if logits.stride(-1) == 1 else logits.contiguous()
    if x.dtype == torch.bfloat16:
        x = x.view(torch.int16)  # widened to fp32 by bit operations in the kernel
    keep = x if keep_mask is None else unit_stride(keep_mask).view(torch.uint8)
    dev = logits.device
    if temperature.per_row:
        tau = temperature.rows.to(device=dev).contiguous()
        stride_tau, has_tau = 1, True
    elif not temperature.is_one:
        # torch.full keeps the host from waiting on the device (no copy from host memory)
        tau = torch.full((1,), temperature.scalar, dtype=torch.float32, device=dev)
        stride_tau, has_tau = 0, True
    else:  # a division by exactly 1.0 is the identity: the kernels skip it
        tau, stride_tau, has_tau = x, 0, False
    num_cols = logits.shape[-1]
    n_real = num_cols
    if plan.vocab_size is not None:
        n_real = max(0, min(num_cols, plan.vocab_size - plan.vocab_start))
    return Prepared(x, keep, tau, stride_tau, has_tau, n_real, num_rows(logits))


def grad_temperature(temperature: Temperature, prep: Prepared) -> torch.Tensor:
    """fp64 (N,) or (1,): y divides by tau rounded to fp32, the gradient by the float
    itself, exactly as contract.scaled_logits and contract.grad_block do. Only backward
    needs it, so forward never converts it."""
    if temperature.per_row:
        return prep.tau.to(torch.float64)
    if prep.has_tau:
        return torch.full((1,), temperature.scalar, dtype=torch.float64, device=prep.tau.device)
    return prep.tau  # a stand-in pointer: the kernel does not divide


def unit_stride(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def target_programs(device: torch.device) -> int:
    """How many programs a launch should have to fill the device (1 in the interpreter)."""
    if device.type != "cuda":
        return 1
    return PROGRAMS_PER_SM * _sm_count(device.index)


@functools.cache
def _sm_count(index: int | None) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def programs_per_row(num_rows: int, n_real: int, cfg: LaunchConfig, device) -> tuple[int, int]:
    """(programs per row, columns per program): rows are split only when they are few."""
    blocks = max(1, -(-n_real // cfg.block_v))
    parts = min(blocks, max(1, -(-target_programs(device) // max(num_rows, 1))))
    per_program = -(-blocks // parts) * cfg.block_v
    return -(-max(n_real, 1) // per_program), per_program


def on_device(fn):
    """Launch on the device of the tensors: Triton launches on the current CUDA device, so
    a call with tensors on cuda:1 while cuda:0 is current must switch (and switch back)."""

    @functools.wraps(fn)
    def launch_there(first, *args, **kwargs):
        if first.device.type != "cuda":
            return fn(first, *args, **kwargs)
        with torch.cuda.device(first.device):
            return fn(first, *args, **kwargs)

    return launch_there
