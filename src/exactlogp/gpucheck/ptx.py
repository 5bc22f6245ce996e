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
division: the max and partials passes). Kernels: max pass, partials pass, finalize, gradient,
the exact cut's chunk maxima, the value tables' kernels, the exact LM head's int8 GEMMs
and the class maxima of its backward's predicted grid.
What is compiled is the specialisation a GPU run JITs: launch.py's own launch on the
Qwen3-Next shape is captured (its arguments, launch options and grid) and bound by
Triton's own binder, so the dtypes, divisibility hints and constexprs are the real ones.
The variants named rows=1 are a decode step's launch: Triton passes an integer argument
equal to 1 as a constant, so code that treats a size as a tensor compiles at 1024 rows and
fails there (the exact GEMM did, on its first GPU run).
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
from ..backends import ShardPlan
from ..backends.triton import kernels, launch, linear_kernels, prepare, value_tables
from ..cut.candidates import CHUNK
from ..temperature import Temperature

INTERPRETED = "run without TRITON_INTERPRET=1: the check compiles the kernels"

# The launch whose specialisation is compiled: the Qwen3-Next shape on an H100-sized GPU.
ROWS, VOCAB, SMS = 1024, 151936, 132


@dataclass(frozen=True)
class Variant:
    kernel: str  # "row_max" | "partials" | "grad" | "finalize" | "tables" | "tables_grad"
    #              | "chunk_max" | "exact_dot" | "head" (the fused LM head: head_slices,
    #              head_logits) | "class_max" (its backward's predicted grid)
    dtype: torch.dtype | None  # of the logits (head: of the hidden states); None for
    #                            finalize and exact_dot
    flags: tuple[str, ...] = ()  # "tau", "keep", "entropy"; finalize: "vocab_size", "bad_tau"
    rows: int = ROWS  # 1: a decode step (sizes of 1 are compile-time constants)

    @property
    def name(self) -> str:
        head = [str(self.dtype).split(".")[-1]] if self.dtype is not None else []
        tail = [] if self.rows == ROWS else [f"rows={self.rows}"]
        return f"{self.kernel}[{'+'.join(head + list(self.flags) + tail)}]"


def variants(quick: bool) -> list[Variant]:
    bf16, f16, f32 = torch.bfloat16, torch.float16, torch.float32
    full = [
        Variant("row_max", bf16, ("tau", "keep")),
        Variant("partials", bf16, ("tau", "keep", "entropy")),
        Variant("finalize", None, ("vocab_size", "bad_tau", "disagree")),
        Variant("grad", bf16, ("tau", "keep", "entropy")),
        # value tables (value_tables.py): count, list and sums; count, list, the values'
        # gradients, the gather and the target column
        Variant("tables", bf16, ("tau", "keep", "entropy")),
        Variant("tables_grad", bf16, ("tau", "keep", "entropy")),
        Variant("chunk_max", bf16, ("tau",)),  # the exact cut's chunk maxima (cut.candidates.CHUNK)
        Variant("exact_dot", None),
        Variant("head", bf16),
        Variant("class_max", None),  # the fused head's predicted grid (linear._GridBound)
        # a decode step: one row
        Variant("row_max", bf16, ("tau", "keep"), rows=1),
        Variant("partials", bf16, ("tau", "keep", "entropy"), rows=1),
        Variant("finalize", None, ("vocab_size", "bad_tau", "disagree"), rows=1),
        Variant("grad", bf16, ("tau", "keep", "entropy"), rows=1),
        Variant("tables", bf16, ("tau", "keep", "entropy"), rows=1),
        Variant("chunk_max", bf16, ("tau",), rows=1),
        Variant("exact_dot", None, rows=1),
    ]
    if quick:
        return full
    return full + [
        Variant("row_max", f32),
        Variant("partials", bf16),
        Variant("partials", f16),
        Variant("partials", f32, ("tau", "entropy")),
        Variant("finalize", None),
        Variant("grad", f16),
        Variant("grad", f32, ("tau", "keep", "entropy")),
        Variant("tables", f16),
        Variant("tables_grad", f16, ("entropy",)),
        Variant("head", bf16, rows=1),
    ]


