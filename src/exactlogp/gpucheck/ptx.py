"""Compile the Triton kernels for a GPU without one, and check the code keeps the contract.

The interpreter tests prove the kernels' arithmetic; this proves the compiled code does
the same arithmetic. Triton compiles to PTX (and, with its bundled ptxas, to a cubin) on
any machine, so these checks run in CI:

  no-fma       no fma instruction: every fp add/sub/mul is a separately rounded .rn
               operation (enable_fp_fusion=False), which ptxas never contracts
  ieee-div     floating divisions are div.rn.f32 / div.rn.f64 only (no div.full/approx)
  no-approx    no ex2/lg2/sin/cos/rcp/rsqrt/sqrt approximations, no .ftz, no libdevice
  constants    every fp64 immediate is one of that kernel's contract constants (or its
               negation) at full precision: a constant rounded through fp32 would show up
  fp-rounding  every f32/f64 add, sub and mul carries the explicit .rn

It also reports registers, spills, fp64 divisions and SASS instruction counts (DFMA must
be 0 outside the IEEE fp64 division sequences, so it is checked on the kernels without a
division: the max and partials passes). Kernels: max pass, partials pass, finalize, gradient.
It needs the compiled kernels: under TRITON_INTERPRET=1 it refuses to run.

    python benchmarks/triton_ptx_check.py [--arch 90] [--quick] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from .. import contract
from ..backends.triton import kernels, launch

INTERPRETED = "run without TRITON_INTERPRET=1: the check compiles the kernels"

_TYPES = {torch.bfloat16: "*i16", torch.float16: "*fp16", torch.float32: "*fp32"}
_OUT_BITS = {torch.bfloat16: "*i16", torch.float16: "*i16", torch.float32: "*i32"}


@dataclass(frozen=True)
class Variant:
    kernel: str  # "row_max" | "partials" | "grad" | "finalize"
    dtype: torch.dtype | None  # of the logits; None for finalize, which reads none
    flags: tuple[str, ...] = ()  # "tau", "keep", "entropy"; finalize: "vocab_size", "bad_tau"

    @property
    def name(self) -> str:
        head = [str(self.dtype).split(".")[-1]] if self.dtype is not None else []
        return f"{self.kernel}[{'+'.join(head + list(self.flags))}]"


def variants(quick: bool) -> list[Variant]:
    bf16, f16, f32 = torch.bfloat16, torch.float16, torch.float32
    full = [
        Variant("row_max", bf16, ("tau", "keep")),
        Variant("partials", bf16, ("tau", "keep", "entropy")),
        Variant("finalize", None, ("vocab_size", "bad_tau", "disagree")),
        Variant("grad", bf16, ("tau", "keep", "entropy")),
    ]
    if quick:
        return full
    return full + [
        Variant("row_max", f32),
        Variant("partials", f16),
        Variant("partials", f32, ("tau", "entropy")),
        Variant("finalize", None),
        Variant("grad", f16),
        Variant("grad", f32, ("tau", "keep", "entropy")),
    ]


def _finalize_signature(v: Variant) -> tuple[object, dict, dict, launch.LaunchConfig]:
    ptrs = {"max_ptr": "*fp32", "rec_ptr": "*i64", "target_ptr": "*i64", "bad_tau_ptr": "*u8",
            "disagree_ptr": "*u8", "logprobs_ptr": "*i32", "entropy_ptr": "*i32",
            "lse_ptr": "*i32", "s_hi_ptr": "*fp64", "s_lo_ptr": "*fp64", "log_s_ptr": "*fp64",
            "ent64_ptr": "*fp64", "bad_ptr": "*i64", "ignored_ptr": "*u8"}  # fmt: skip
    ints = {"n_rows": "i32", "stride_rec": "i32", "vocab_size": "i32", "ignore_index": "i64"}
    constexprs = {"HAS_VOCAB": "vocab_size" in v.flags, "HAS_BAD_TAU": "bad_tau" in v.flags,
                  "HAS_DISAGREE": "disagree" in v.flags,
                  "BLOCK_N": launch.FINALIZE_BLOCK_N}  # fmt: skip
    signature = {**ptrs, **ints, **dict.fromkeys(constexprs, "constexpr")}
    cfg = launch.LaunchConfig(block_v=launch.FINALIZE_BLOCK_N, num_warps=launch.FINALIZE_NUM_WARPS)
    return kernels.finalize_kernel, signature, constexprs, cfg


def _signature(v: Variant) -> tuple[object, dict, dict, launch.LaunchConfig]:
    if v.kernel == "finalize":
        return _finalize_signature(v)
    cfgs = launch.CONFIGS[v.dtype]
    x = _TYPES[v.dtype]
    flags = {"IS_BF16": v.dtype == torch.bfloat16, "HAS_TAU": "tau" in v.flags,
             "HAS_KEEP": "keep" in v.flags}  # fmt: skip
    ints = ["stride_x", "stride_keep", "stride_tau", "n_real"]
    if v.kernel == "row_max":
        ptrs = {"x_ptr": x, "keep_ptr": "*u8", "tau_ptr": "*fp32", "out_ptr": "*fp32"}
        ints += ["cols_per_program"]
        fn, cfg, extra = kernels.row_max_kernel, cfgs.max_pass, {}
    elif v.kernel == "partials":
        ptrs = {"x_ptr": x, "keep_ptr": "*u8", "tau_ptr": "*fp32", "max_ptr": "*fp32",
                "target_ptr": "*i64", "table_ptr": "*fp64", "out_ptr": "*i64"}  # fmt: skip
        ints += ["vocab_start", "ignore_index", "cols_per_program"]
        fn, cfg = kernels.partials_kernel, cfgs.partials
        extra = {"WITH_ENTROPY": "entropy" in v.flags}
    else:
        ptrs = {"x_ptr": x, "keep_ptr": "*u8", "tau_ptr": "*fp32", "tau64_ptr": "*fp64",
                "target_ptr": "*i64", "table_ptr": "*fp64", "max_ptr": "*fp32"}  # fmt: skip
        ptrs |= {
            f"{k}_ptr": "*fp64"
            for k in ("s_hi", "s_lo", "log_s", "ent", "coef_a", "coef_b", "coef_t", "coef_l")
        }
        ptrs |= {"row_nan_ptr": "*u8", "out_ptr": _OUT_BITS[v.dtype]}
        ints = ["stride_x", "stride_keep", "stride_tau", "n_cols", "n_real", "vocab_start",
                "ignore_index"]  # fmt: skip
        kind = launch._GRAD_KIND[v.dtype][0]
        fn, cfg = kernels.grad_kernel, cfgs.grad
        extra = {"WITH_ENTROPY": "entropy" in v.flags, "OUT_KIND": kind}
    constexprs = {**flags, **extra, "BLOCK_V": cfg.block_v}
    signature = {**ptrs, **{name: "i32" for name in ints}, **dict.fromkeys(constexprs, "constexpr")}
    return fn, signature, constexprs, cfg


# --- the rules ---


def _f64_hex(value: float) -> str:
    """PTX spelling of a binary64 immediate."""
    return "0d" + format(struct.unpack("<Q", struct.pack("<d", value))[0], "016X")


def allowed_f64_immediates(kernel: str) -> set[str]:
    """The fp64 constants each kernel's contract stage uses (0, 1 and 2 are exact anywhere)."""
    if kernel == "finalize":  # limbs_to_double_double and log_c
        values = [0.0, 1.0, 2.0, contract.LIMB_UNIT, contract.LIMB2_UNIT, contract.SQRT_HALF,
                  contract.LN2_HI, contract.LN2_LO, *contract.LOG_POLY]  # fmt: skip
    else:  # exp_c and quantize
        values = [0.0, 1.0, contract.CUTOFF, contract.MAGIC, contract.LIMB_SCALE,
                  contract.INV_LN2_32, contract.LN2_32_HI, contract.LN2_32_LO, *contract.EXP_POLY]  # fmt: skip
    return {_f64_hex(s * v) for v in values for s in (1.0, -1.0)}


