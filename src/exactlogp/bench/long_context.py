"""Long context: the exact fused LM head against full logits + log_softmax, growing N.

A packed sequence of N tokens through a large vocabulary (248320, a 248k-vocabulary
model's) at a small hidden size, forward and backward of -sum(logprobs), each step in a
fresh process for its peak extra memory (inputs excluded) and its wall time:

  exactlogp   linear_selected_logprobs: logits in blocks of rows, never [N, V]
  full        (h @ W^T).float(), log_softmax, gather: what RL trainers run today (the
              [N, V] fp32 logits, their log_softmax and its gradient)

Where the full pipeline would not fit in this machine's memory its row says so and how
much it would need (`full_bytes`), and it is not run.

    PYTHONPATH=src python benchmarks/long_context.py --tokens 1024,2048,4096,8192
    ... --out docs/performance   # writes long_context.md
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

import exactlogp
from exactlogp.report import environment, measure

VOCAB = 248320
FULL_BYTES_PER_LOGIT = 2 + 4 + 4 + 4  # bf16 logits, fp32 copy, log_softmax, its gradient


def inputs(n: int, hidden: int, vocab: int, seed: int = 0, block: int = 512):
    """(hidden (N, H) bf16, weight (V, H) bf16, target (N,)): RMS-normed hidden states and
    a Gaussian head whose logits spread with std ~3, the targets drawn from each row's
    softmax a block of rows at a time (testing.lm_head_inputs holds all N x V logits in
    fp64: 16 GB at 8192 x 248320)."""
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(n, hidden, generator=gen)
    h = (h * h.pow(2).mean(-1, keepdim=True).add(1e-6).rsqrt()).to(torch.bfloat16)
    w = (torch.randn(vocab, hidden, generator=gen) * (3.0 / hidden**0.5)).to(torch.bfloat16)
    target = torch.cat([
        torch.multinomial(torch.softmax(h[r : r + block].float() @ w.float().T, -1), 1,
                          generator=gen).squeeze(-1)
        for r in range(0, n, block)
    ])  # fmt: skip
    return h, w, target


def _step(name: str, n: int, hidden: int, vocab: int):
    h, w, t = inputs(n, hidden, vocab)
    h.requires_grad_(True)
    w.requires_grad_(True)

    def exact():
        res = exactlogp.linear_selected_logprobs(h, w, t)
        (-res.logprobs.sum()).backward()

    def full():
        z = (h @ w.T).float()
        lp = torch.log_softmax(z, -1).gather(-1, t.unsqueeze(-1)).squeeze(-1)
        (-lp.sum()).backward()

    return {"exactlogp": exact, "full": full}[name]


def _child(args) -> int:
    fn = _step(args.child, args.child_tokens, args.hidden, args.vocab)
    peak = measure.PeakMemory(torch.device("cpu"))
    start = time.perf_counter()
    fn()
    seconds = time.perf_counter() - start
    print(json.dumps({"peak_mib": peak.read(), "seconds": seconds}))
    return 0


def _run(args, name: str, n: int) -> dict | None:
    cmd = [sys.executable, __file__, "--child", name, "--child-tokens", str(n),
           "--hidden", str(args.hidden), "--vocab", str(args.vocab)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=7200)
    for line in reversed(done.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    print(done.stderr[-2000:], file=sys.stderr)
    return None


def full_bytes(n: int, vocab: int) -> int:
    """What the full pipeline holds at once, besides its inputs: the [N, V] logits in
    bf16 and fp32, their log_softmax and its gradient."""
    return n * vocab * FULL_BYTES_PER_LOGIT


def _available_mib() -> float:
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("inf")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", default="1024,2048,4096,8192")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--vocab", type=int, default=VOCAB)
    p.add_argument("--out", type=Path)
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--child-tokens", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return _child(args)
    sizes = [int(v) for v in args.tokens.split(",")]
    lines = [
        f"## Long context: N tokens x H {args.hidden} x V {args.vocab} bf16, forward + "
        "backward (CPU)",
        "",
        f"Command: `PYTHONPATH=src python benchmarks/long_context.py "
        f"{' '.join(sys.argv[1:] if argv is None else argv)}`  ",
        f"Machine: {environment.cpu_model()}, {os.cpu_count()} cores, torch {torch.__version__}, "
        f"{time.strftime('%Y-%m-%d %H:%M %Z')}; one run per cell, each in a fresh process "
        "(peak extra memory: VmHWM over the inputs).",
        "",
        "| N | exactlogp s | exactlogp peak MiB | full s | full peak MiB | full / exactlogp "
        "memory |",
        "|---|---|---|---|---|---|",
    ]
    for n in sizes:
        print(f"N = {n}: exactlogp", file=sys.stderr, flush=True)
        ours = _run(args, "exactlogp", n)
        need = full_bytes(n, args.vocab) / 2**20
        if need > 0.8 * _available_mib():
            full = None
            full_text = (f"not run | needs ~{need:,.0f} (> 80% of the "
                         f"{_available_mib():,.0f} MiB available)")  # fmt: skip
        else:
            print(f"N = {n}: full logits", file=sys.stderr, flush=True)
            full = _run(args, "full", n)
            full_text = "failed | -" if full is None else (
                f"{full['seconds']:.1f} | {full['peak_mib']:,.0f}"
            )  # fmt: skip
        ratio = "-"
        if ours and full:
            ratio = f"{full['peak_mib'] / ours['peak_mib']:.1f}x"
        ours_text = "failed | -" if ours is None else (
            f"{ours['seconds']:.1f} | {ours['peak_mib']:,.0f}"
        )  # fmt: skip
        lines.append(f"| {n} | {ours_text} | {full_text} | {ratio} |")
        print(lines[-1], file=sys.stderr, flush=True)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "long_context.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
