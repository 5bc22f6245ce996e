"""Launching the Triton kernels: fixed configurations, argument preparation, the Backend.

Launch rules that the bits depend on:
- enable_fp_fusion=False on every launch, so no add/mul pair is contracted into an FMA
  (the interpreter never fuses; on a GPU this is what keeps exp_c's Horner steps and the
  quantisation two separately rounded operations).
- One fixed configuration per dtype (no autotuning). The partial records and maxima of
  the programs that share a row are combined exactly (int64 sum, max), so how many
  programs split a row changes the speed, never the bits.

Where it runs: CUDA tensors on a GPU, or CPU tensors when the kernels were defined under
TRITON_INTERPRET=1 (the Triton interpreter executes them with numpy, for testing).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton

from ... import contract
from ...contract import GradStats
from ..base import EXACT_GEMM_MODES, VALUE_TABLE_MODES, Backend, ShardPlan, check_mode, num_rows
from . import kernels, value_tables
from .prepare import (
    LaunchConfig,
    Prepared,
    grad_temperature,
    on_device,
    prepare,
    programs_per_row,
    unit_stride,
)


@dataclass(frozen=True)
class DtypeConfigs:
    max_pass: LaunchConfig  # memory bound: wide blocks
    partials: LaunchConfig  # fp64 bound: ~35 binary64 operations per logit
    grad: LaunchConfig  # fp64 bound, one block of columns per program


# Fixed per logits dtype. The max pass reads 32 bytes per thread per loop step (~50-70
# registers, so several programs share a multiprocessor and keep HBM busy); the fp64
# passes keep 8 logits per thread (~110 registers with entropy, no spills on sm_90;
# benchmarks/triton_ptx_check.py prints the figures).
_FP64_PASS = LaunchConfig(block_v=1024, num_warps=4)
CONFIGS: dict[torch.dtype, DtypeConfigs] = {
    torch.bfloat16: DtypeConfigs(LaunchConfig(4096, 8), _FP64_PASS, _FP64_PASS),
    torch.float16: DtypeConfigs(LaunchConfig(4096, 8), _FP64_PASS, _FP64_PASS),
    torch.float32: DtypeConfigs(LaunchConfig(2048, 8), _FP64_PASS, _FP64_PASS),
}

# finalize: one row per thread, a few programs for a batch of ~1000 rows. Rows are
# independent, so the block size changes the speed, never the bits.
FINALIZE_BLOCK_N = 128
FINALIZE_NUM_WARPS = 4

_GRAD_KIND = {
    torch.float32: (kernels.OUT_F32.value, torch.int32),
    torch.float16: (kernels.OUT_F16.value, torch.int16),
    torch.bfloat16: (kernels.OUT_BF16.value, torch.int16),
}


def interpreted() -> bool:
    """True when the kernels were defined under TRITON_INTERPRET=1."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(kernels.partials_kernel, InterpretedFunction)


def _common(prep: Prepared, keep_mask, dtype: torch.dtype) -> dict:
    return dict(
        IS_BF16=dtype == torch.bfloat16,
        HAS_TAU=prep.has_tau,
        HAS_KEEP=keep_mask is not None,
    )


def _launch_options(cfg: LaunchConfig) -> dict:
    return dict(
        BLOCK_V=cfg.block_v,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        enable_fp_fusion=False,
    )


# --- the three local passes ---


@on_device
def row_max(logits, temperature, keep_mask, plan: ShardPlan, cfg=None):
    """Backend.row_max; `cfg` None means the dtype's fixed configuration (tests vary it)."""
    n = num_rows(logits)
    if n == 0 or logits.shape[-1] == 0:
        return torch.full((n,), float("-inf"), dtype=torch.float32, device=logits.device)
    cfg = cfg or CONFIGS[logits.dtype].max_pass
    prep = prepare(logits, temperature, keep_mask, plan)
    parts, per_program = programs_per_row(n, prep.n_real, cfg, logits.device)
    out = torch.empty(n, parts, dtype=torch.float32, device=logits.device)
    kernels.row_max_kernel[(n, parts)](
        prep.x, prep.keep, prep.tau, out, *prep.row_args(), prep.n_real, per_program,
        **_common(prep, keep_mask, logits.dtype), **_launch_options(cfg),
    )  # fmt: skip
    return out[:, 0] if parts == 1 else out.amax(dim=1)