_FP32_OK = {"0f00000000", "0f80000000", "0f3F800000", "0fBF800000", "0f7F800000", "0fFF800000"}
_FORBIDDEN = re.compile(
    r"\b(fma|ex2|lg2|sin|cos|tanh|rsqrt)\.|\b(rcp|sqrt)\.approx|\.ftz\b|\bdiv\.(full|approx)"
)
_UNROUNDED = re.compile(r"\b(add|sub|mul)\.f(32|64)\b")


@dataclass
class Result:
    variant: str
    ok: bool
    problems: list[str] = field(default_factory=list)
    registers: int | None = None
    spills: str | None = None
    f64_ops_ptx: int = 0
    f64_div_ptx: int = 0
    sass_counts: dict = field(default_factory=dict)


def check_ptx(ptx: str, llir: str, kernel: str) -> list[str]:
    problems = []
    for line in ptx.splitlines():
        code = line.split("//")[0]
        if _FORBIDDEN.search(code):
            problems.append(f"forbidden instruction: {code.strip()}")
        if _UNROUNDED.search(code):
            problems.append(f"fp op without explicit .rn (contractible): {code.strip()}")
    allowed = allowed_f64_immediates(kernel)
    for imm in sorted(set(re.findall(r"0d[0-9A-F]{16}", ptx)) - allowed):
        problems.append(f"fp64 immediate {imm} is not a contract constant")
    for imm in sorted(set(re.findall(r"0f[0-9A-F]{8}", ptx)) - _FP32_OK):
        problems.append(f"unexpected fp32 immediate {imm}")
    if "__nv_" in llir:
        problems.append("calls a libdevice function")
    return problems[:20]


