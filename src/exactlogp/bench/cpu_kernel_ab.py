"""A/B of two versions of the CPU kernels' C source, interleaved in one process.

Both sources are compiled as `exactlogp.backends.cpu_build` compiles the library for this
CPU (its flags and generated constants header) into a private temporary directory, twice
each, and the four libraries are loaded side by side in the order A B B' A' (so that
neither source gains from being loaded first). `forward_unsharded` (the fused forward
without a TP group) of each is timed on the same logits, the four in an order shuffled per
round; each source's time is the median over its two copies' runs. It prints the ratio
B/A, and the control A'/A of the same source against itself: a B/A no further from 1 than
the control is within the noise of the run. The libraries' row records are compared bit
for bit (a speed change must not move a bit). Use it to measure a kernel change on a
shared machine, where two runs one after the other differ by more than most changes:

    git show HEAD:src/exactlogp/backends/csrc/exactlogp_cpu.c > /tmp/before.c
    PYTHONPATH=src python benchmarks/cpu_kernel_ab.py /tmp/before.c \\
        src/exactlogp/backends/csrc/exactlogp_cpu.c --tokens 1024 --dtype fp32
"""

from __future__ import annotations

import argparse
import ctypes
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from exactlogp.backends import cpu, cpu_build
from exactlogp.backends.base import ShardPlan
from exactlogp.temperature import ONE
from exactlogp.testing import llm_like_logits

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# "fp32-of-bf16": bf16 logits cast to fp32 (rows the kernels count as bf16)
CHOICES = sorted(DTYPES) + ["fp32-of-bf16"]


def _backend(source: Path, directory: Path, name: str, isa: str) -> cpu.CpuBackend:
    """A CpuBackend whose kernels are `source`, built as cpu_build builds the library."""
    out = directory / f"{name}.so"
    header = cpu_build.constants_header()
    cpu_build._compile(cpu_build.find_compiler(), source.read_text(), header, isa, out)
    backend = cpu.CpuBackend()
    backend._lib = cpu._bind(ctypes.CDLL(str(out)))
    return backend


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("a", type=Path, help="C source A (e.g. the committed one)")
    p.add_argument("b", type=Path, help="C source B (e.g. the working tree's)")
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--dtype", choices=CHOICES, default="bf16")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--seed", type=int, default=0, help="of the shuffled order per round")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    isa = cpu_build.default_isa()
    rng = random.Random(args.seed)
    # load order A B B' A'; copy k of source (k % 2 == 0 ? A : B) is backends[k]
    order = [(args.a, "a"), (args.b, "b"), (args.b, "b2"), (args.a, "a2")]
    with tempfile.TemporaryDirectory(prefix="exactlogp-ab-") as tmp:
        directory = Path(tmp)
        backends = [_backend(src, directory, name, isa) for src, name in order]
        dtype = DTYPES.get(args.dtype, torch.bfloat16)
        x, target = llm_like_logits(args.tokens, args.vocab, dtype, 0, targets="uniform")
        x = x.float() if args.dtype == "fp32-of-bf16" else x
        plan = ShardPlan(0, None, -100, False)
        records = [b.forward_unsharded(x, target, ONE, None, plan)[1] for b in backends]
        same = all(torch.equal(records[0], r) for r in records[1:])
        times: list[list[float]] = [[] for _ in backends]
        for _ in range(args.rounds):
            for i in rng.sample(range(len(backends)), len(backends)):
                start = time.perf_counter()
                backends[i].forward_unsharded(x, target, ONE, None, plan)
                times[i].append(time.perf_counter() - start)
    med = lambda ts: statistics.median(ts) * 1e3  # noqa: E731
    a, b = med(times[0] + times[3]), med(times[1] + times[2])
    control = med(times[3]) / med(times[0])
    print(
        f"{args.tokens} x {args.vocab} {args.dtype}, {isa}, {torch.get_num_threads()} threads, "
        f"{args.rounds} rounds: A {a:.3f} ms, B {b:.3f} ms, B/A {b / a:.3f} "
        f"(control A'/A {control:.3f}); records {'bitwise equal' if same else 'DIFFER'}"
    )
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