# --- the launch a GPU run makes, captured instead of run ---


class _Capture:
    """Stands in for a @triton.jit kernel: `kernel[grid](*args, **kwargs)` is recorded."""

    def __init__(self, fn, calls: list):
        self.fn, self.calls = fn, calls

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((self.fn, args, kwargs))


_KERNELS = {
    kernels: ("row_max_kernel", "partials_kernel", "finalize_kernel", "grad_kernel",
              "chunk_max_kernel", "class_max_kernel"),
    value_tables: ("count_kernel", "list_kernel", "sums_kernel", "grad_values_kernel",
                   "gather_kernel", "grad_target_kernel"),
    linear_kernels: ("exact_dot_kernel", "head_slices_kernel", "head_logits_kernel"),
}  # fmt: skip
# integer-only kernels: launched without enable_fp_fusion, no fp64 division
_INTEGER_ONLY = {"count_kernel", "list_kernel", "gather_kernel", "exact_dot_kernel"}
HIDDEN = 2048  # the exact GEMM's K: Qwen3-Next's hidden size


def launched(v: Variant, vocab: int = VOCAB, sms: int = SMS) -> list:
    """[(kernel, args, kwargs)] of the launches the Triton backend makes for `v` on `v.rows`
    x `vocab` logits on a GPU of `sms` multiprocessors (the first of each kernel), from the
    launch code itself: uninitialised CPU tensors of the real dtypes, shapes and strides
    stand in for the device ones (the compile specialises on dtypes, pointer alignment and
    which integers are 1 or multiples of 16, never on values in memory)."""
    calls: list = []
    saved = {(m, name): getattr(m, name) for m, names in _KERNELS.items() for name in names}
    saved_programs = prepare.target_programs
    try:
        for (module, name), fn in saved.items():
            setattr(module, name, _Capture(fn, calls))
        prepare.target_programs = lambda device: prepare.PROGRAMS_PER_SM * sms
        _launch(v, v.rows, vocab)
    finally:
        for (module, name), fn in saved.items():
            setattr(module, name, fn)
        prepare.target_programs = saved_programs
    first = {}
    for fn, args, kwargs in calls:
        first.setdefault(fn, (fn, args, kwargs))
    return list(first.values())


def _same_specialisation(n: int) -> int:
    """The smallest size Triton compiles like `n`: it specialises an integer argument only
    on being 1 and on being a multiple of 16, so a TP4 shard's 37984 weight rows compile
    as 16 do (and are sliced in a fraction of the time)."""
    return 1 if n == 1 else 16 if n % 16 == 0 else 17


