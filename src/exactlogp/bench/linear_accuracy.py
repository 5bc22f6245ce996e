"""Accuracy of the exact fused LM head against fp64, beside the pipelines users run.

On realistic rows (exactlogp.testing.lm_head_inputs: RMS-normed hidden with a norm weight
around 1 and a few 8x channels, logits spread like a trained model's, confident and flat
rows), bf16 inputs, for several hidden sizes: the largest absolute error of the logits
against the fp64 GEMM, and of logprob and entropy against the fp64 GEMM + fp64 log-softmax,
for exactlogp, the fp32-GEMM pipeline and the common bf16-GEMM-output pipeline.

    PYTHONPATH=src python benchmarks/linear_accuracy.py [--rows 64 --vocab 4000] [--out DIR]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

import exactlogp
from exactlogp.testing import lm_head_inputs


def _lp_ent(z: torch.Tensor, t: torch.Tensor):
    lp = torch.log_softmax(z, -1)
    return lp.gather(-1, t.unsqueeze(-1)).squeeze(-1), -(lp.exp() * lp).sum(-1)


def measure(rows: int, hidden: int, vocab: int, seed: int) -> dict:
    h, w, t = lm_head_inputs(rows, hidden, vocab, torch.bfloat16, seed=seed)
    z64 = h.double() @ w.double().T
    lp64, ent64 = _lp_ent(z64, t)
    ours = exactlogp.linear_selected_logprobs(h, w, t, with_entropy=True)
    z32 = h.float() @ w.float().T
    zb = (h @ w.T).float()
    out = {
        "exactlogp": (exactlogp.linear_logits(h, w), ours.logprobs, ours.entropy),
        "fp32 GEMM + log_softmax": (z32, *_lp_ent(z32, t)),
        "bf16 GEMM output + fp32 log_softmax": (zb, *_lp_ent(zb, t)),
    }

    def err(a, b):
        return (a.double() - b).abs().max().item()

    return {
        name: (err(z, z64), err(lp, lp64), err(ent, ent64)) for name, (z, lp, ent) in out.items()
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--vocab", type=int, default=4000)
    p.add_argument("--hidden", default="256,1024,2048,4096")
    p.add_argument("--seed", type=int, default=6)
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    lines = [
        f"Max |error| vs fp64 ({args.rows} rows x {args.vocab} columns, bf16 inputs, seed "
        f"{args.seed}; `PYTHONPATH=src python benchmarks/linear_accuracy.py`)",
        "",
        "| H | pipeline | logits | logprob | entropy |",
        "|---|---|---|---|---|",
    ]
    for hidden in (int(v) for v in args.hidden.split(",")):
        for name, (ez, elp, eent) in measure(args.rows, hidden, args.vocab, args.seed).items():
            lines.append(f"| {hidden} | {name} | {ez:.2e} | {elp:.2e} | {eent:.2e} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "linear_accuracy.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
