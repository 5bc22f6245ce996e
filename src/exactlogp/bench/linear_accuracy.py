"""Accuracy of the exact fused LM head against fp64, beside the pipelines users run.

On realistic rows (exactlogp.testing.lm_head_inputs: RMS-normed hidden with a norm weight
around 1, logits spread like a trained model's, confident and flat rows) with outlier
channels -- H // 64 channels 8x the rest (the default), or two channels 1x / 30x / 100x /
1000x -- in bf16, and with fp32 inputs: the largest absolute error of the logits against
the exact dot products (exactlogp.testing's Python-integer definition on a sample of
columns, the fp64 GEMM elsewhere), and of logprob and entropy against the fp64 GEMM + fp64
log-softmax, for exactlogp, the fp32-GEMM pipeline and the common bf16-GEMM-output
pipeline; the share of exactlogp's logits equal to the correctly rounded ones; and the
gradients' norm-wise relative error against fp64 autograd (exactlogp and the fp32
pipeline).

    PYTHONPATH=src python benchmarks/linear_accuracy.py [--rows 64 --vocab 8192]
        [--hidden 4096] [--out DIR]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

import exactlogp
from exactlogp.testing import exact_logits, lm_head_inputs

WORKLOADS = [("bf16", "8x (H/64 channels)"), ("bf16", "1x"), ("bf16", "30x"), ("bf16", "100x"),
             ("bf16", "1000x"), ("fp32", "8x (H/64 channels)")]  # fmt: skip
EXACT_COLUMNS = 24  # columns checked against the Python-integer definition, per row


def inputs(rows, hidden, vocab, dtype, outlier, seed):
    kind = torch.bfloat16 if dtype == "bf16" else torch.float32
    if outlier.startswith("8x"):
        return lm_head_inputs(rows, hidden, vocab, kind, seed=seed)
    return lm_head_inputs(rows, hidden, vocab, kind, seed=seed,
                          outlier=float(outlier[:-1]), outlier_channels=2)  # fmt: skip


def _lp_ent(z: torch.Tensor, t: torch.Tensor):
    lp = torch.log_softmax(z, -1)
    return lp.gather(-1, t.unsqueeze(-1)).squeeze(-1), -(lp.exp() * lp).sum(-1)


def _grads(h, w, t, fn):
    """(dh, dW) of sum(logprob) + sum(entropy) through fn(h, w) -> (logprob, entropy)."""
    h, w = h.detach().clone().requires_grad_(True), w.detach().clone().requires_grad_(True)
    lp, ent = fn(h, w)
    (lp.sum() + ent.sum()).backward()
    return h.grad.double(), w.grad.double()


def measure(rows, hidden, vocab, dtype, outlier, seed) -> dict:
    h, w, t = inputs(rows, hidden, vocab, dtype, outlier, seed)
    z64 = h.double() @ w.double().T
    lp64, ent64 = _lp_ent(z64, t)
    ours_z = exactlogp.linear_logits(h, w)
    ours = exactlogp.linear_selected_logprobs(h, w, t, with_entropy=True)
    z32 = h.float() @ w.float().T
    zb = (h @ w.T).float()
    cols = torch.linspace(0, vocab - 1, EXACT_COLUMNS).long()
    truth = exact_logits(h, w[cols])  # the correctly rounded logits of these columns
    out = {
        "exactlogp": (ours_z, ours.logprobs, ours.entropy),
        "fp32 GEMM + log_softmax": (z32, *_lp_ent(z32, t)),
    }
    if h.dtype == torch.bfloat16:
        out["bf16-output GEMM + fp32 log_softmax"] = (zb, *_lp_ent(zb, t))

    def err(a, b):
        return (a.double() - b).abs().max().item()

    res = {}
    for name, (z, lp, ent) in out.items():
        exact_share = None
        if name != "bf16-output GEMM + fp32 log_softmax":
            exact_share = (z[:, cols] == truth).double().mean().item()
        res[name] = (err(z, z64), err(lp, lp64), err(ent, ent64), exact_share)
    g64 = _grads(h.double(), w.double(), t, lambda a, b: _lp_ent(a @ b.T, t))
    g_ours = _grads(h, w, t, lambda a, b: tuple(exactlogp.linear_selected_logprobs(
        a, b, t, with_entropy=True))[:2])  # fmt: skip
    g32 = _grads(h.float(), w.float(), t, lambda a, b: _lp_ent(a @ b.T, t))

    def rel(g):  # each gradient in the inputs' dtype, as a trainer receives it: its error,
        # and the share equal to fp64 autograd's gradient rounded once to that dtype
        out = []
        for a, b in zip(g, g64, strict=True):
            a = a.to(h.dtype)
            out += [
                ((a.double() - b).norm() / b.norm()).item(),
                (a == b.to(h.dtype)).double().mean().item(),
            ]
        return tuple(out)

    grads = {"exactlogp": rel(g_ours), "fp32 autograd": rel(g32)}
    return dict(outputs=res, grads=grads)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--seed", type=int, default=6)
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    head = (f"{args.rows} rows x H {args.hidden} x V {args.vocab}, seed {args.seed} "
            "(`PYTHONPATH=src python benchmarks/linear_accuracy.py`)")  # fmt: skip
    lines = [
        f"Max |error| against the exact values, {head}. Logits: against the fp64 GEMM (its "
        f"own error ~1e-12 here); correctly rounded: the share of logits equal to the "
        f"Python-integer definition on {EXACT_COLUMNS} columns per row. logprob, entropy: "
        "against the fp64 GEMM + fp64 log-softmax.",
        "",
        "| inputs | pipeline | logits | correctly rounded | logprob | entropy |",
        "|---|---|---|---|---|---|",
    ]
    grads = [
        "",
        f"Gradients of sum(logprob) + sum(entropy), norm-wise relative error against fp64 "
        f"autograd, each gradient in the inputs' dtype, and the share of its elements equal to "
        f"fp64 autograd's rounded once to that dtype, {head}:",
        "",
        "| inputs | pipeline | d hidden | d hidden correctly rounded | d weight | d weight correctly rounded |",
        "|---|---|---|---|---|---|",
    ]
    for dtype, outlier in WORKLOADS:
        m = measure(args.rows, args.hidden, args.vocab, dtype, outlier, args.seed)
        name = f"{dtype}, {outlier}"
        for pipe, (ez, elp, eent, share) in m["outputs"].items():
            cr = "-" if share is None else f"{share:.1%}"
            lines.append(f"| {name} | {pipe} | {ez:.2e} | {cr} | {elp:.2e} | {eent:.2e} |")
        for pipe, (dh, dh_cr, dw, dw_cr) in m["grads"].items():
            grads.append(f"| {name} | {pipe} | {dh:.1e} | {dh_cr:.1%} | {dw:.1e} | {dw_cr:.1%} |")
        print(lines[-3:], grads[-2:], flush=True)
    text = "\n".join(lines + grads) + "\n"
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "linear_accuracy.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
