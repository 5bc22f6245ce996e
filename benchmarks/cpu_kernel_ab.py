"""A/B of two versions of the CPU kernels' C source, interleaved in one process.

Both sources are compiled as `exactlogp.backends.cpu_build` compiles the library for this
CPU (its flags and generated constants header) into a private temporary directory, loaded
side by side, and `forward_unsharded` (the fused forward without a TP group) of each is
timed on the same logits, alternating A B / B A per round; the medians and their ratio are
printed, and the two libraries' row records are compared bit for bit (a speed change must
not move a bit). Use it to measure a kernel change on a shared machine, where two runs one
after the other differ by more than most changes:

    git show HEAD:src/exactlogp/backends/csrc/exactlogp_cpu.c > /tmp/before.c
    PYTHONPATH=src python benchmarks/cpu_kernel_ab.py /tmp/before.c \\
        src/exactlogp/backends/csrc/exactlogp_cpu.c --tokens 1024 --dtype fp32
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import tempfile
import time
from pathlib import Path

import torch

from exactlogp.backends import cpu, cpu_build
from exactlogp.backends.base import ShardPlan
from exactlogp.testing import llm_like_logits

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _backend(source: Path, directory: Path, name: str, isa: str) -> cpu.CpuBackend:
    """A CpuBackend whose kernels are `source`, built as cpu_build builds the library."""
    out = directory / f"{name}.so"
    header = cpu_build.constants_header()
    cpu_build._compile(cpu_build.find_compiler(), source.read_text(), header, isa, out)
    backend = cpu.CpuBackend()
    backend._lib = cpu._bind(ctypes.CDLL(str(out)))
    return backend


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("a", type=Path, help="C source A (e.g. the committed one)")
    p.add_argument("b", type=Path, help="C source B (e.g. the working tree's)")
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    isa = cpu_build.default_isa()
    with tempfile.TemporaryDirectory(prefix="exactlogp-ab-") as tmp:
        directory = Path(tmp)
        backends = [_backend(args.a, directory, "a", isa), _backend(args.b, directory, "b", isa)]
        x, target = llm_like_logits(
            args.tokens, args.vocab, DTYPES[args.dtype], 0, targets="uniform"
        )
        plan = ShardPlan(0, None, -100, False)
        records = [b.forward_unsharded(x, target, 1.0, None, plan)[1] for b in backends]
        same = torch.equal(records[0], records[1])
        times: list[list[float]] = [[], []]
        for r in range(args.rounds):
            for i in (0, 1) if r % 2 == 0 else (1, 0):
                start = time.perf_counter()
                backends[i].forward_unsharded(x, target, 1.0, None, plan)
                times[i].append(time.perf_counter() - start)
    a, b = (statistics.median(t) * 1e3 for t in times)
    print(
        f"{args.tokens} x {args.vocab} {args.dtype}, {isa}, {torch.get_num_threads()} threads, "
        f"{args.rounds} rounds: A {a:.3f} ms, B {b:.3f} ms, B/A {b / a:.3f}; "
        f"records {'bitwise equal' if same else 'DIFFER'}"
    )
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
