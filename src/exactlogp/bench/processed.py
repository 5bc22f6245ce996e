"""What the exact cut costs: processed logprobs (top-k / top-p) against the plain op,
forward and forward+backward, and `exactlogp.sample` against eager torch's sort-based
top-p sampling, on this machine.

    PYTHONPATH=src python benchmarks/processed.py [--rows 1024 --vocab 151936 --decode 64]

Interleaved, shuffled rounds (report.measure); medians. Both logprob steps run without a
TP group and with validate=False (no host checks besides the cut's own). The sort-based
sampler is the usual eager recipe: sort each row, softmax, running sum, drop the tail
past p, renormalise, torch.multinomial.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

import exactlogp
from exactlogp.bench.cpu import machine
from exactlogp.report import measure
from exactlogp.testing import llm_like_logits


def sort_top_p_sample(logits: torch.Tensor, top_p: float, generator) -> torch.Tensor:
    """Eager torch: the sort-based top-p cut of the float softmax, then multinomial."""
    values, ids = logits.float().sort(dim=-1, descending=True)
    probs = values.softmax(-1)
    before = probs.cumsum(-1) - probs  # the mass of the larger tokens
    probs = probs.masked_fill(before > top_p, 0.0)
    pick = torch.multinomial(probs / probs.sum(-1, keepdim=True), 1, generator=generator)
    return ids.gather(-1, pick).squeeze(-1)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--decode", type=int, default=64, help="rows of the sampling step")
    p.add_argument("--top-k", type=int, default=50)
    p.add_argument("--top-p", type=float, default=0.9)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    x, t = llm_like_logits(args.rows, args.vocab, torch.bfloat16, seed=0, targets="uniform")
    d, _ = llm_like_logits(args.decode, args.vocab, torch.float32, seed=1, targets="uniform")
    gen = torch.Generator().manual_seed(0)
    cut = dict(top_k=args.top_k, top_p=args.top_p)
    xg = x.clone().requires_grad_(True)

    def backward(fn):
        xg.grad = None
        fn(xg, t, validate=False).logprobs.sum().backward()

    steps = {
        "selected_logprobs (plain forward)": lambda: exactlogp.selected_logprobs(
            x, t, validate=False
        ),
        f"processed_logprobs top_k={args.top_k} top_p={args.top_p}": lambda: (
            exactlogp.processed_logprobs(x, t, validate=False, **cut)
        ),
        "selected_logprobs forward+backward": lambda: backward(exactlogp.selected_logprobs),
        "processed_logprobs forward+backward": lambda: backward(
            lambda *a, **k: exactlogp.processed_logprobs(*a, **k, **cut)
        ),
        f"sample top_p={args.top_p}": lambda: exactlogp.sample(
            d, generator=gen, top_p=args.top_p, validate=False
        ),
        f"eager sort-based top-p sample top_p={args.top_p}": lambda: sort_top_p_sample(
            d, args.top_p, gen
        ),
    }
    seconds = measure.interleaved(steps, args.repeats, warmup=1)
    med = {k: statistics.median(v) for k, v in seconds.items()}
    names = list(med)
    base = {names[0]: names[0], names[1]: names[0], names[2]: names[2], names[3]: names[2]}
    base.update({names[4]: names[5], names[5]: names[5]})
    info = machine()
    print(f"CPU: {info['cpu']}, {info['cores']} cores, torch {info['versions']['torch']}, "
          f"{torch.get_num_threads()} threads")  # fmt: skip
    print(f"| step | shape | median ms ({args.repeats} rounds) | vs |")
    print("|---|---|---|---|")
    for name in names:
        shape = f"{args.rows} x {args.vocab} bf16" if name in names[:4] else (
            f"{args.decode} x {args.vocab} fp32"
        )  # fmt: skip
        ratio = med[name] / med[base[name]]
        print(f"| {name} | {shape} | {1e3 * med[name]:.1f} | {ratio:.2f}x {base[name]} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
