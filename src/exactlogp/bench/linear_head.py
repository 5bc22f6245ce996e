"""The exact fused LM head on the CPU, side by side with what a user would run instead.

Candidates, on the same hidden states (N, H) and LM-head weight (V, H), one process:
  exactlogp   linear_selected_logprobs (backend auto), loss = -sum(logprobs); and the same
              with its backward on a predicted grid (as past linear.GRAD_KEEP_BYTES)
  torch bf16  log_softmax((h @ W^T).float()) + gather: what a bf16 model runs today
  torch fp32  log_softmax(h.float() @ W.float()^T) + gather: the fp32-GEMM pipeline
  compiled    torch.compile of the fp32 pipeline (compiled once, warm-up excluded)
Forward and forward+backward, interleaved in a shuffled order per round (medians, min-max),
then the peak extra memory of each step, each in a fresh process (inputs excluded).

    PYTHONPATH=src python benchmarks/linear_head.py                  # 512 x 1024 x 32000 bf16
    PYTHONPATH=src python benchmarks/linear_head.py --tokens 2048 --hidden 256 --vocab 151936
        --memory-only                                                # the memory bound's shape
    ... --out docs/performance                                       # writes linear_head.md

Timings are this machine's (the ISA the fp64 and bf16 GEMMs use is printed); the ratios
are what to compare.
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
from exactlogp import linear
from exactlogp.bench.cpu import isa_caps
from exactlogp.report import environment, measure
from exactlogp.testing import grad_keep_bytes, lm_head_inputs

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def steps(h, w, t):
    """{name: (forward, forward_backward)} on the inputs."""

    def exact(x, wt, backward, predicted=False):
        with grad_keep_bytes(0 if predicted else linear.GRAD_KEEP_BYTES):
            res = exactlogp.linear_selected_logprobs(x, wt, t)
        if backward:
            (-res.logprobs.sum()).backward()
        return res.logprobs

    def torch_pipeline(x, wt, backward, fp32):
        z = (x.float() @ wt.float().T) if fp32 else (x @ wt.T).float()
        lp = torch.log_softmax(z, -1).gather(-1, t.unsqueeze(-1)).squeeze(-1)
        if backward:
            (-lp.sum()).backward()
        return lp

    compiled = torch.compile(lambda x, wt: torch_pipeline(x, wt, False, True))

    def grad_inputs():
        return h.detach().requires_grad_(True), w.detach().requires_grad_(True)

    def both(fn):
        return (lambda: fn(h, w, False), lambda: fn(*grad_inputs(), True))

    def compiled_both():
        def fwd_bwd():
            x, wt = grad_inputs()
            out = compiled(x, wt)
            (-out.sum()).backward()
            return out

        return (lambda: compiled(h, w), fwd_bwd)

    return {
        "exactlogp linear_selected_logprobs": both(exact),
        "exactlogp, backward on a predicted grid (GRAD_KEEP_BYTES=0)": both(
            lambda x, wt, b: exact(x, wt, b, predicted=True)
        ),
        "torch bf16 GEMM + fp32 log_softmax": both(
            lambda x, wt, b: torch_pipeline(x, wt, b, False)
        ),
        "torch fp32 GEMM + log_softmax": both(lambda x, wt, b: torch_pipeline(x, wt, b, True)),
        "torch.compile of the fp32 pipeline": compiled_both(),
    }


def _child(args) -> int:
    h, w, t = lm_head_inputs(args.tokens, args.hidden, args.vocab, DTYPES[args.dtype], seed=0)
    fns = steps(h, w, t)[args.child_name]
    fn = fns[0] if args.child_mode == "forward" else fns[1]
    fn()  # warm-up: lazy imports, kernels, compilation
    peak = measure.PeakMemory(torch.device("cpu"))
    out = fn()
    mib = peak.read()
    del out
    print(json.dumps({"peak_mib": mib}))
    return 0


def _memory(args, name: str, mode: str) -> float | None:
    cmd = [sys.executable, __file__, "--tokens", str(args.tokens), "--hidden", str(args.hidden),
           "--vocab", str(args.vocab), "--dtype", args.dtype, "--child-name", name,
           "--child-mode", mode]  # fmt: skip
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    run = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    for line in reversed(run.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)["peak_mib"]
    print(run.stderr[-2000:], file=sys.stderr)
    return None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--memory-only", action="store_true")
    p.add_argument("--no-memory", action="store_true")
    p.add_argument("--out", type=Path)
    p.add_argument("--child-name", help=argparse.SUPPRESS)
    p.add_argument("--child-mode", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child_name:
        return _child(args)
    shape = f"{args.tokens} x {args.hidden} x {args.vocab} {args.dtype}"
    h, w, t = lm_head_inputs(args.tokens, args.hidden, args.vocab, DTYPES[args.dtype], seed=0)
    table = steps(h, w, t)
    names = list(table)
    rows = {name: {} for name in names}
    if not args.memory_only:
        timed = {(n, m): table[n][i] for n in names for i, m in enumerate(measure.MODES)}
        print(f"timing {shape}, {args.repeats} rounds", file=sys.stderr, flush=True)
        seconds = measure.interleaved(timed, args.repeats, warmup=1)
        for (n, m), v in seconds.items():
            rows[n][m] = measure.Timing.of(v)
    if not args.no_memory:
        for n in names:
            for m in measure.MODES:
                print(f"peak memory: {n} {m}", file=sys.stderr, flush=True)
                rows[n][m + "_mib"] = _memory(args, n, m)
    ours = names[0]
    argv_text = " ".join(sys.argv[1:] if argv is None else argv)
    command = " ".join(
        [*isa_caps(), f"PYTHONPATH=src python benchmarks/linear_head.py {argv_text}"]
    )
    method = ""
    if not args.memory_only:
        method += f"; medians (min-max) of {args.repeats} rounds, interleaved in a shuffled order"
    if not args.no_memory:
        method += "; peak extra memory of one step in a fresh process"
    lines = [
        f"## Fused LM head, {shape} (CPU)",
        "",
        f"Command: `{command}`  ",
        f"Machine: {environment.cpu_model()}, {os.cpu_count()} cores, torch {torch.__version__}, "
        f"{time.strftime('%Y-%m-%d %H:%M %Z')}{method}.",
        "",
        "| candidate | forward ms | fwd+bwd ms | forward / ours | fwd+bwd / ours "
        "| peak MiB forward | peak MiB fwd+bwd |",
        "|---|---|---|---|---|---|---|",
    ]
    for n in names:
        lines.append(_row(n, rows[n], rows[ours]))
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        name = f"linear_head_{args.tokens}x{args.hidden}x{args.vocab}_{args.dtype}.md"
        (args.out / name).write_text(text)
    return 0


def _row(name: str, r: dict, ours: dict) -> str:
    def ms(mode):
        tm = r.get(mode)
        return (
            "-" if tm is None else f"{tm.median * 1e3:.0f} ({tm.low * 1e3:.0f}-{tm.high * 1e3:.0f})"
        )

    def ratio(mode):
        a, b = ours.get(mode), r.get(mode)
        return "-" if a is None or b is None else f"{b.median / a.median:.2f}x"

    def mib(key):
        v = r.get(key)
        return "-" if v is None else f"{v:.0f}"

    return (
        f"| {name} | {ms('forward')} | {ms('forward_backward')} | {ratio('forward')} "
        f"| {ratio('forward_backward')} | {mib('forward_mib')} | {mib('forward_backward_mib')} |"
    )


if __name__ == "__main__":
    sys.exit(main())
