"""Where the CPU backend's value tables pay: per-row time of the partials and grad passes
with value_tables="never" (direct loops) and "always", one thread, for bf16 and fp16 rows
of several lengths (exactlogp.testing.llm_like_logits rows, 2^22 logits per shape).

    PYTHONPATH=src python benchmarks/cpu_value_tables.py [--vocab 8192,16384,32768,65536]

The thresholds of value_tables="auto" (exactlogp.backends.cpu.TABLE_MIN_COLS_BY_PASS) come from
this table. Both modes give the same bits; the script checks that too.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from exactlogp import contract
from exactlogp.backends import ShardPlan
from exactlogp.backends.cpu import CpuBackend
from exactlogp.temperature import ONE
from exactlogp.testing import llm_like_logits


def _median_us(fn, repeats: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return 1e6 * statistics.median(times), out


def measure(dtype: torch.dtype, vocab: int, repeats: int) -> dict:
    rows = max(16, (1 << 22) // vocab)
    x, target = llm_like_logits(rows, vocab, dtype, seed=0)
    plan = ShardPlan(0, None, -100, True)
    out, results = {}, {}
    for mode in ("never", "always"):
        backend = CpuBackend(num_threads=1, value_tables=mode)
        row_max = backend.row_max(x, ONE, None, plan)
        t_partials, record = _median_us(
            lambda b=backend, m=row_max: b.partials(x, target, ONE, None, m, plan), repeats
        )
        fin = contract.finalize(row_max, record, target, None, -100, None)
        one = torch.ones(rows, dtype=torch.float64)
        stats = contract.grad_stats(row_max, fin, -one, one, None)
        t_grad, grad = _median_us(
            lambda b=backend, s=stats: b.grad(x, target, ONE, None, s, plan), repeats
        )
        out[mode] = (t_partials / rows, t_grad / rows)
        results[mode] = (record, grad)
    (rec_n, grad_n), (rec_t, grad_t) = results["never"], results["always"]
    same = torch.equal(rec_n, rec_t) and torch.equal(
        grad_n.view(torch.int16), grad_t.view(torch.int16)
    )
    if not same:
        raise AssertionError(f"value tables changed the bits ({dtype}, vocab {vocab})")
    distinct = [torch.unique(x[i].view(torch.int16)).numel() for i in range(min(rows, 8))]
    out["distinct"] = statistics.mean(distinct)
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocab", default="8192,16384,32768,65536")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    print("| dtype | columns | distinct values per row | partials us/row direct | tables "
          "| grad us/row direct | tables |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for dtype in (torch.bfloat16, torch.float16):
        for vocab in (int(v) for v in args.vocab.split(",")):
            r = measure(dtype, vocab, args.repeats)
            (pd, gd), (pt, gt) = r["never"], r["always"]
            name = str(dtype).removeprefix("torch.")
            print(f"| {name} | {vocab} | {r['distinct']:.0f} | {pd:.1f} | {pt:.1f} | {gd:.1f} "
                  f"| {gt:.1f} |")  # fmt: skip


if __name__ == "__main__":
    main()