def _launch(v: Variant, rows: int, vocab: int) -> None:
    empty = torch.empty
    if v.kernel == "exact_dot":  # the logits of `rows` hidden rows and a TP4 shard's weight
        zeros = torch.zeros  # int8_slices does arithmetic on them
        weight = zeros(_same_specialisation(vocab // 4), HIDDEN)
        linear_kernels.exact_dot(zeros(rows, HIDDEN), weight)
        return
    if v.kernel == "class_max":  # the TP4 shard's logits of `rows` rows, 32 classes
        p = _same_specialisation(vocab // 4)
        launch.class_max(empty(rows, p), empty(p, dtype=torch.int32),
                         empty(rows, dtype=torch.int64), 32)  # fmt: skip
        return
    if v.kernel == "head":  # the same, on the fused route, with a bias and a logit scale
        p = _same_specialisation(vocab // 4)
        e, finite = empty(rows, dtype=torch.int64), empty(rows, dtype=torch.bool)
        a3 = linear_kernels.head_slices(empty(rows, HIDDEN, dtype=v.dtype), e, finite, True)
        c3, col_scale = empty(p, 3 * HIDDEN, dtype=torch.int8), empty(p, dtype=torch.float64)
        row_scale, bias = empty(rows, dtype=torch.float64), empty(p, dtype=v.dtype)
        tau = Temperature.of(0.7)  # the forward's launch: with the row max in the epilogue
        linear_kernels.head_logits(a3, row_scale, c3, col_scale, bias, 0.5, max_of=(tau, p))
        return
    target = empty(rows, dtype=torch.int64)
    row_max = empty(rows, dtype=torch.float32)
    if v.kernel == "finalize":
        launch.finalize(
            row_max, empty(rows, contract.NUM_COLS, dtype=torch.int64), target,
            vocab if "vocab_size" in v.flags else None, -100,
            empty(rows, dtype=torch.bool) if "bad_tau" in v.flags else None,
            empty(rows, dtype=torch.bool) if "disagree" in v.flags else None,
        )  # fmt: skip
        return
    logits = empty(rows, vocab, dtype=v.dtype)
    tau = Temperature.of(0.7 if "tau" in v.flags else 1.0)
    keep = empty(rows, vocab, dtype=torch.bool) if "keep" in v.flags else None
    plan = ShardPlan(0, None, -100, "entropy" in v.flags)
    f64 = [empty(rows, dtype=torch.float64) for _ in range(8)]
    stats = contract.GradStats(row_max, *f64, empty(rows, dtype=torch.bool),
                               empty(rows, dtype=torch.bool))  # fmt: skip
    if v.kernel == "row_max":
        launch.row_max(logits, tau, keep, plan)
    elif v.kernel == "chunk_max":
        launch.chunk_max(logits, tau, plan, CHUNK)
    elif v.kernel == "partials":
        launch.partials(logits, target, tau, keep, row_max, plan)
    elif v.kernel == "grad":
        launch.grad(logits, target, tau, keep, stats, plan)
    elif v.kernel == "tables":
        value_tables.sums(logits, target, tau, keep, None, plan)
    else:
        value_tables.grad(logits, target, tau, keep, stats, plan)


def compile_launched(fn, args: tuple, kwargs: dict, arch: int):
    """triton.compile of exactly the specialisation `fn[grid](*args, **kwargs)` would JIT on
    an sm_`arch` device: Triton's own argument binder and packer (runtime/jit.py), so its
    signature, constexprs and divisibility attributes are the launch's. Those helpers are
    Triton internals; pyproject pins the Triton range this was verified with."""
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(
        backend, kwargs, bound, specialization, options
    )
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=target, options=options.__dict__)


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


# +-0, +-1, +-inf, and the NaN the chunk maxima write for a chunk holding a NaN
_FP32_OK = {"0f00000000", "0f80000000", "0f3F800000", "0fBF800000", "0f7F800000", "0fFF800000",
            "0f7FC00000"}  # fmt: skip
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


# kernels without an fp64 division: no DFMA may appear in their SASS at all
_NO_DIVISION = {
    "row_max_kernel",
    "chunk_max_kernel",
    "partials_kernel",
    "sums_kernel",
    *_INTEGER_ONLY,
}


def compile_and_check(v: Variant, arch: int) -> list[Result]:
    results = []
    calls = launched(v)
    for fn, args, kwargs in calls:
        name = v.name if len(calls) == 1 else f"{v.name}:{fn.__name__.removesuffix('_kernel')}"
        uses_fp = "enable_fp_fusion" in kwargs or fn.__name__ not in _INTEGER_ONLY
        if uses_fp and kwargs.get("enable_fp_fusion") is not False:
            raise RuntimeError(f"{name}: launched without enable_fp_fusion=False")
        compiled = compile_launched(fn, args, kwargs, arch)
        ptx, llir = compiled.asm["ptx"], compiled.asm.get("llir", "")
        res = Result(variant=name, ok=True, problems=check_ptx(ptx, llir, v.kernel))
        res.f64_ops_ptx = len(re.findall(r"\b(add|sub|mul)\.rn\.f64\b", ptx))
        res.f64_div_ptx = len(re.findall(r"\bdiv\.rn\.f64\b", ptx))
        res.registers, res.spills, res.sass_counts = sass_report(compiled.asm.get("cubin", b""))
        if fn.__name__ in _NO_DIVISION and res.sass_counts.get("DFMA"):
            res.problems.append(f"{res.sass_counts['DFMA']} DFMA in SASS")
        res.ok = not res.problems
        results.append(res)
    return results


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
    return [r for v in variants(quick) for r in compile_and_check(v, arch)]


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