def _cuobjdump() -> str | None:
    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    return str(path) if path.exists() else shutil.which("cuobjdump")


def sass_report(cubin: bytes) -> tuple[int | None, str | None, dict]:
    tool = _cuobjdump()
    if tool is None or not cubin:
        return None, None, {}
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        res = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True)
        sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True).stdout
    regs = re.search(r"REG:(\d+)", res.stdout)
    spill = re.search(r"LOCAL:(\d+)", res.stdout)
    ops = re.findall(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9]*)", sass)
    counts = {op: ops.count(op) for op in ("DADD", "DMUL", "DFMA", "FFMA", "MUFU", "F2I", "I2F")}
    return (int(regs.group(1)) if regs else None), (spill.group(1) if spill else None), counts


def compile_and_check(v: Variant, arch: int) -> Result:
    fn, signature, constexprs, cfg = _signature(v)
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    options = {"enable_fp_fusion": False, "num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
    ptx, llir = compiled.asm["ptx"], compiled.asm.get("llir", "")
    res = Result(variant=v.name, ok=True, problems=check_ptx(ptx, llir, v.kernel))
    res.f64_ops_ptx = len(re.findall(r"\b(add|sub|mul)\.rn\.f64\b", ptx))
    res.f64_div_ptx = len(re.findall(r"\bdiv\.rn\.f64\b", ptx))
    res.registers, res.spills, res.sass_counts = sass_report(compiled.asm.get("cubin", b""))
    if v.kernel in ("row_max", "partials") and res.sass_counts.get("DFMA"):
        res.problems.append(f"{res.sass_counts['DFMA']} DFMA in SASS")
    res.ok = not res.problems
    return res


def markdown(results: list[Result], arch: int) -> str:
    lines = [
        f"Triton {triton.__version__}, sm_{arch}, enable_fp_fusion=False",
        "",
        "| kernel | ok | registers | spill bytes | fp64 add/sub/mul (PTX) | fp64 div (PTX) "
        "| SASS DADD/DMUL/DFMA |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        c = r.sass_counts
        sass = f"{c.get('DADD', '-')}/{c.get('DMUL', '-')}/{c.get('DFMA', '-')}" if c else "-"
        lines.append(
            f"| {r.variant} | {'yes' if r.ok else 'NO'} | {r.registers} | {r.spills} "
            f"| {r.f64_ops_ptx} | {r.f64_div_ptx} | {sass} |"
        )
    return "\n".join(lines)


def check(arch: int, quick: bool) -> list[Result]:
    """Every variant compiled for sm_`arch` and checked; raises where it cannot compile."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError(INTERPRETED)
    return [compile_and_check(v, arch) for v in variants(quick)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90")
    parser.add_argument("--quick", action="store_true", help="one variant per kernel")
    parser.add_argument("--out", type=Path, help="write ptx_check.json and ptx_check.md here")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit(INTERPRETED)
    from triton.compiler.errors import CompilationError

    try:
        results = check(args.arch, args.quick)
    except CompilationError:  # the kernels' own code (or this module's signatures) is wrong
        raise
    except Exception as exc:  # no compiler for this target on this machine
        print(f"cannot compile for sm_{args.arch} here: {type(exc).__name__}: {exc}")
        return 2
    table = markdown(results, args.arch)
    print(table)
    for r in results:
        for p in r.problems:
            print(f"{r.variant}: {p}")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "ptx_check.json").write_text(json.dumps([asdict(r) for r in results], indent=1))
        (args.out / "ptx_check.md").write_text(table + "\n")
    return 0 if all(r.ok for r in results) else 1