@on_device
def partials(logits, target, temperature, keep_mask, row_max_, plan, cfg=None):
    """Backend.partials; the programs sharing a row are summed exactly (int64)."""
    n = num_rows(logits)
    if n == 0 or logits.shape[-1] == 0:
        return torch.zeros(n, contract.NUM_COLS, dtype=torch.int64, device=logits.device)
    cfg = cfg or CONFIGS[logits.dtype].partials
    prep = prepare(logits, temperature, keep_mask, plan)
    parts, per_program = programs_per_row(n, prep.n_real, cfg, logits.device)
    out = torch.empty(n, parts, contract.NUM_COLS, dtype=torch.int64, device=logits.device)
    kernels.partials_kernel[(n, parts)](
        prep.x, prep.keep, prep.tau, row_max_.to(torch.float32).contiguous(),
        target.to(torch.int64).contiguous(), contract.exp2_table(logits.device), out,
        *prep.row_args(), prep.n_real, plan.vocab_start, plan.ignore_index, per_program,
        WITH_ENTROPY=plan.with_entropy,
        **_common(prep, keep_mask, logits.dtype), **_launch_options(cfg),
    )  # fmt: skip
    return out[:, 0] if parts == 1 else out.sum(dim=1)


@on_device
def grad(logits, target, temperature, keep_mask, stats: GradStats, plan: ShardPlan, cfg=None):
    """Backend.grad: one program per (row, block of columns), written as bit patterns."""
    n, num_cols = num_rows(logits), logits.shape[-1]
    out = torch.empty(n, num_cols, dtype=logits.dtype, device=logits.device)
    if n == 0 or num_cols == 0:
        return out.view(logits.shape)
    cfg = cfg or CONFIGS[logits.dtype].grad
    prep = prepare(logits, temperature, keep_mask, plan)
    kind, bits_dtype = _GRAD_KIND[logits.dtype]
    f64 = lambda t: t.to(torch.float64).contiguous()  # noqa: E731
    grid = (n, -(-num_cols // cfg.block_v))
    kernels.grad_kernel[grid](
        prep.x, prep.keep, prep.tau, grad_temperature(temperature, prep),
        target.to(torch.int64).contiguous(),
        contract.exp2_table(logits.device), stats.row_max.to(torch.float32).contiguous(),
        f64(stats.s_hi), f64(stats.s_lo), f64(stats.log_s), f64(stats.entropy64),
        f64(stats.coef_a), f64(stats.coef_b), f64(stats.coef_t), f64(stats.coef_l),
        stats.row_nan.to(torch.uint8).contiguous(), out.view(bits_dtype), *prep.row_args(),
        num_cols, prep.n_real, plan.vocab_start, plan.ignore_index,
        WITH_ENTROPY=plan.with_entropy, OUT_KIND=kind,
        **_common(prep, keep_mask, logits.dtype), **_launch_options(cfg),
    )  # fmt: skip
    return out.view(logits.shape)


CLASS_MAX_BLOCK_V = 128  # columns per step of class_max_kernel: [32, 128] compares


@on_device
def class_max(z, cls, skip, classes: int):
    """Backend.class_max: one program per row (class_max_kernel)."""
    r, p = z.shape
    out = torch.empty(r, classes, dtype=torch.float32, device=z.device)
    if r == 0 or p == 0 or classes == 0:
        return out.fill_(float("-inf"))
    if classes & (classes - 1):
        raise ValueError(f"classes must be a power of two here, got {classes}")
    z = z if z.stride(-1) == 1 else z.contiguous()
    kernels.class_max_kernel[(r,)](
        z, cls.to(torch.int32).contiguous(), skip.to(torch.int64).contiguous(), out, p,
        z.stride(0), CLASSES=classes, BLOCK_V=CLASS_MAX_BLOCK_V, num_warps=4,
        enable_fp_fusion=False,  # compares and selects only; the compiled-code check asks
    )  # fmt: skip
    return out


@on_device
def chunk_max(logits, temperature, plan: ShardPlan, chunk: int, cfg=None):
    """Backend.chunk_max: one program per (row, block of chunks), each step BLOCK_C chunks
    of up to BLOCK_K columns (cfg.block_v columns in all, the max pass's width by default);
    rows are split over programs only when they are few, as in the max pass."""
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk must be a positive int, got {chunk!r}")
    n = num_rows(logits)
    n_chunks = -(-plan.real_columns(logits.shape[-1]) // chunk)
    out = torch.empty(n, n_chunks, dtype=torch.float32, device=logits.device)
    if n == 0 or n_chunks == 0:
        return out
    cfg = cfg or CONFIGS[logits.dtype].max_pass
    block_k = min(triton.next_power_of_2(chunk), cfg.block_v)
    block_c = max(1, cfg.block_v // block_k)
    prep = prepare(logits, temperature, None, plan)
    stride_x, _, stride_tau, rows_inner, stride_x_outer, _ = prep.row_args()
    steps = LaunchConfig(block_c, cfg.num_warps)  # programs_per_row counts chunks here
    parts, per_program = programs_per_row(n, n_chunks, steps, logits.device)
    kernels.chunk_max_kernel[(n, parts)](
        prep.x, prep.tau, out, stride_x, stride_tau, rows_inner, stride_x_outer,
        prep.n_real, n_chunks, chunk, per_program,
        IS_BF16=logits.dtype == torch.bfloat16, HAS_TAU=prep.has_tau, BLOCK_C=block_c,
        BLOCK_K=block_k, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        enable_fp_fusion=False,
    )  # fmt: skip
    return out


# --- 7. finalize ---


@on_device
def finalize(
    row_max,
    record,
    target,
    vocab_size,
    ignore_index,
    bad_temperature,
    ranks_disagree=None,
    block_n=None,
):
    """Backend.finalize as one kernel launch with contract.finalize's bits in every field;
    besides the launch only allocations, and nothing waits on the device."""
    n, dev = target.shape[0], target.device
    empty = functools.partial(torch.empty, n, device=dev)
    out = contract.Finalized(
        logprobs=empty(dtype=torch.float32), entropy=empty(dtype=torch.float32),
        lse=empty(dtype=torch.float32), s_hi=empty(dtype=torch.float64),
        s_lo=empty(dtype=torch.float64), log_s=empty(dtype=torch.float64), entropy64=empty(dtype=torch.float64),
        bad=empty(dtype=torch.int64), ignored=empty(dtype=torch.bool),
    )  # fmt: skip
    if n == 0:
        return out
    record = unit_stride(record)
    has_bad_tau = bad_temperature is not None
    bad_tau = unit_stride(bad_temperature).view(torch.uint8) if has_bad_tau else target
    has_disagree = ranks_disagree is not None
    disagree = unit_stride(ranks_disagree).view(torch.uint8) if has_disagree else target
    block_n = block_n or FINALIZE_BLOCK_N
    kernels.finalize_kernel[(-(-n // block_n),)](
        unit_stride(row_max), record, unit_stride(target), bad_tau, disagree,
        out.logprobs.view(torch.int32), out.entropy.view(torch.int32),
        out.lse.view(torch.int32), out.s_hi, out.s_lo, out.log_s, out.entropy64, out.bad,
        out.ignored.view(torch.uint8),
        n, record.stride(0), vocab_size or 0, ignore_index,
        HAS_VOCAB=vocab_size is not None, HAS_BAD_TAU=has_bad_tau,
        HAS_DISAGREE=has_disagree, BLOCK_N=block_n,
        num_warps=FINALIZE_NUM_WARPS, enable_fp_fusion=False,
    )  # fmt: skip
    return out


# GPUs whose fp64 rate is a good share of their fp32 rate (P100, V100, A100, H100/H200,
# B200): the direct kernels. Every other GPU (T4, A10, L4, L40S, consumer parts, fp64-poor
# newer parts) takes the value tables for 16-bit rows of at least TABLE_MIN_COLS columns.
FP64_RICH_CAPABILITIES = {(6, 0), (7, 0), (8, 0), (9, 0), (10, 0)}
# Parts of those architectures whose fp64 was cut (the name decides, not the capability:
# an H20 is sm_90 like an H100, with ~1 TFLOP/s fp64 against 67 by its published specs).
FP64_POOR_NAMES = ("H20",)
# exact_gemm="auto" per device name, once the GPU check has measured a route faster there
# than the capability's default (an empty table: no route has been measured faster yet).
MEASURED_GEMM_ROUTES: dict[str, str] = {}
TABLE_MIN_COLS = 8192


def fp64_rich(device: torch.device) -> bool:
    """Whether `device` runs fp64 at a good share of its fp32 rate: by capability, less
    the FP64_POOR_NAMES parts (a CPU tensor in the interpreter: no)."""
    if device.type != "cuda":
        return False
    if torch.cuda.get_device_capability(device) not in FP64_RICH_CAPABILITIES:
        return False
    name = torch.cuda.get_device_name(device)
    return not any(_names_part(name, part) for part in FP64_POOR_NAMES)


def _names_part(device_name: str, part: str) -> bool:
    """'NVIDIA H20' names part H20; 'NVIDIA H200' does not (whole words only)."""
    return part in device_name.replace("-", " ").split()


# The exact LM head's integer GEMM (linear_contract L3): "fp64" is cuBLAS DGEMM over
# K-chunks (linear_contract.float_exact_dot: every partial sum an integer below 2^53, exact
# in any order); "int8" the nine int8 tensor-core GEMMs of linear_kernels.py; "int8_mm" the
# five diagonal int8 GEMMs of linear_contract.diagonal_exact_dot through torch._int_mm
# (cuBLASLt); "int8_fused" the fused route of linear_kernels.py (the rows quantised and
# sliced in one pass, the five diagonals on tl.dot with L4-L5 in the epilogue: fp32 logits
# out, no int64 or fp64 tensor in memory). "auto": the MEASURED_GEMM_ROUTES entry of the
# device's name, else fp64 where fp64_rich, int8 elsewhere ("int8_mm" and "int8_fused" are
# not yet measured on a GPU, so "auto" does not take them). The same integers and
# roundings on every route (base.EXACT_GEMM_MODES).


class TritonBackend(Backend):
    """the contract on a GPU through Triton (or on CPU tensors under TRITON_INTERPRET=1).

    `value_tables`: "auto" (16-bit rows of at least TABLE_MIN_COLS columns on GPUs that
    are not fp64_rich), "always" (16-bit rows) or "never"; `exact_gemm`: the exact
    LM head's integer GEMM, "auto" (by device name, then fp64 where fp64_rich, else
    int8), "fp64", "int8", "int8_mm" or "int8_fused" (EXACT_GEMM_MODES). Both are speed
    choices only: every mode gives the same bits (value_tables.py, linear_kernels.py)."""

    name = "triton"

    def __init__(self, value_tables: str = "auto", exact_gemm: str = "auto"):
        self.value_tables = check_mode("value_tables", value_tables, VALUE_TABLE_MODES)
        self.exact_gemm = check_mode("exact_gemm", exact_gemm, EXACT_GEMM_MODES)
        self._freeze(value_tables=value_tables, exact_gemm=exact_gemm)

    def uses_tables(self, logits, plan: ShardPlan) -> bool:
        if not value_tables.supports(logits.dtype) or self.value_tables == "never":
            return False
        if self.value_tables == "always":
            return True
        n_real = logits.shape[-1] if plan.vocab_size is None else plan.vocab_size - plan.vocab_start
        return (
            logits.device.type == "cuda"
            and min(n_real, logits.shape[-1]) >= TABLE_MIN_COLS
            and not fp64_rich(logits.device)
        )

    def supports(self, device: torch.device) -> bool:
        return self.unsupported_reason(device) is None

    def unsupported_reason(self, device: torch.device) -> str | None:
        if device.type == "cuda":
            return None if torch.cuda.is_available() else "CUDA is not available"
        if device.type == "cpu":
            if interpreted():
                return None
            return (
                "CPU tensors run only under the Triton interpreter: set TRITON_INTERPRET=1 "
                "before exactlogp's Triton kernels are imported (slow; for testing)"
            )
        return f"the Triton backend runs on CUDA devices, not {device.type}"

    def row_max(self, logits, temperature, keep_mask, plan):
        return row_max(logits, temperature, keep_mask, plan)

    def chunk_max(self, logits, temperature, plan, chunk):
        return chunk_max(logits, temperature, plan, chunk)

    def class_max(self, z, cls, skip, classes):
        return class_max(z, cls, skip, classes)

    def partials(self, logits, target, temperature, keep_mask, row_max_, plan):
        if self.uses_tables(logits, plan):
            return _tableson_device(logits, "sums")(
                logits, target, temperature, keep_mask, row_max_, plan
            )[1]
        return partials(logits, target, temperature, keep_mask, row_max_, plan)

    def forward_unsharded(self, logits, target, temperature, keep_mask, plan, keep_stats=True):
        if not self.uses_tables(logits, plan):
            return super().forward_unsharded(logits, target, temperature, keep_mask, plan)
        row_max, record = _tableson_device(logits, "sums")(
            logits, target, temperature, keep_mask, None, plan
        )  # the max comes from the row's distinct values: one read of the logits less
        return self.finish_unsharded(row_max, record, target, temperature, plan)

    def finalize(
        self, row_max, record, target, vocab_size, ignore_index, bad_temperature,
        ranks_disagree=None,
    ):  # fmt: skip
        return finalize(
            row_max, record, target, vocab_size, ignore_index, bad_temperature, ranks_disagree
        )

    def grad(self, logits, target, temperature, keep_mask, stats: GradStats, plan):
        if self.uses_tables(logits, plan):
            return _tableson_device(logits, "grad")(
                logits, target, temperature, keep_mask, stats, plan
            )
        return grad(logits, target, temperature, keep_mask, stats, plan)

    def gemm_path(self, device: torch.device) -> str:
        """How exact_dot computes on `device`: one of EXACT_GEMM_MODES but "auto"."""
        if self.exact_gemm != "auto":
            return self.exact_gemm
        if device.type == "cuda":
            name = torch.cuda.get_device_name(device)
            for part, route in MEASURED_GEMM_ROUTES.items():
                if _names_part(name, part):
                    return route
        return "fp64" if fp64_rich(device) else "int8"

    def exact_dot(self, a, c):
        """linear_contract.exact_dot: cuBLAS DGEMM over K-chunks where fp64 is fast (on an
        H200 the fused head's forward took 0.26x the time it took on the int8 kernel,
        docs/performance_gpu.md), else nine int8 GEMMs with int32 accumulation
        (linear_kernels.py). The same integers everywhere."""
        if self.gemm_path(a.device) == "fp64":
            return super().exact_dot(a, c)
        from . import linear_kernels

        if self.gemm_path(a.device) == "int8_mm":
            return on_device(linear_kernels.diagonal_dot)(a, c)
        return on_device(linear_kernels.exact_dot)(a, c)

    def fused_head(self, device: torch.device) -> bool:
        return self.gemm_path(device) == "int8_fused"

    def head_slices(self, x, e, finite, reverse: bool):
        """linear_kernels.head_slices: x's rows quantised into their int8 diagonal layout."""
        from . import linear_kernels

        return on_device(linear_kernels.head_slices)(x, e, finite, reverse)

    def head_logits(self, a3, row_scale, c3, col_scale, bias, logit_scale, out=None,
                    max_of=None):  # fmt: skip
        """linear_kernels.head_logits: L3-L5 of a block of logits in one kernel (and, with
        max_of = (temperature, real columns), their row_max from its epilogue)."""
        from . import linear_kernels

        return on_device(linear_kernels.head_logits)(
            a3, row_scale, c3, col_scale, bias, logit_scale, out, max_of=max_of
        )


def _tableson_device(logits, name: str):
    """value_tables.<name>, launched under the logits' device."""
    from . import value_tables

    return on_device(getattr(value_tables, name))
