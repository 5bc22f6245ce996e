"""What the fused LM head's hidden-state agreement costs: agreement.row_hash of the hidden
states (one read of them, elementwise integer work) against the forward it protects, on
this machine.

    PYTHONPATH=src python benchmarks/row_hash.py [--tokens 1024 --hidden 2048 --vocab 8192]

Interleaved, shuffled rounds (report.measure); medians. The forward is
linear_selected_logprobs without a TP group (the hash runs only with one, so the forward
timed here is the TP forward less its collectives and the hash).
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

import exactlogp
from exactlogp.agreement import row_hash
from exactlogp.report import measure
from exactlogp.testing import lm_head_inputs


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=8192, help="this rank's LM-head rows")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    h, w, t = lm_head_inputs(args.tokens, args.hidden, args.vocab, torch.bfloat16, seed=0)
    steps = {
        "row_hash(hidden)": lambda: row_hash(h),
        "linear_selected_logprobs forward": lambda: exactlogp.linear_selected_logprobs(
            h, w, t, validate=False
        ),
    }
    seconds = measure.interleaved(steps, args.repeats, warmup=1)
    med = {k: statistics.median(v) for k, v in seconds.items()}
    shape = f"{args.tokens} x {args.hidden} x {args.vocab} bf16"
    print(f"| step ({shape}, {args.repeats} rounds) | median ms | vs the forward |")
    print("|---|---|---|")
    forward = med["linear_selected_logprobs forward"]
    for name, s in med.items():
        print(f"| {name} | {1e3 * s:.1f} | {s / forward:.3f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
