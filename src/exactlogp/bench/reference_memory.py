"""Peak extra memory and time of the reference backend at the Qwen3-Next shape.

    python benchmarks/reference_memory.py [--rows 1024] [--vocab 151936]

Runs each measurement in a fresh process; prints one Markdown table row per case.
"""

from __future__ import annotations

import argparse
import subprocess
import sys

SCRIPT = """
import resource, sys, time, torch, exactlogp
rows, vocab, backward = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1"
x = torch.empty(rows, vocab, dtype=torch.bfloat16).normal_(generator=torch.Generator().manual_seed(0))
t = torch.randint(0, vocab, (rows,))
x.requires_grad_(backward)
peak = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
base = peak()
start = time.perf_counter()
res = exactlogp.selected_logprobs(x, t, backend="reference", with_entropy=True)
if backward:
    (res.logprobs.sum() + res.entropy.sum()).backward()
print(peak() - base, time.perf_counter() - start)
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=151936)
    args = parser.parse_args(argv)
    print("| pass | rows x vocab (bf16) | extra peak RSS (MiB) | gradient (MiB) | seconds |")
    print("|---|---|---|---|---|")
    for backward in (False, True):
        out = subprocess.run(
            [sys.executable, "-c", SCRIPT, str(args.rows), str(args.vocab), str(int(backward))],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        extra, seconds = map(float, out.stdout.split())
        grad = args.rows * args.vocab * 2 / 2**20 if backward else 0.0
        name = "forward+backward" if backward else "forward"
        print(f"| {name} | {args.rows} x {args.vocab} | {extra:.0f} | {grad:.0f} | {seconds:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
