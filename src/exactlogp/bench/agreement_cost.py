"""What failing closed costs: the forward at the Qwen3-Next shape over a TP4 gloo world.

In one world (real torch.distributed processes on 127.0.0.1, one thread per rank) the same
shard is timed, interleaved in a shuffled order per repeat:
  validate=True   the agreement all_gather + host read, then MAX (with the agreement values
                  riding it) and the int64 SUM
  validate=False  the MAX with the agreement values and the SUM, no host sync
and the collectives alone: the all_reduce(MAX) of N fp32 (what it was) and of the payload
(what it is), and the agreement all_gather. With --before SRC (a source tree of an earlier
exactlogp, e.g. a `git worktree` of the last commit without agreement) the same forward of
that tree is timed in worlds alternating with worlds of this one.

    PYTHONPATH=src python benchmarks/agreement_cost.py [--tokens 1024 --vocab 151936]
        [--before /path/to/old/src] [--out docs/performance/agreement_cost.md]

Timings are wall clock of the slowest rank (a barrier before each), medians of --repeats.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

TP = 4


def _world_main(args) -> dict:
    """Inside one rank of a world: time the variants, return rank 0's medians."""
    import torch
    import torch.distributed as dist

    import exactlogp

    torch.set_num_threads(1)
    group = dist.group.WORLD
    gen = torch.Generator().manual_seed(0)
    per = -(-args.vocab // TP)
    x = (torch.randn(args.tokens, per, generator=gen) * 2.5).to(torch.bfloat16)
    target = torch.randint(0, args.vocab, (args.tokens,), generator=gen)

    def forward(validate):
        return lambda: exactlogp.selected_logprobs(
            x, target, tp_group=group, vocab_size=args.vocab, validate=validate
        )

    variants = {"forward, validate=True": forward(True), "forward, validate=False": forward(False)}
    if not args.forward_only:
        n = args.tokens
        small = torch.zeros(n)
        payload = torch.zeros(7 * n + 6 + 2 * TP)
        vec = torch.zeros(50, dtype=torch.int64)

        def reduce(t):
            return lambda: dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)

        def gather():
            parts = [torch.empty_like(vec) for _ in range(TP)]
            return dist.all_gather(parts, vec, group=group)

        variants.update({
            f"all_reduce(MAX) of {n} fp32": reduce(small),
            f"all_reduce(MAX) of the payload ({payload.numel()} fp32)": reduce(payload),
            "agreement all_gather (50 int64 per rank)": gather,
        })  # fmt: skip
    for fn in variants.values():
        fn()  # warm-up: lazy imports, the compiled kernels
    seconds: dict[str, list[float]] = {k: [] for k in variants}
    order = list(variants)
    rng = random.Random(args.seed)
    for _ in range(args.repeats):
        rng.shuffle(order)  # the same order on every rank: one seed
        for name in order:
            dist.barrier(group)
            start = time.perf_counter()
            variants[name]()
            elapsed = torch.tensor([time.perf_counter() - start])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
            seconds[name].append(float(elapsed))
    return {k: v for k, v in seconds.items()}


def _run_world(src: str, args, forward_only: bool) -> dict:
    """One TP4 world of fresh processes on `src`; rank 0's per-variant seconds."""
    env = dict(os.environ, PYTHONPATH=src)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={TP}",
        "--master-addr=127.0.0.1", f"--master-port={_free_port()}", __file__, "--world",
        "--tokens", str(args.tokens), "--vocab", str(args.vocab), "--repeats", str(args.repeats),
        "--seed", str(args.seed),
    ] + (["--forward-only"] if forward_only else [])  # fmt: skip
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
    for line in run.stdout.splitlines():
        if line.startswith("{"):
            return json.loads(line)
    raise RuntimeError(f"world on {src} failed:\n{run.stderr[-3000:]}")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--rounds", type=int, default=3, help="alternating worlds with --before")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--before", help="src directory of an earlier exactlogp to compare with")
    p.add_argument("--out", type=Path, help="write the Markdown table here")
    p.add_argument("--world", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--forward-only", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.world:
        import torch.distributed as dist

        dist.init_process_group("gloo")
        try:
            result = _world_main(args)
            if dist.get_rank() == 0:
                print(json.dumps(result), flush=True)
        finally:
            dist.destroy_process_group()
        return 0

    here = str(Path(__file__).resolve().parents[2])  # the src directory of this tree
    seconds: dict[str, list[float]] = {}
    for r in range(args.rounds if args.before else 1):
        print(f"round {r + 1}: this tree", file=sys.stderr, flush=True)
        for k, v in _run_world(here, args, forward_only=False).items():
            seconds.setdefault(k, []).extend(v)
        if args.before:
            print(f"round {r + 1}: {args.before}", file=sys.stderr, flush=True)
            old = _run_world(args.before, args, forward_only=True)
            seconds.setdefault("before: forward (no agreement)", []).extend(
                old["forward, validate=True"]
            )
    lines = [
        f"Forward at {args.tokens} x {args.vocab} bf16, TP {TP} over gloo (one thread per "
        f"rank), slowest rank per run; medians (min-max) of {len(next(iter(seconds.values())))} "
        "runs, interleaved in a shuffled order"
        + (f" within each world, worlds alternating with {args.before}" if args.before else ""),
        "",
        "| what | ms, median (min-max) |",
        "|---|---|",
    ]
    for name, v in seconds.items():
        lines.append(
            f"| {name} | {statistics.median(v) * 1e3:.2f} ({min(v) * 1e3:.2f}-{max(v) * 1e3:.2f}) |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
